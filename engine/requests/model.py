"""What a job request is: its statuses and their transitions, its cancel states, the tables
it lives in, the row as read, and the values the store's methods return.

The transitions of :class:`RequestStatus` are written beside it (:data:`TRANSITIONS`); every
status change of :class:`engine.requests.RequestStore` is one conditional ``UPDATE`` whose
sources are read from there.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import BigInteger, Column, Float, Integer, Table, Text

from engine.tenants import DEFAULT_TENANT
from resources.storage.db import metadata

Clock = Callable[[], float]
DEFAULT_PRIORITY_AGING = 60.0
"""Seconds of waiting worth one priority step (``SEKALI_INTAKE_PRIORITY_AGING``)."""
Merge = Callable[[str, list[dict[str, Any]]], dict[str, Any]]
"""How a debounced job type folds its group's payloads (oldest first) into the one that runs."""


class RequestStatus(StrEnum):
    """Status of a job request. Transitions (anything else is refused by the conditional updates):

    ==========================  ==================================================  ===========
    from                        event                                               to
    ==========================  ==================================================  ===========
    (absent)                    enqueue                                             pending
    pending                     the intake sensor emits its RunRequest              launched
    pending                     a resident worker claims it (its run, an attempt)   running
    launched                    still launched after ``relaunch_after``: re-emit    launched
    pending/launched/running/   its op starts (or a step / run retry restarts it)   running
    failed
    pending/launched/running/   the op finished, or the key was already done        completed
    failed
    pending/launched/running    permanent error, retries exhausted, run failed      failed
    failed                      requeue (operator or DLQ replay)                    pending
    running                     its worker retries it later (``available_at``), or  pending
                                its worker's run ended holding it
    launched                    its run ended before any step took it               pending
    pending                     debounced: another request of its group ran         coalesced
    pending/launched/failed     cancelled (:meth:`RequestStore.cancel`), its key    cancelled
                                held by no live holder; or, cancel requested, the
                                holder of its key gave up
                                (:meth:`RequestStore.settle_requested_cancel`)
    running                     its op stopped at a cancel point after a cancel     cancelled
    completed                   (terminal)
    coalesced                   (terminal; ``coalesced_into`` names the one that
                                ran, whose status is this request's outcome)
    cancelled                   (terminal; ``cancel_*`` say who, why, when, what
                                was done)
    ==========================  ==================================================  ===========

    ``failed`` may still move to ``running``/``completed``: a run retry or a DLQ replay run can
    finish a request after a failed run was recorded.
    """

    PENDING = "pending"
    LAUNCHED = "launched"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    COALESCED = "coalesced"
    CANCELLED = "cancelled"


class CancelState(StrEnum):
    """Where a cancel of a request stands (``request_cancels.cancel_state``; no row: never asked).

    ===========  ========================================================================
    requested    the request was running, or a live holder held its key: its op stops at
                 its next cancel point (:meth:`engine.context.JobContext.cancel_point`), it
                 completes first, or (not running) its key's holder gives up
    cancelled    decided: the request never ran, or stopped before its next side effect
    refused      decided: it had completed (or sent an effect it must record) first
    ===========  ========================================================================
    """

    REQUESTED = "requested"
    CANCELLED = "cancelled"
    REFUSED = "refused"


_S = RequestStatus
INTRODUCED_BY: dict[RequestStatus, str] = {
    _S.COALESCED: "0110_flow_intake",
    _S.CANCELLED: "0140_request_cancel",
}
"""The migration that admitted each status the first releases did not have. A process of an
older release has no name for such a status (reading one, it fails), so it is written only
once every process is declared to know that migration (``sekali db contract``; a database this
release created knows it from the start): :meth:`RequestStore.writable`. Until then the
request takes the path the older release would (sql/README, "A new status")."""
TRANSITIONS: dict[RequestStatus | None, frozenset[RequestStatus]] = {
    None: frozenset({_S.PENDING}),
    _S.PENDING: frozenset(
        {_S.LAUNCHED, _S.RUNNING, _S.COMPLETED, _S.FAILED, _S.COALESCED, _S.CANCELLED}
    ),
    _S.LAUNCHED: frozenset(
        {_S.PENDING, _S.LAUNCHED, _S.RUNNING, _S.COMPLETED, _S.FAILED, _S.CANCELLED}
    ),
    _S.RUNNING: frozenset({_S.PENDING, _S.RUNNING, _S.COMPLETED, _S.FAILED, _S.CANCELLED}),
    _S.FAILED: frozenset({_S.PENDING, _S.RUNNING, _S.COMPLETED, _S.CANCELLED}),
    _S.COMPLETED: frozenset(),
    _S.COALESCED: frozenset(),
    _S.CANCELLED: frozenset(),
}
NOT_STARTED = (_S.PENDING, _S.LAUNCHED, _S.FAILED)
"""Statuses a cancel ends at once, unless a delivery still holds the request's key: no
attempt of the request is running under its row."""


def sources_into(target: RequestStatus) -> list[str]:
    """The statuses that may move to ``target``: the sources of its conditional update."""
    return sorted(str(s) for s, targets in TRANSITIONS.items() if s and target in targets)


job_requests = Table(
    "job_requests",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("job_type", Text, nullable=False),
    Column("key", Text, nullable=False, unique=True),
    Column("payload", Text, nullable=False),
    Column("payload_hash", Text, nullable=False),
    Column("status", Text, nullable=False),
    Column("queue", Text, nullable=False),
    Column("correlation_id", Text),
    Column("run_key", Text),
    Column("run_id", Text),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("attempts", Integer, nullable=False),
    Column("last_error", Text),
    Column("error_class", Text),
    Column("traceparent", Text),
    Column("superseded_by", Text),
    Column("priority", Integer, nullable=False),
    Column("claim_rank", Float, nullable=False),
    Column("dedupe_window", Float),
    Column("debounce_key", Text),
    Column("debounce_wait", Float),
    Column("debounce_max_wait", Float),
    Column("coalesced_into", BigInteger),
    Column("coalesced_count", Integer, nullable=False),
    Column("amends", Text),
    Column("tenant", Text, nullable=False),
    Column("claimed_at", Float),
    Column("available_at", Float),
)

request_cancels = Table(
    "request_cancels",
    metadata,
    Column("request_id", BigInteger, primary_key=True),
    Column("cancel_state", Text, nullable=False),
    Column("cancel_reason", Text),
    Column("cancel_by", Text, nullable=False),
    Column("cancel_requested_at", Float, nullable=False),
    Column("cancel_decided_at", Float),
    Column("cancel_detail", Text),
)

request_sources = Table(
    "request_sources",
    metadata,
    Column("request_id", BigInteger, primary_key=True),
    Column("source", Text, nullable=False),
)

job_rejections = Table(
    "job_rejections",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("job_type", Text, nullable=False),
    Column("key", Text),
    Column("payload", Text, nullable=False),
    Column("field", Text, nullable=False),
    Column("error", Text, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("payload_size", BigInteger),
    Column("payload_sha256", Text),
    Column("source", Text),
)


@dataclass(frozen=True)
class JobRequest:
    """A row of ``job_requests``, as read."""

    id: int
    job_type: str
    key: str
    payload: dict[str, Any]
    payload_hash: str
    status: RequestStatus
    queue: str
    correlation_id: str | None
    run_key: str | None
    run_id: str | None
    created_at: float
    updated_at: float
    attempts: int
    last_error: str | None
    error_class: str | None = None
    traceparent: str | None = None
    priority: int = 0
    """Claim order (higher first, aged by waiting: :meth:`RequestStore.claim_for_launch`)."""
    claim_rank: float = 0.0
    """``created_at - priority * aging``: the intake claims the lowest first."""
    dedupe_window: float | None = None
    """Seconds the key meant one intent when it was derived; None: until finished (forever
    while the records are kept). A windowed key ends in ``@<window start, UTC>``."""
    debounce_key: str | None = None
    debounce_wait: float | None = None
    debounce_max_wait: float | None = None
    coalesced_into: int | None = None
    """For a ``coalesced`` request: the request of its debounce group that ran instead."""
    coalesced_count: int = 0
    """For the request that ran: how many requests of its group were coalesced into it."""
    superseded_by: str | None = None
    """For a failed request an amended replay replaced: the key of the new version."""
    amends: str | None = None
    """For an amended version (``key#vN``): the key of the version it replaces."""
    cancel_state: CancelState | None = None
    cancel_reason: str | None = None
    cancel_by: str | None = None
    cancel_requested_at: float | None = None
    cancel_decided_at: float | None = None
    cancel_detail: str | None = None
    """What the cancel found or did: ``never ran``, where the op stopped, why it was refused."""
    source: str | None = None
    """How the request came in: None for ``enqueue``, ``launchpad`` for a run launched by hand."""
    tenant: str = DEFAULT_TENANT
    """Its job type's fairness key (:mod:`engine.tenants`): the intake shares claims between
    tenants by weight."""
    claimed_at: float | None = None
    """When the intake first claimed it (its wait ends there)."""
    available_at: float | None = None
    """A pending request is not claimed before this (None: at once): its worker gave it back
    for a retry after the policy's delay, or took it back from a dead worker whose lease on
    its key ran until then."""
    dedupe: str = field(init=False)
    """The dedupe window as people read it, ``until_finished`` or e.g. ``86400s``: a field, so
    every generic view of the record (``sekali requests show``) prints it."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dedupe", dedupe_label(self.dedupe_window))

    @classmethod
    def from_row(cls, row: Any) -> JobRequest:
        m = row._mapping
        return cls(
            id=int(m["id"]),
            job_type=m["job_type"],
            key=m["key"],
            payload=json.loads(m["payload"]),
            payload_hash=m["payload_hash"],
            status=RequestStatus(m["status"]),
            queue=m["queue"],
            correlation_id=m["correlation_id"],
            run_key=m["run_key"],
            run_id=m["run_id"],
            created_at=m["created_at"],
            updated_at=m["updated_at"],
            attempts=int(m["attempts"]),
            last_error=m["last_error"],
            error_class=m["error_class"],
            traceparent=m["traceparent"],
            priority=int(m["priority"] or 0),
            claim_rank=float(m["claim_rank"]),
            dedupe_window=m["dedupe_window"],
            debounce_key=m["debounce_key"],
            debounce_wait=m["debounce_wait"],
            debounce_max_wait=m["debounce_max_wait"],
            coalesced_into=None if m["coalesced_into"] is None else int(m["coalesced_into"]),
            coalesced_count=int(m["coalesced_count"] or 0),
            superseded_by=m["superseded_by"],
            amends=m["amends"],
            # named queries written before these columns do not select them
            cancel_state=CancelState(m["cancel_state"]) if m.get("cancel_state") else None,
            cancel_reason=m.get("cancel_reason"),
            cancel_by=m.get("cancel_by"),
            cancel_requested_at=m.get("cancel_requested_at"),
            cancel_decided_at=m.get("cancel_decided_at"),
            cancel_detail=m.get("cancel_detail"),
            source=m.get("source"),
            tenant=m.get("tenant") or DEFAULT_TENANT,
            claimed_at=m.get("claimed_at"),
            available_at=m.get("available_at"),
        )


def windowed_key(key: str, window: float | None, now: float) -> str:
    """The key stored for an intent under a dedupe window: ``key`` itself for "until finished"
    (None), else ``key@<start of the window holding now, UTC>``. Windows are aligned on the Unix
    epoch (a 24 h window starts at 00:00 UTC), so every producer derives the same key for the
    same window without asking anyone; only a producer whose clock is off by more than its
    distance to a boundary derives the neighbouring window's key."""
    if window is None:
        return key
    start = math.floor(now / window) * window
    stamp = datetime.fromtimestamp(start, tz=UTC)
    text_ = stamp.strftime("%Y-%m-%dT%H:%M:%SZ") if start == int(start) else stamp.isoformat()
    return f"{key}@{text_}"


def state_of(request: JobRequest, *, dead_lettered: bool) -> str:
    """What happened to a request, in one word: its status, except a failed request kept by an
    open dead letter (``dead_lettered``) or closed by a newer version (``superseded``).
    Derived for readers, never written: a process of the previous release reads the same
    rows."""
    if request.status is _S.FAILED and request.superseded_by:
        return "superseded"
    if request.status is _S.FAILED and dead_lettered:
        return "dead_lettered"
    return str(request.status)


def iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, tz=UTC).isoformat(timespec="seconds")


def dedupe_label(window: float | None) -> str:
    """``until_finished`` for None, else the window in whole seconds (``86400s``)."""
    return "until_finished" if window is None else f"{window:g}s"


@dataclass(frozen=True)
class Debounced:
    """What a request's debounce group is: its key (job type included) and the timings."""

    key: str
    wait: float
    max_wait: float


@dataclass(frozen=True)
class EnqueueResult:
    """What ``enqueue`` did: ``created`` is False for a duplicate (the existing request)."""

    request: JobRequest
    created: bool

    @property
    def id(self) -> int:
        return self.request.id

    @property
    def key(self) -> str:
        return self.request.key

    @property
    def status(self) -> RequestStatus:
        return self.request.status

    @property
    def duplicate(self) -> bool:
        return not self.created


@dataclass(frozen=True)
class CancelDecision:
    """What :meth:`RequestStore.cancel` did to one request."""

    request: JobRequest
    state: CancelState
    detail: str
    new: bool
    """False when the request had been decided before (cancel is idempotent)."""


@dataclass(frozen=True)
class Backoff:
    """How long a request waits before it is claimed again after its run ended before any step
    took it (a launch that failed, a run that died starting): half the time since it was first
    claimed, at least ``base`` and at most ``cap`` seconds. A launcher that keeps failing
    spaces its relaunches out more and more, with no count to keep; one that failed once costs
    ``base``."""

    base: float = 5.0
    cap: float = 300.0

    def seconds(self, request: JobRequest) -> float:
        since = request.claimed_at if request.claimed_at is not None else request.created_at
        return min(self.cap, max(self.base, (request.updated_at - since) / 2))


UNTAKEN_BACKOFF = Backoff()
