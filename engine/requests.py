"""The intake table: one row per accepted job request, unique on its idempotency key.

A request is what a producer asked for (``enqueue``); the intake sensor turns pending requests
into Dagster runs, and the request's status follows its run. The table is the producer-facing
record; the idempotency ledger (``resources/idempotency.py``) stays the guarantee that the effect
happens once, so a request launched twice (a sensor tick that failed after claiming, a re-emitted
batch) still has one effect.

Guarantees (SQLite and Postgres alike):

- ``enqueue`` is one conditional insert on the unique key: the same key with the same payload
  returns the existing request (``created=False``); with another payload it raises
  :class:`IdempotencyConflict` naming the key. Pass ``conn=`` to write it in your own transaction
  (the transactional outbox): the request exists if and only if your business change commits.
- ``claim_for_launch`` moves a bounded page of requests to ``launched`` in one statement
  (``FOR UPDATE SKIP LOCKED`` on Postgres), so two sensor ticks never claim the same request in
  the same window. A request left ``launched`` longer than ``relaunch_after`` is claimed again:
  that heals a tick that claimed and then failed before Dagster launched its runs; deterministic
  run keys make the re-emission a no-op when the run does exist.
- Every status change is one conditional ``UPDATE`` checked against :data:`TRANSITIONS`.
- Bad input is never lost: :meth:`RequestStore.reject` keeps it in ``job_rejections`` with the
  field, the error and the way in, as a bounded excerpt with the size and sha256 of the whole
  (a 10 MB refusal costs about 1 KiB).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from itertools import groupby
from pathlib import Path
from typing import Any

from sqlalchemy import BigInteger, Column, Float, Integer, Table, Text, bindparam, text
from sqlalchemy.engine import Connection

from engine.tenants import (
    DEFAULT_TENANT,
    TenantStore,
    allocate,
    charged_passes,
    effective_shares,
    setting_from_row,
)
from resources.dlq import UNRESOLVED, DlqStatus, DlqStore, sources_of
from resources.errors import CancelUnavailable, IdempotencyConflict
from resources.idempotency import IdempotencyStore, payload_hash
from resources.storage.db import Database, metadata
from resources.storage.json_text import canonical, digest, masked_digest, storable
from resources.storage.migrations import ReaderFloor
from resources.storage.queries import load_queries
from resources.storage.retention import Expiry

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
_NOT_STARTED = (_S.PENDING, _S.LAUNCHED, _S.FAILED)
"""Statuses a cancel ends at once, unless a delivery still holds the request's key: no
attempt of the request is running under its row."""


def _sources(target: RequestStatus) -> list[str]:
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

_REJECTION_COLUMNS = (
    "id, job_type, key, payload, field, error, created_at, payload_size, payload_sha256, source"
)

_COLUMNS = (
    "id, job_type, key, payload, payload_hash, status, queue, correlation_id, run_key, run_id,"
    " created_at, updated_at, attempts, last_error, error_class, traceparent, priority,"
    " claim_rank, dedupe_window, debounce_key, debounce_wait, debounce_max_wait, coalesced_into,"
    " coalesced_count, superseded_by, amends, tenant, claimed_at, available_at"
)
_QUALIFIED = ", ".join(f"job_requests.{c.strip()}" for c in _COLUMNS.split(","))
"""The columns named with their table (joins, Postgres's claim ``RETURNING``)."""
_READ = (
    "SELECT " + _QUALIFIED  # nosec B608
    + ", c.cancel_state, c.cancel_reason, c.cancel_by, c.cancel_requested_at,"
    " c.cancel_decided_at, c.cancel_detail, s.source"
    " FROM job_requests LEFT JOIN request_cancels c ON c.request_id = job_requests.id"
    " LEFT JOIN request_sources s ON s.request_id = job_requests.id"
)
"""A request with its cancel and source (the side tables of 0140): what readers select."""
_Q = load_queries(Path(__file__).with_suffix(".sql"))


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


def _iso(seconds: float) -> str:
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


_INSERT = f"""
INSERT INTO job_requests
    (job_type, key, payload, payload_hash, status, queue, correlation_id, created_at,
     updated_at, attempts, traceparent, priority, claim_rank, dedupe_window, debounce_key,
     debounce_wait, debounce_max_wait, coalesced_count, amends, tenant, run_id)
VALUES (:job_type, :key, :payload, :hash, :status, :queue, :cid, :now, :now, 0, :traceparent,
        :priority, :rank, :dedupe_window, :debounce_key, :debounce_wait, :debounce_max_wait, 0,
        :amends, :tenant, :run_id)
ON CONFLICT (key) DO NOTHING
RETURNING {_COLUMNS}
"""  # nosec B608: SQL from code constants, values bound

_READY = "(available_at IS NULL OR available_at <= :now)"
"""A pending request that may be claimed now (not given back for a retry later)."""
_CLAIMABLE = (
    "status IN ('pending', 'launched') AND ((status = 'pending'{plain} AND " + _READY + ")"
    " OR (status = 'launched' AND updated_at <= :cutoff))"
)
"""Pending requests outside a debounce group (those leave through :meth:`_claim_debounced`;
while ``coalesced`` may not be written, every pending request is plain), and launched ones
whose tick may have failed before Dagster launched their runs. The leading ``status IN`` lets
both databases read the partial index ``job_requests_claim`` in claim order and stop after a
page, instead of sorting the backlog."""

_DUE_GROUPS = """
SELECT debounce_key, COUNT(*) AS n
FROM job_requests {indexed}
WHERE status = 'pending' AND debounce_key IS NOT NULL AND {ready} {types}
GROUP BY debounce_key
HAVING MAX(created_at) <= :now - MIN(debounce_wait)
    OR MIN(created_at) <= :now - MIN(debounce_max_wait)
ORDER BY MIN(created_at), debounce_key
LIMIT :limit
"""

# SQLite: one statement under the write lock (BEGIN IMMEDIATE), so the rows the subquery picks
# are still claimable when they are updated. ``indexed`` names the claim index: without
# statistics the planner would OR two other indexes and sort the whole backlog.
_CLAIM = """
UPDATE job_requests SET {set}
WHERE id IN (
    SELECT id FROM job_requests {indexed}
    WHERE {claimable} {types}
    ORDER BY {order} LIMIT :limit
)
RETURNING {columns}
"""

# Postgres re-evaluates an ``IN (SELECT ... LIMIT ... FOR UPDATE SKIP LOCKED)`` subquery per
# outer row and can claim more than the limit; a materialised CTE picks the rows exactly once.
_CLAIM_PG = """
WITH picked AS MATERIALIZED (
    SELECT id FROM job_requests
    WHERE {claimable} {types}
    ORDER BY {order} LIMIT :limit FOR UPDATE SKIP LOCKED
)
UPDATE job_requests SET {set}
FROM picked
WHERE job_requests.id = picked.id
RETURNING {columns}
"""


_ACTIVE_TENANTS = """
WITH RECURSIVE active(name) AS (
    SELECT (SELECT tenant FROM job_requests {indexed}
            WHERE status IN ('pending', 'launched') ORDER BY tenant LIMIT 1)
    UNION ALL
    SELECT (SELECT tenant FROM job_requests {indexed}
            WHERE status IN ('pending', 'launched') AND tenant > active.name
            ORDER BY tenant LIMIT 1)
    FROM active WHERE active.name IS NOT NULL
)
SELECT a.name, t.weight, t.min_share, t.max_share, t.pass AS pass_,
    (SELECT COUNT(*) FROM (
        SELECT 1 FROM job_requests {waiting}
        WHERE tenant = a.name AND status IN ('pending', 'launched') AND status = 'pending'
            {plain} {types}
        ORDER BY updated_at LIMIT :limit) p) AS pending,
    (SELECT COUNT(*) FROM (
        SELECT 1 FROM job_requests {waiting}
        WHERE tenant = a.name AND status IN ('pending', 'launched') AND status = 'launched'
            AND updated_at <= :cutoff {types}
        ORDER BY updated_at DESC LIMIT :limit) d) AS due
FROM active a LEFT JOIN tenants t ON t.name = a.name
WHERE a.name IS NOT NULL
"""
"""Each tenant with requests waiting (a skip scan: one index probe per tenant, however long its
backlog), its claimable requests counted up to the page, and its settings and pass (NULL: never
seen). The count is two ranges of ``job_requests_tenant_waiting`` (pending; launched and due
again), so it never reads the table nor walks the tenant's requests already claimed (a pending
request given back for a retry later is counted before its ``available_at``: the page then
comes back that much short, rather than the count reading the table); the
``ORDER BY`` of the index keeps Postgres off a sequential scan that statistics of a large
backlog would otherwise make look cheap under the ``LIMIT``. The launched range is read from its
cutoff down, so the requests in flight (after the cutoff) are never stepped over, however many
dead index entries of earlier claims sit among them."""

_FAIR_BRANCH = """SELECT id FROM (SELECT id FROM job_requests {indexed}
    WHERE tenant = :t{i} AND {claimable} {types} ORDER BY claim_rank, id LIMIT :n{i})"""
_FAIR_BRANCH_PG = """SELECT id FROM (SELECT id FROM job_requests
    WHERE tenant = :t{i} AND {claimable} {types} ORDER BY claim_rank, id LIMIT :n{i}
    FOR UPDATE SKIP LOCKED) p{i}"""
_FAIR_CLAIM = """
UPDATE job_requests SET {set}
WHERE id IN ({branches})
RETURNING {columns}
"""
_FAIR_CLAIM_PG = """
WITH picked AS MATERIALIZED ({branches})
UPDATE job_requests SET {set}
FROM picked
WHERE job_requests.id = picked.id
RETURNING {columns}
"""

_TO_LAUNCHED = "status = 'launched', updated_at = :now, claimed_at = COALESCE(claimed_at, :now)"
_TO_RUNNING = (
    "status = 'running', updated_at = :now, claimed_at = COALESCE(claimed_at, :now),"
    " run_id = :owner, attempts = attempts + 1, available_at = NULL"
)
"""What a claim writes: ``launched`` for the intake sensor (a run is launched next), or
``running`` for a resident worker (its run, ``owner``, takes it now: an attempt)."""


_REFUSE_ON_COMPLETION = text(
    "UPDATE request_cancels SET cancel_state = 'refused', cancel_decided_at = :now,"
    " cancel_detail = 'refused: it completed before its next cancel point (the effect happened)'"
    " WHERE request_id IN :ids AND cancel_state = 'requested'"
).bindparams(bindparam("ids", expanding=True))
"""In the transaction that completes requests: a cancel still ``requested`` is refused, so a
completed request never reads as cancelled (and a cancel never dangles). A cancel committed
before the completion's row update is seen here; one after it waits for the row and finds the
request completed (:meth:`RequestStore.cancel`)."""


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


class RequestStore:
    """The intake table over a :class:`Database`. Thread-safe; share one per process."""

    def __init__(self, db: Database, *, clock: Clock = time.time, fair: bool = True) -> None:
        self.db = db
        self.clock = clock
        self.fair = fair
        """Share claims between tenants (:mod:`engine.tenants`); False claims in ``claim_rank``
        order alone, as before fair share (the benchmark's baseline)."""
        self.readers = ReaderFloor(db)

    def writable(self, status: RequestStatus) -> bool:
        """May ``status`` be written? Not while a process that cannot read it may run
        (:data:`INTRODUCED_BY`)."""
        introduced = INTRODUCED_BY.get(status)
        return introduced is None or self.readers.knows(introduced)

    # -- producers ----------------------------------------------------------------------------

    def enqueue(
        self,
        job_type: str,
        key: str,
        payload: dict[str, Any],
        *,
        queue: str,
        correlation_id: str | None = None,
        traceparent: str | None = None,
        conn: Connection | None = None,
        priority: int = 0,
        dedupe_window: float | None = None,
        debounce: Debounced | None = None,
        aging: float = DEFAULT_PRIORITY_AGING,
        amends: str | None = None,
        tenant: str = DEFAULT_TENANT,
    ) -> EnqueueResult:
        """Write a pending request, or return the existing one for the same key and payload.

        The claim order is ``claim_rank = now - priority * aging``: the request is served as if
        it had arrived ``priority * aging`` seconds earlier (see :meth:`claim_for_launch`).
        ``priority``, ``dedupe_window`` and ``debounce`` are stored as given (the caller,
        :func:`engine.intake.enqueue`, checked them and derived the key); a duplicate keeps the
        first request's. Raises :class:`IdempotencyConflict` when the key exists with another
        payload or type.
        """
        given = payload_hash(payload)
        now = self.clock()
        params = {
            "job_type": job_type,
            "key": key,
            "payload": canonical(payload),
            "hash": given,
            "queue": queue,
            "cid": correlation_id,
            "traceparent": traceparent,
            "now": now,
            "priority": int(priority),
            "rank": now - int(priority) * aging,
            "dedupe_window": dedupe_window,
            "debounce_key": debounce.key if debounce else None,
            "debounce_wait": debounce.wait if debounce else None,
            "debounce_max_wait": debounce.max_wait if debounce else None,
            "amends": amends,
            "status": "pending",
            "run_id": None,
            "tenant": tenant,
        }
        if conn is not None:
            return self._enqueue(conn, params, given)
        with self.db.transaction() as own:
            return self._enqueue(own, params, given)

    def record_run(
        self,
        job_type: str,
        key: str,
        payload: dict[str, Any],
        *,
        queue: str,
        source: str,
        run_id: str | None,
        correlation_id: str | None = None,
        status: RequestStatus = RequestStatus.RUNNING,
    ) -> JobRequest | None:
        """The request record of a run nobody enqueued (launched by hand from the Launchpad, or
        a replay of a dead letter that had none): written ``running`` under its run (or
        ``failed``, for a run about to be launched: never ``pending``, which the intake and the
        workers would take a second time) with its ``source``. The same key and payload stored
        before is that request (the run then takes it through :meth:`mark_running`); None when
        the key is stored with another payload or type (the ledger refuses the run's
        conflicting payload itself)."""
        now = self.clock()
        given = payload_hash(payload)
        params: dict[str, Any] = {
            "job_type": job_type, "key": key, "payload": canonical(payload),
            "hash": given, "queue": queue, "cid": correlation_id,
            "traceparent": None, "now": now, "priority": 0, "rank": now, "dedupe_window": None,
            "debounce_key": None, "debounce_wait": None, "debounce_max_wait": None,
            "amends": None, "status": str(status), "run_id": run_id, "tenant": DEFAULT_TENANT,
        }
        try:
            with self.db.transaction() as conn:
                result = self._enqueue(conn, params, given)
                if result.created:
                    conn.execute(
                        text("INSERT INTO request_sources (request_id, source) VALUES (:id, :s)"),
                        {"id": result.id, "s": source},
                    )
        except IdempotencyConflict:
            return None
        return self.get(result.id)

    def _enqueue(self, conn: Connection, params: dict[str, Any], given: str) -> EnqueueResult:
        row = conn.execute(text(_INSERT), params).first()
        if row is not None:
            return EnqueueResult(JobRequest.from_row(row), created=True)
        existing = conn.execute(
            text(f"SELECT {_COLUMNS} FROM job_requests WHERE key = :key"), {"key": params["key"]}  # nosec B608: SQL from code constants, values bound
        ).first()
        if existing is None:  # pragma: no cover - the conflicting row was rolled back meanwhile
            return self._enqueue(conn, params, given)
        request = JobRequest.from_row(existing)
        if request.payload_hash != given or request.job_type != params["job_type"]:
            raise IdempotencyConflict(request.key, request.payload_hash, given)
        return EnqueueResult(request, created=False)

    def reject(
        self,
        job_type: Any,
        payload: Any,
        *,
        field: str,
        error: str,
        key: Any = None,
        source: str = "enqueue",
        excerpt_bytes: int = 1024,
        conn: Connection | None = None,
    ) -> int:
        """Keep one refused request; returns the rejection id.

        Whatever was sent, the row is small and storable on both databases, and holds no value
        of the payload: its shape (keys and the kind of each value, ``{"to": "<str 15>"}``:
        :func:`resources.storage.json_text.masked_digest`) within ``excerpt_bytes``, with the
        size and sha256 of the whole (to match it against what the producer sent), and the job
        type, key, field and error bounded the same way.
        """
        described = masked_digest(payload, excerpt_bytes)
        params = {
            "job_type": _bounded(job_type, excerpt_bytes) or "",
            "key": _bounded(key, excerpt_bytes),
            "payload": described.excerpt,
            "size": described.size,
            "sha": described.sha256,
            "field": storable(field, excerpt_bytes),
            "error": storable(error, excerpt_bytes),
            "source": storable(source, 64),
            "now": self.clock(),
        }
        sql = text(_Q["insert_rejection"])
        if conn is not None:
            return int(conn.execute(sql, params).scalar_one())
        with self.db.statement() as own:
            return int(own.execute(sql, params).scalar_one())

    # -- the intake sensor ----------------------------------------------------------------------

    def claim_for_launch(
        self,
        limit: int,
        *,
        relaunch_after: float = 120.0,
        job_types: Iterable[str] | None = None,
        merge: Merge | None = None,
    ) -> list[JobRequest]:
        """Move up to ``limit`` requests to ``launched`` and return them, first claimed first.

        Claims ``pending`` ones and ``launched`` ones untouched for ``relaunch_after`` seconds,
        lowest ``claim_rank`` first (``created_at - priority * aging``, fixed at enqueue; ties by
        id). That is the highest effective priority ``priority + waited / aging`` at any moment,
        read from an index instead of sorting the backlog. A request of priority ``p`` is
        overtaken only by requests created less than ``(PRIORITY_MAX - p) * aging`` seconds after
        it: a finite set, so nothing starves however much urgent work keeps arriving.

        Debounced requests (``debounce_key`` set) are claimed a group at a time, once the group
        is due: its newest request is ``debounce_wait`` old (the burst is over) or its oldest is
        ``debounce_max_wait`` old (a steady stream still runs that often). The newest request of
        the group is launched (``merge(job_type, payloads oldest first)`` may replace its payload)
        with ``coalesced_count`` set; every other one becomes ``coalesced`` with ``coalesced_into``
        naming it, in the same transaction, so two claimers never launch one group twice.
        While ``coalesced`` may not be written (:meth:`writable`: a process of the previous
        release may still read requests), debounced requests are claimed one by one like the
        others, as the previous release claims them.
        """
        return self._claim(limit, relaunch_after=relaunch_after, job_types=job_types,
                           merge=merge, to=_TO_LAUNCHED, owner=None)

    def claim_for_worker(
        self,
        limit: int,
        *,
        owner: str,
        job_types: Iterable[str],
        relaunch_after: float = 120.0,
        merge: Merge | None = None,
    ) -> list[JobRequest]:
        """A resident worker's claim: as :meth:`claim_for_launch` (claim order, fair share,
        debounce groups, requests due again), but the requests go straight to ``running`` under
        ``owner`` (the worker's run id), each counting an attempt, in the same statement: no
        run is launched for them, the worker runs them next. Only requests available now
        (``available_at``) are claimed. Every later move of the request by this worker names
        ``owner``, so a worker that lost the request (its run was declared dead and the request
        given to another) moves nothing."""
        return self._claim(limit, relaunch_after=relaunch_after, job_types=job_types,
                           merge=merge, to=_TO_RUNNING, owner=owner)

    def _claim(
        self,
        limit: int,
        *,
        relaunch_after: float,
        job_types: Iterable[str] | None,
        merge: Merge | None,
        to: str,
        owner: str | None,
    ) -> list[JobRequest]:
        if limit <= 0:
            return []
        now = self.clock()
        types = sorted(job_types) if job_types is not None else None
        if types is not None and not types:
            return []
        params: dict[str, Any] = {"now": now, "cutoff": now - relaunch_after, "limit": limit,
                                  "owner": owner, "set": to}
        coalesce = self.writable(_S.COALESCED)
        with self.db.transaction() as conn:
            virtual = TenantStore.lock_clock(conn, now) if self.fair else 0.0
            claimed = self._claim_debounced(conn, params, types, merge) if coalesce else []
            rest = {**params, "limit": max(0, limit - len(claimed))}
            if self.fair:
                plain = self._claim_fair(conn, rest, types, claimed, virtual,
                                         debounced=not coalesce)
            elif rest["limit"]:
                plain = self._claim_plain(conn, rest, types, debounced=not coalesce)
            else:
                plain = []
        if len({r.tenant for r in [*claimed, *plain]}) > 1:
            return sorted(claimed, key=lambda r: (r.claim_rank, r.id)) + plain
        return sorted(claimed + plain, key=lambda r: (r.claim_rank, r.id))

    def _typed(self, sql: str, types: list[str] | None) -> Any:
        statement = text(sql)
        if types is not None:
            statement = statement.bindparams(bindparam("types", expanding=True))
        return statement

    def _claim_plain(
        self, conn: Connection, params: dict[str, Any], types: list[str] | None,
        *, debounced: bool = False,
    ) -> list[JobRequest]:
        template = _CLAIM_PG if self.db.is_postgres else _CLAIM
        columns = self._returning
        sql = template.format(
            indexed="" if self.db.is_postgres else "INDEXED BY job_requests_claim",
            claimable=_CLAIMABLE.format(plain="" if debounced else " AND debounce_key IS NULL"),
            order="claim_rank, id",
            types="AND job_type IN :types" if types is not None else "",
            columns=columns,
            set=params["set"],
        )
        rows = conn.execute(self._typed(sql, types), {**params, "types": types}).all()
        return [JobRequest.from_row(r) for r in rows]

    def _claim_fair(
        self, conn: Connection, params: dict[str, Any], types: list[str] | None,
        earlier: Sequence[JobRequest], virtual: float, *, debounced: bool,
    ) -> list[JobRequest]:
        """The plain requests of a page, split between tenants by :mod:`engine.tenants`: one
        statement finds the tenants with work (a skip scan of ``job_requests_tenant_claim``)
        with their settings, passes and claimable counts (ranges of
        ``job_requests_tenant_waiting``, stopping at the page), the scheduler gives each a
        quota, and one statement claims each tenant's first ``quota`` requests in claim order.
        Returned in the scheduler's slot order; the page (``earlier``, the
        debounced groups claimed before, included) is charged to the tenants' passes."""
        limit = int(params["limit"])
        plain = "" if debounced else " AND debounce_key IS NULL"
        claimable = _CLAIMABLE.format(plain=plain)
        sqlite = not self.db.is_postgres
        fill = {
            "indexed": "INDEXED BY job_requests_tenant_claim" if sqlite else "",
            "claimable": claimable,
            "types": "AND job_type IN :types" if types is not None else "",
        }
        found: Sequence[Any] = []
        if limit:
            found = conn.execute(
                self._typed(_ACTIVE_TENANTS.format(
                    **fill, plain=plain,
                    waiting="INDEXED BY job_requests_tenant_waiting" if sqlite else "",
                ), types),
                {**params, "types": types},
            ).all()
        settings = {r.name: setting_from_row(r) for r in found if r.weight is not None}
        passes = {r.name: float(r.pass_) for r in found if r.pass_ is not None}
        available = {r.name: min(limit, int(r.pending) + int(r.due))
                     for r in found if r.pending or r.due}
        plan = allocate(available, effective_shares(available, settings), passes, virtual, limit)
        picked: list[JobRequest] = []
        if plan.quotas:
            branch = _FAIR_BRANCH_PG if self.db.is_postgres else _FAIR_BRANCH
            bind: dict[str, Any] = {**params, "types": types}
            branches = []
            for i, (tenant, quota) in enumerate(sorted(plan.quotas.items())):
                branches.append(branch.format(i=i, **fill))
                bind[f"t{i}"], bind[f"n{i}"] = tenant, quota
            template = _FAIR_CLAIM_PG if self.db.is_postgres else _FAIR_CLAIM
            sql = template.format(branches=" UNION ALL ".join(branches), columns=self._returning,
                                  set=params["set"])
            rows = conn.execute(self._typed(sql, types), bind).all()
            picked = [JobRequest.from_row(r) for r in rows]
        queues: dict[str, Iterator[JobRequest]] = {}
        for tenant, group in groupby(sorted(picked, key=lambda r: (r.tenant, r.claim_rank, r.id)),
                                     key=lambda r: r.tenant):
            queues[tenant] = iter(list(group))
        ordered = [r for r in (next(queues[t], None) for t in plan.slots if t in queues)
                   if r is not None]
        counts: dict[str, int] = {}
        for request in [*earlier, *ordered]:
            counts[request.tenant] = counts.get(request.tenant, 0) + 1
        TenantStore.charge(conn, charged_passes(plan, counts, passes), counts, plan.clock,
                           float(params["now"]))
        return ordered

    @property
    def _returning(self) -> str:
        return _QUALIFIED if self.db.is_postgres else _COLUMNS

    def _claim_debounced(
        self,
        conn: Connection,
        params: dict[str, Any],
        types: list[str] | None,
        merge: Merge | None,
    ) -> list[JobRequest]:
        due = conn.execute(
            self._typed(
                _DUE_GROUPS.format(
                    ready=_READY,
                    types="AND job_type IN :types" if types is not None else "",
                    indexed="" if self.db.is_postgres else "INDEXED BY job_requests_debounce",
                ),
                types,
            ),
            {**params, "types": types},
        ).all()
        lock = " FOR UPDATE" if self.db.is_postgres else ""
        out: list[JobRequest] = []
        for group in sorted(str(g.debounce_key) for g in due):
            # Every claimer locks a group's rows in the same order; a second claimer waits here,
            # then finds them no longer pending (READ COMMITTED re-reads the locked rows).
            rows = conn.execute(
                text(
                    f"SELECT {_COLUMNS} FROM job_requests WHERE debounce_key = :k"
                    f" AND status = 'pending' AND {_READY}"
                    f" ORDER BY created_at, id{lock}"  # nosec B608: SQL from code constants, values bound
                ),
                {"k": group, "now": params["now"]},
            ).all()
            members = [JobRequest.from_row(r) for r in rows]
            if not members:
                continue
            winner, rest = members[-1], members[:-1]
            payload = winner.payload
            if merge is not None and rest:
                payload = merge(winner.job_type, [m.payload for m in members])
            row = conn.execute(
                text(
                    f"UPDATE job_requests SET {params['set']}, payload = :payload,"
                    " payload_hash = :hash,"
                    " coalesced_count = coalesced_count + :n"
                    f" WHERE id = :id AND status = 'pending' RETURNING {_COLUMNS}"  # nosec B608: SQL from code constants, values bound
                ),
                {"now": params["now"], "owner": params["owner"], "payload": canonical(payload),
                 "hash": payload_hash(payload), "n": len(rest), "id": winner.id},
            ).first()
            if row is None:
                continue
            if rest:
                conn.execute(
                    text(
                        "UPDATE job_requests SET status = 'coalesced', coalesced_into = :into,"
                        " updated_at = :now WHERE id IN :ids AND status = 'pending'"
                    ).bindparams(bindparam("ids", expanding=True)),
                    {"into": winner.id, "now": params["now"], "ids": [m.id for m in rest]},
                )
            out.append(JobRequest.from_row(row))
        return out

    def coalesced_into(self, request_id: int) -> list[JobRequest]:
        """The requests coalesced into ``request_id`` (oldest first)."""
        with self.db.statement() as conn:
            rows = conn.execute(
                text(
                    f"SELECT {_COLUMNS} FROM job_requests WHERE coalesced_into = :id"
                    " ORDER BY created_at, id"  # nosec B608: SQL from code constants, values bound
                ),
                {"id": request_id},
            ).all()
        return [JobRequest.from_row(r) for r in rows]

    def set_run_keys(self, run_keys: dict[int, str]) -> None:
        """Record the run key each launched request was emitted under (for lookups in the UI)."""
        if not run_keys:
            return
        with self.db.transaction() as conn:
            conn.execute(
                text("UPDATE job_requests SET run_key = :rk WHERE id = :id"),
                [{"id": i, "rk": rk} for i, rk in run_keys.items()],
            )

    # -- the run ---------------------------------------------------------------------------------

    def _move_many(
        self,
        request_ids: Sequence[int],
        target: RequestStatus,
        *,
        run_id: str | None = None,
        error: str | None = None,
        error_class: str | None = None,
        count_attempt: bool = False,
        run_key: str | None = None,
        current: bool = False,
        only: Sequence[RequestStatus] | None = None,
        owner: str | None = None,
        available_at: float | None = None,
        conn: Connection | None = None,
    ) -> set[int]:
        """Move every request that may go to ``target`` in one statement; returns those moved.
        ``current``: only requests no newer version superseded. ``only``: only from these
        statuses (of those that may go to ``target``). ``owner``: only requests its worker
        still holds (``run_id``: :meth:`claim_for_worker`). ``available_at``: a request moved
        back to ``pending`` waits until then. ``conn``: in the caller's transaction."""
        if not request_ids:
            return set()
        same_run = " AND run_key = :run_key" if run_key is not None else ""
        if current:
            same_run += " AND superseded_by IS NULL"
        if owner is not None:
            same_run += " AND run_id = :owner"
        sql = text(
            "UPDATE job_requests SET status = :target, updated_at = :now,"
            " run_id = COALESCE(:run_id, run_id),"
            " last_error = CASE WHEN :target = 'failed' THEN :error"
            "   WHEN :target = 'completed' THEN NULL ELSE COALESCE(:error, last_error) END,"
            " error_class = CASE WHEN :target = 'failed' THEN :error_class"
            "   WHEN :target = 'completed' THEN NULL"
            "   ELSE COALESCE(:error_class, error_class) END,"
            " available_at = CASE WHEN :target = 'pending' THEN :available_at"
            "   ELSE available_at END,"
            f" attempts = attempts + {1 if count_attempt else 0}"
            f" WHERE id IN :ids AND status IN :sources{same_run}"
            " RETURNING id"  # nosec B608: SQL from code constants, values bound
        ).bindparams(bindparam("sources", expanding=True), bindparam("ids", expanding=True))
        params = {
            "target": str(target),
            "now": self.clock(),
            "run_id": run_id,
            "error": error,
            "error_class": error_class,
            "ids": list(request_ids),
            "sources": [str(x) for x in _sources(target) if only is None or x in only],
            "run_key": run_key,
            "owner": owner,
            "available_at": available_at,
        }
        if conn is not None:
            return self._moved(conn, sql, params, target)
        if target is not _S.COMPLETED:
            with self.db.statement() as own:
                return {int(i) for i in own.execute(sql, params).scalars()}
        with self.db.transaction() as own:
            return self._moved(own, sql, params, target)

    @staticmethod
    def _moved(
        conn: Connection, sql: Any, params: dict[str, Any], target: RequestStatus
    ) -> set[int]:
        moved = {int(i) for i in conn.execute(sql, params).scalars()}
        if moved and target is _S.COMPLETED:
            # a cancel asked while it ran, not honoured at a cancel point: refused
            conn.execute(_REFUSE_ON_COMPLETION, {"ids": sorted(moved), "now": params["now"]})
        return moved

    def mark_running(self, request_id: int, *, run_id: str | None = None) -> bool:
        """The op took the request (counts an attempt). False if it is already completed."""
        return bool(self._move_many([request_id], _S.RUNNING, run_id=run_id, count_attempt=True))

    def mark_running_many(
        self, request_ids: Sequence[int], *, run_id: str | None = None
    ) -> set[int]:
        """:meth:`mark_running` for a batch in one statement; returns the ids taken."""
        return self._move_many(request_ids, _S.RUNNING, run_id=run_id, count_attempt=True)

    def mark_completed(
        self, request_id: int, *, run_id: str | None = None, run_key: str | None = None
    ) -> bool:
        """``run_key``: only if the request was launched under that run key (reconciliation)."""
        return bool(self._move_many([request_id], _S.COMPLETED, run_id=run_id, run_key=run_key))

    def mark_completed_many(
        self, request_ids: Sequence[int], *, run_id: str | None = None, owner: str | None = None
    ) -> set[int]:
        """:meth:`mark_completed` for a batch in one statement; returns the ids moved.
        ``owner``: only those its worker still holds."""
        return self._move_many(request_ids, _S.COMPLETED, run_id=run_id, owner=owner)

    def mark_failed(
        self,
        request_id: int,
        error: str,
        *,
        error_class: str | None = None,
        run_id: str | None = None,
        run_key: str | None = None,
        owner: str | None = None,
        conn: Connection | None = None,
    ) -> bool:
        """Record a failure with the class the failure path decided (with its DLQ record in
        ``conn``'s transaction: :func:`engine.failures.dead_letter`). ``owner``: only if its
        worker still holds it."""
        moved = self._move_many(
            [request_id],
            _S.FAILED,
            run_id=run_id,
            error=error[:2000],
            error_class=error_class,
            run_key=run_key,
            owner=owner,
            conn=conn,
        )
        return bool(moved)

    def retry_later(
        self, request_id: int, *, owner: str, at: float, error: str, error_class: str
    ) -> bool:
        """A resident worker gives a request back for its retry: ``pending`` again, claimed
        no earlier than ``at`` (the policy's delay), with the error that made it retry. Only
        while ``owner`` still holds it."""
        return bool(self._move_many(
            [request_id], _S.PENDING, owner=owner, available_at=at, error=error[:2000],
            error_class=error_class, only=(_S.RUNNING,),
        ))

    def holders(self) -> list[str]:
        """The runs that hold requests now (``running`` or ``launched`` under their run id):
        what a supervisor checks against the runs still alive."""
        with self.db.statement() as conn:
            rows = conn.execute(text(
                "SELECT DISTINCT run_id FROM job_requests"
                " WHERE status IN ('running', 'launched') AND run_id IS NOT NULL"
            )).all()
        return sorted(str(r[0]) for r in rows)

    def take_back(self, owners: Sequence[str], available: Callable[[str], float | None]
                  ) -> list[JobRequest]:
        """The requests the runs ``owners`` held when they ended (a worker killed, cut off,
        or ended by Dagster) go back to ``pending``: ``running`` ones (a step had taken them:
        the worker may have died mid-handler) become available when ``available(key)`` says
        (the ledger's lease on the key: a takeover before it would find the key held), and
        ``launched`` ones at once. Returns the requests moved, as they were."""
        if not owners:
            return []
        sql = text(
            f"SELECT {_COLUMNS} FROM job_requests WHERE run_id IN :owners"  # nosec B608: SQL from code constants, values bound
            " AND status IN ('running', 'launched')"
        ).bindparams(bindparam("owners", expanding=True))
        with self.db.statement() as conn:
            held = [JobRequest.from_row(r) for r in conn.execute(sql, {"owners": list(owners)})]
        moved = []
        now = self.clock()
        for request in held:
            at = available(request.key) if request.status is _S.RUNNING else None
            if self._move_many(
                [request.id], _S.PENDING, owner=request.run_id,
                available_at=at if at is not None and at > now else None,
                only=(_S.RUNNING, _S.LAUNCHED),
            ):
                moved.append(request)
        return moved

    def settle_unsettled(
        self,
        request_ids: Sequence[int],
        *,
        run_id: str,
        run_key: str | None,
        error: str,
        taken_class: str | None,
        backoff: Callable[[JobRequest], float] = lambda r: UNTAKEN_BACKOFF.seconds(r),
    ) -> tuple[int, int]:
        """Settle the requests a run ended without settling, launched under ``run_key``:
        those no step took (still ``pending`` or ``launched``: they never ran, whatever
        Dagster did with the run) go back to ``pending``, claimable after ``backoff(request)``
        seconds, ``"{error}; no step had taken it"`` kept as their last error; those a step took
        (``running``) fail with ``taken_class`` (None: the DLQ reads the step's own failure).
        Returns (how many went back, how many failed)."""
        now = self.clock()
        back = 0
        for request in self.get_many(request_ids):
            if request.status not in (_S.PENDING, _S.LAUNCHED):
                continue
            back += len(self._move_many(
                [request.id], _S.PENDING, run_key=run_key, only=(_S.PENDING, _S.LAUNCHED),
                available_at=now + backoff(request),
                error=f"{error}; no step had taken it: back in the queue"[:2000],
            ))
        taken = self._move_many(
            request_ids, _S.FAILED, run_id=run_id, error=error[:2000], error_class=taken_class,
            run_key=run_key, only=(_S.RUNNING,),
        )
        return back, len(taken)

    def requeue(self, request_id: int) -> bool:
        """A failed request goes back to pending (operator or DLQ replay); never one a newer
        version superseded (:meth:`supersede`)."""
        return bool(self._move_many([request_id], _S.PENDING, current=True, only=(_S.FAILED,)))

    def supersede(self, request_id: int, by_key: str, *, conn: Connection) -> bool:
        """Close a failed request for good: a newer version (``by_key``) carries its intent.
        Only a ``failed`` request not superseded before moves (a request a retry is running
        is not closed under it); in the caller's transaction, with the version's link."""
        moved = conn.execute(
            text(
                "UPDATE job_requests SET superseded_by = :by, updated_at = :now"
                " WHERE id = :id AND status = 'failed' AND superseded_by IS NULL"
            ),
            {"by": by_key, "now": self.clock(), "id": request_id},  # admitted: whole
        ).rowcount
        return bool(moved)

    def superseded_by(self, request_id: int) -> str | None:
        """The key of the version that replaced this request, if any."""
        with self.db.statement() as conn:
            return conn.execute(
                text("SELECT superseded_by FROM job_requests WHERE id = :id"), {"id": request_id}
            ).scalar()

    # -- cancel ----------------------------------------------------------------------------------

    def cancel(self, request_id: int, *, by: str, reason: str | None = None) -> CancelDecision:
        """Cancel one request, audited (``by``, ``reason``, when). One transaction holding the
        request's row (``FOR UPDATE``; SQLite's ``BEGIN IMMEDIATE``), decided by its status:

        - pending, launched (claimed, its run not started), failed (dead-lettered), with its key
          held by no live holder in the ledger: ``cancelled`` at once. The intake claims only
          pending/launched rows and every run path starts with
          :meth:`mark_running`, whose conditional update has no ``cancelled`` source, so the
          request never runs, whichever of cancel and claim commits first::

              claim commits first   -> the row is ``launched``: cancelled; its run's
                                       mark_running moves nothing and the op runs nothing
              cancel commits first  -> the claim skips it (not pending)
              mark_running first    -> the row is ``running``: the case below

        - the same with its key held by a live holder (:meth:`IdempotencyStore.held`): only
          ``requested``, as for a running one. The row says nothing of that holder: a second
          delivery of a running request took the row (``running`` to ``running``), found the
          key held and gave up, failing the request, while the first still works::

              w1 holds the key, passes its last cancel point; w2 takes the row, gives up: failed
              cancel at once  -> cancelled; w1 sends: an effect after the cancel (the model's
                                 finding_cancel)
              cancel requested -> w1 completes (the cancel refused), stops at a cancel point
                                 (cancelled), or gives up: its failure path, the key free, ends
                                 the request cancelled (:meth:`settle_requested_cancel`)

        - running: ``requested``. The op stops at its next cancel point
          (:meth:`engine.context.JobContext.cancel_point`: before its next checkpoint or
          downstream call, never between a send and its record) and the request ends
          ``cancelled``, or it completes first and the statement that completes it refuses the
          cancel (:data:`_REFUSE_ON_COMPLETION`).
        - completed, coalesced: ``refused``, saying why.

        Raises :class:`CancelUnavailable` while a process that cannot read ``cancelled`` may run
        (:meth:`writable`), and ``KeyError`` for an unknown id.
        """
        if not self.writable(_S.CANCELLED):
            raise CancelUnavailable(
                "cancelling needs every process to know the status 'cancelled' (migration"
                f" {INTRODUCED_BY[_S.CANCELLED]}): run `sekali db contract` once no process of"
                " the previous release runs, then cancel again"
            )
        lock = " FOR UPDATE OF job_requests" if self.db.is_postgres else ""
        with self.db.transaction() as conn:
            row = conn.execute(
                text(f"{_READ} WHERE job_requests.id = :id{lock}"), {"id": request_id}
            ).first()
            if row is None:
                raise KeyError(request_id)
            request = JobRequest.from_row(row)
            now = self.clock()
            held = IdempotencyStore.held(conn, request.key, now)
            decided = request.cancel_state in (CancelState.CANCELLED, CancelState.REFUSED)
            if decided or (request.cancel_state is CancelState.REQUESTED
                           and (request.status is _S.RUNNING or held)):
                assert request.cancel_state is not None
                return CancelDecision(request, request.cancel_state,
                                      request.cancel_detail or "", new=False)
            status: RequestStatus = request.status
            if request.status in _NOT_STARTED and request.superseded_by is None and held:
                state = CancelState.REQUESTED
                detail = ("requested: another delivery still holds its key; it stops at its"
                          " next cancel point, completes first, or the cancel ends when it"
                          " gives up")
            elif request.status in _NOT_STARTED and request.superseded_by is None:
                state, status = CancelState.CANCELLED, _S.CANCELLED
                detail = ("cancelled before it ran" if request.status is not _S.FAILED else
                          "cancelled after a failed run: no replay runs it")
            elif request.status in _NOT_STARTED:
                state = CancelState.REFUSED
                detail = (f"refused: superseded by {request.superseded_by}, which carries its"
                          " intent: cancel that one")
            elif request.status is _S.RUNNING:
                state = CancelState.REQUESTED
                detail = ("requested: running, it stops at its next cancel point (before its"
                          " next side effect) or completes first")
            elif request.status is _S.COALESCED:
                state = CancelState.REFUSED
                detail = (f"refused: coalesced into request {request.coalesced_into}, which"
                          " ran instead: cancel that one")
            else:
                state = CancelState.REFUSED
                detail = f"refused: it had completed (at {_iso(request.updated_at)})"
            if status is not request.status:
                moved = conn.execute(
                    text("UPDATE job_requests SET status = :status, updated_at = :now"
                         " WHERE id = :id AND status = :seen"),
                    {"status": str(status), "now": now, "id": request_id,
                     "seen": str(request.status)},
                ).rowcount
                assert moved == 1  # the row is locked: its status cannot have moved
            conn.execute(  # replaces a cancel requested while a run that then failed was running
                text(
                    "INSERT INTO request_cancels (request_id, cancel_state, cancel_reason,"
                    " cancel_by, cancel_requested_at, cancel_decided_at, cancel_detail)"
                    " VALUES (:id, :state, :reason, :by, :now, :decided, :detail)"
                    " ON CONFLICT (request_id) DO UPDATE SET cancel_state = :state,"
                    " cancel_reason = :reason, cancel_by = :by, cancel_requested_at = :now,"
                    " cancel_decided_at = :decided, cancel_detail = :detail"
                ),
                {"id": request_id, "state": str(state), "reason": reason, "by": by, "now": now,
                 "decided": None if state is CancelState.REQUESTED else now, "detail": detail},
            )
            row = conn.execute(text(f"{_READ} WHERE job_requests.id = :id"),
                               {"id": request_id}).first()
            return CancelDecision(JobRequest.from_row(row), state, detail, new=True)

    def settle_requested_cancel(self, request_id: int, why: str, *, conn: Connection) -> bool:
        """End a cancel that waited for the holder of the request's key, once that holder gave
        up: a request not running under its row (pending, launched, failed) whose cancel is
        ``requested`` and whose key no live holder holds any more ends ``cancelled``, in the
        caller's transaction (the one that dead-letters it: :func:`engine.dead_letters.
        dead_letter`, which then records no dead letter and closes the open ones). ``why``:
        the failure, for the cancel's detail. True if it ended so; False leaves everything as
        it was (no cancel asked, or still held: the holder decides it later)."""
        lock = " FOR UPDATE OF job_requests" if self.db.is_postgres else ""
        row = conn.execute(text(f"{_READ} WHERE job_requests.id = :id{lock}"),
                           {"id": request_id}).first()
        if row is None:
            return False
        request = JobRequest.from_row(row)
        now = self.clock()
        if (request.cancel_state is not CancelState.REQUESTED
                or request.status not in _NOT_STARTED or request.superseded_by is not None
                or IdempotencyStore.held(conn, request.key, now)):
            return False
        params = {"id": request_id, "now": now, "seen": str(request.status),
                  "detail": f"cancelled: the delivery holding its key ended ({why})"[:2000]}
        moved = conn.execute(
            text("UPDATE job_requests SET status = 'cancelled', updated_at = :now"
                 " WHERE id = :id AND status = :seen"), params,
        ).rowcount
        if moved:
            conn.execute(
                text("UPDATE request_cancels SET cancel_state = 'cancelled',"
                     " cancel_detail = :detail, cancel_decided_at = :now"
                     " WHERE request_id = :id AND cancel_state = 'requested'"), params,
            )
        return bool(moved)

    def settle_waiting_cancels(self, *, actor: str, limit: int = 200) -> list[int]:
        """End the cancels still waiting for a holder of the key that ended without a failure
        path (killed, its run gone): each request not running under its row whose cancel is
        ``requested`` ends ``cancelled`` once no live holder holds its key
        (:meth:`settle_requested_cancel`, one transaction each), its open dead letters closed.
        The DLQ sweep's safety net; returns the ids ended."""
        with self.db.statement() as conn:
            waiting = conn.execute(
                text("SELECT c.request_id FROM request_cancels c"
                     " JOIN job_requests r ON r.id = c.request_id"
                     " WHERE c.cancel_state = 'requested'"
                     " AND r.status IN ('pending', 'launched', 'failed')"
                     " ORDER BY c.request_id LIMIT :n"),
                {"n": limit},
            ).scalars().all()
        ended = []
        for request_id in waiting:
            with self.db.transaction() as conn:
                if self.settle_requested_cancel(
                    int(request_id), "it ended without deciding; its lease ran out", conn=conn
                ):
                    ended.append(int(request_id))
        for request_id in ended:
            close_dead_letters(self.db, request_id, actor, "cancelled: the holder of its key ended")
        return ended

    def mark_cancelled(self, request_id: int, detail: str, *, run_id: str | None = None) -> bool:
        """The op stopped at a cancel point: the request ends ``cancelled`` with what was done
        (``detail``). Only a request whose cancel was asked moves."""
        params = {"detail": detail[:2000], "now": self.clock(), "run_id": run_id,
                  "id": request_id}
        with self.db.transaction() as conn:
            moved = conn.execute(
                text(
                    "UPDATE job_requests SET status = 'cancelled', updated_at = :now,"
                    " run_id = COALESCE(:run_id, run_id)"
                    " WHERE id = :id AND status IN ('running', 'launched', 'pending', 'failed')"
                    " AND EXISTS (SELECT 1 FROM request_cancels c WHERE c.request_id = :id"
                    "   AND c.cancel_state IN ('requested', 'cancelled'))"
                ),
                params,
            ).rowcount
            if moved:
                conn.execute(
                    text("UPDATE request_cancels SET cancel_state = 'cancelled',"
                         " cancel_detail = :detail, cancel_decided_at = :now"
                         " WHERE request_id = :id"),
                    params,
                )
        return bool(moved)

    def cancel_asked(self, key: str, *, conn: Connection | None = None) -> CancelState | None:
        """The cancel state of the request stored under ``key`` (None: none asked, or no
        request). In ``conn`` when given (a cancel point inside the effect's transaction)."""
        sql = text(
            "SELECT c.cancel_state FROM job_requests r"
            " JOIN request_cancels c ON c.request_id = r.id WHERE r.key = :key"
        )
        if conn is not None:
            value = conn.execute(sql, {"key": key}).scalar()
        else:
            with self.db.statement() as own:
                value = own.execute(sql, {"key": key}).scalar()
        return CancelState(value) if value else None

    def cancels_asked(self, keys: Sequence[str]) -> dict[str, CancelState]:
        """The cancel state of each request stored under one of ``keys`` that has one (one
        statement for a batch's keys)."""
        if not keys:
            return {}
        sql = text(
            "SELECT r.key, c.cancel_state FROM job_requests r"
            " JOIN request_cancels c ON c.request_id = r.id WHERE r.key IN :keys"
        ).bindparams(bindparam("keys", expanding=True))
        with self.db.statement() as conn:
            return {str(k): CancelState(v) for k, v in conn.execute(sql, {"keys": list(keys)})}

    # -- reading ---------------------------------------------------------------------------------

    def get(self, request_id: int) -> JobRequest | None:
        with self.db.statement() as conn:
            row = conn.execute(
                text(f"{_READ} WHERE job_requests.id = :id"), {"id": request_id}  # nosec B608: SQL from code constants, values bound
            ).first()
        return None if row is None else JobRequest.from_row(row)

    def dedupe_of(self, request_id: int | None, key: str | None = None) -> str | None:
        """The dedupe window the request (by id, else by key) was stored with, as
        :func:`dedupe_label` prints it; None when no such request is kept."""
        request = self.get(request_id) if request_id is not None else None
        if request is None and key:
            request = self.get_by_key(key)
        return None if request is None else request.dedupe

    def get_many(self, request_ids: Sequence[int]) -> list[JobRequest]:
        if not request_ids:
            return []
        sql = text(
            f"{_READ} WHERE job_requests.id IN :ids ORDER BY job_requests.id"  # nosec B608: SQL from code constants, values bound
        ).bindparams(
            bindparam("ids", expanding=True)
        )
        with self.db.statement() as conn:
            return [JobRequest.from_row(r) for r in conn.execute(sql, {"ids": list(request_ids)})]

    def get_by_key(self, key: str) -> JobRequest | None:
        with self.db.statement() as conn:
            row = conn.execute(
                text(f"{_READ} WHERE job_requests.key = :key"), {"key": key}  # nosec B608: SQL from code constants, values bound
            ).first()
        return None if row is None else JobRequest.from_row(row)

    def find(
        self,
        *,
        status: Sequence[str] | None = None,
        job_type: str | None = None,
        tenant: str | None = None,
        limit: int = 50,
    ) -> list[JobRequest]:
        """Requests matching every filter given, newest first, at most ``limit``."""
        where: list[str] = []
        params: dict[str, Any] = {"limit": int(limit)}
        if status:
            where.append("status IN :statuses")
            params["statuses"] = [str(s) for s in status]
        if job_type is not None:
            where.append("job_type = :jt")
            params["jt"] = job_type
        if tenant is not None:
            where.append("tenant = :tenant")
            params["tenant"] = tenant
        sql = _READ  # nosec B608: SQL from code constants, values bound
        if where:
            sql += " WHERE " + " AND ".join(where)
        stmt = text(sql + " ORDER BY job_requests.id DESC LIMIT :limit")
        if status:
            stmt = stmt.bindparams(bindparam("statuses", expanding=True))
        with self.db.statement() as conn:
            return [JobRequest.from_row(r) for r in conn.execute(stmt, params)]

    def counts(self, job_type: str | None = None) -> dict[str, int]:
        """Requests per status (every status present, zero if none)."""
        where = "WHERE job_type = :jt" if job_type else ""
        with self.db.statement() as conn:
            rows = conn.execute(
                text(f"SELECT status, COUNT(*) AS n FROM job_requests {where} GROUP BY status"),  # nosec B608: SQL from code constants, values bound
                {"jt": job_type},
            ).all()
        out = {str(s): 0 for s in RequestStatus}
        out.update({r.status: int(r.n) for r in rows})
        return out

    def failed_without_dlq_record(self, limit: int = 200) -> list[JobRequest]:
        """Requests marked ``failed`` that no DLQ record points at: what a sensor missed, or a
        micro-batch failure that did not fail its step (the DLQ sweep records them)."""
        with self.db.statement() as conn:
            rows = conn.execute(text(_Q["failed_without_dlq_record"]), {"limit": limit}).all()
        return [JobRequest.from_row(r) for r in rows]

    def failed_in_run(self, run_id: str) -> list[JobRequest]:
        """The requests a (batch) run marked failed."""
        with self.db.statement() as conn:
            rows = conn.execute(text(_Q["failed_in_run"]), {"run": run_id}).all()
        return [JobRequest.from_row(r) for r in rows]

    def states(self, requests: Sequence[JobRequest]) -> dict[int, str]:
        """What happened to each request, in one word (:func:`state_of`), with one query for
        the open dead letters among them."""
        failed = [r.id for r in requests if r.status is _S.FAILED]
        kept: set[int] = set()
        if failed:
            sql = text(
                "SELECT DISTINCT request_id FROM dlq_records WHERE request_id IN :ids"
                " AND status IN :open"
            ).bindparams(bindparam("ids", expanding=True), bindparam("open", expanding=True))
            with self.db.statement() as conn:
                kept = {int(i) for i in conn.execute(
                    sql, {"ids": failed, "open": [str(s) for s in UNRESOLVED]}).scalars()}
        return {r.id: state_of(r, dead_lettered=r.id in kept) for r in requests}

    def queue_stats(self) -> list[dict[str, Any]]:
        """Per job type and status (pending, launched): how many, and the oldest ``created_at``."""
        with self.db.statement() as conn:
            return [dict(r._mapping) for r in conn.execute(text(_Q["queue_stats"]))]

    def arrivals(self, since: float, until: float | None = None) -> dict[str, int]:
        """Requests created since ``since`` (and before ``until``) per job type (an index on
        ``created_at``)."""
        with self.db.statement() as conn:
            if until is None:
                rows = conn.execute(text(_Q["arrivals"]), {"since": since}).all()
            else:
                rows = conn.execute(text(_Q["arrivals_between"]),
                                    {"since": since, "until": until}).all()
        return {str(r.job_type): int(r.n) for r in rows}

    def cancel_stats(self, since: float) -> dict[str, int]:
        """Cancels asked since ``since``, per :class:`CancelState` (every state, zero if none)."""
        with self.db.statement() as conn:
            rows = conn.execute(text(_Q["cancel_stats"]), {"since": since}).all()
        out = {str(s): 0 for s in CancelState}
        out.update({str(r.cancel_state): int(r.n) for r in rows})
        return out

    def waiting_by_tenant(self) -> dict[str, int]:
        """Pending requests per tenant."""
        return {t: n for t, (n, _) in self.oldest_waiting_by_tenant().items()}

    def tenant_waits(self, since: float, limit: int = 20_000) -> list[tuple[str, float]]:
        """``(tenant, seconds waited)`` of the requests first claimed since ``since``, the
        newest ``limit`` of them (a bounded sample for percentiles)."""
        with self.db.statement() as conn:
            rows = conn.execute(
                text(_Q["tenant_waits"]), {"since": since, "limit": limit}
            ).all()
        return [(str(r.tenant), float(r.waited)) for r in rows]

    def oldest_waiting_by_tenant(self) -> dict[str, tuple[int, float]]:
        """``{tenant: (pending requests, oldest one's created_at)}``."""
        with self.db.statement() as conn:
            rows = conn.execute(text(_Q["oldest_waiting_by_tenant"])).all()
        return {str(r.tenant): (int(r.n), float(r.oldest)) for r in rows}

    def overtaking(self, tenant: str, since: float) -> int:
        """Requests of other tenants created after ``since`` and claimed already."""
        with self.db.statement() as conn:
            return int(conn.execute(
                text(_Q["overtaking"]), {"since": since, "tenant": tenant}
            ).scalar_one())

    def correlation_ids_since(self, since: float) -> dict[int, str | None]:
        """Request id -> correlation id of the requests created since ``since``."""
        with self.db.statement() as conn:
            rows = conn.execute(text(_Q["correlation_ids_since"]), {"since": since})
            return {int(r.id): r.correlation_id for r in rows}

    # -- retention -------------------------------------------------------------------------------

    def expired(
        self, older_than: float, *, dead_lettered: str, keep: Sequence[str] = ()
    ) -> Expiry:
        """Finished requests last changed more than ``older_than`` seconds ago: completed ones,
        and failed ones the DLQ holds (``dead_lettered``: SQL over ``job_requests.id``, true when
        a DLQ record holds the failure; a failed request not yet dead-lettered is kept for the
        sweep). ``keep`` conditions (an unresolved DLQ record) keep a request whatever its age.
        Purge with ``.purge(db)``, count with ``.count(db)``."""
        return Expiry.of(
            "job_requests",
            "id",
            "updated_at <= :cutoff AND (status IN ('completed', 'coalesced', 'cancelled')"
            f" OR (status = 'failed' AND {dead_lettered}))",
            {"cutoff": self.clock() - older_than},
            keep=keep,
            children=(("request_cancels", "request_id"), ("request_sources", "request_id")),
        )

    def expired_rejections(self, older_than: float) -> Expiry:
        """Rejections kept more than ``older_than`` seconds."""
        return Expiry.of(
            "job_rejections", "id", "created_at <= :cutoff", {"cutoff": self.clock() - older_than}
        )

    @staticmethod
    def unfinished_key_reference(column: str) -> str:
        """SQL, true while a request that has not completed carries the key in ``column``: it
        may still run (or be replayed) under that key."""
        return (
            "EXISTS (SELECT 1 FROM job_requests r"
            f" WHERE r.key = {column} AND r.status NOT IN ('completed', 'coalesced', 'cancelled'))"  # nosec B608: SQL from code constants, values bound
        )

    @staticmethod
    def unfinished_request_reference(column: str) -> str:
        """SQL, true while the request whose id is in ``column`` exists and has not completed."""
        return (
            "EXISTS (SELECT 1 FROM job_requests r"
            f" WHERE r.id = {column} AND r.status NOT IN ('completed', 'coalesced', 'cancelled'))"  # nosec B608: SQL from code constants, values bound
        )

    def rejections(
        self,
        job_type: str | None = None,
        *,
        source: str | None = None,
        limit: int | None = None,
        newest_first: bool = False,
    ) -> list[dict[str, Any]]:
        """Refused requests (oldest first, or newest first), of one job type or way in."""
        where = [f"{c} = :{c}" for c, v in (("job_type", job_type), ("source", source)) if v]
        clause = f"WHERE {' AND '.join(where)}" if where else ""
        order = "DESC" if newest_first else "ASC"
        bound = f" LIMIT {int(limit)}" if limit is not None else ""
        with self.db.statement() as conn:
            rows = conn.execute(
                text(
                    f"SELECT {_REJECTION_COLUMNS} FROM job_rejections {clause}"
                    f" ORDER BY id {order}{bound}"  # nosec B608: SQL from code constants, values bound
                ),
                {"job_type": job_type, "source": source},
            ).all()
        return [dict(r._mapping) for r in rows]

    def rejection(self, rejection_id: int) -> dict[str, Any] | None:
        """One refused request, or None."""
        with self.db.statement() as conn:
            row = conn.execute(
                text(f"SELECT {_REJECTION_COLUMNS} FROM job_rejections WHERE id = :id"),  # nosec B608: SQL from code constants, values bound
                {"id": rejection_id},
            ).first()
        return None if row is None else dict(row._mapping)


def cancel_requests(
    store: RequestStore, refs: Sequence[int | str], *, by: str, reason: str | None = None
) -> list[CancelDecision | KeyError]:
    """Cancel requests by id or key (a string of digits is an id first, then a key), one
    :meth:`RequestStore.cancel` each, in order: the Python call behind ``sekali requests
    cancel`` and the ``cancel_requests`` job. An unknown reference gives its ``KeyError`` in
    place; :class:`CancelUnavailable` is raised before anything changes."""
    out: list[CancelDecision | KeyError] = []
    for ref in refs:
        request = None
        if isinstance(ref, int) or (ref.isdigit() and len(ref) <= 18):
            request = store.get(int(ref))
        if request is None and isinstance(ref, str):
            request = store.get_by_key(ref)
        if request is None:
            out.append(KeyError(ref))
            continue
        decision = store.cancel(request.id, by=by, reason=reason)
        if decision.new and request.status is _S.FAILED and decision.state is CancelState.CANCELLED:
            close_dead_letters(store.db, request.id, by, reason)
        out.append(decision)
    return out


def cancel_view(ref: int | str, decided: CancelDecision | KeyError) -> dict[str, Any]:
    """One reference's row of :func:`cancel_requests` (the CLI's output, the job's table): the
    request, its status, the cancel's state and detail, whether this call decided it; a
    reference that names no request is ``unknown``."""
    if isinstance(decided, CancelDecision):
        state = str(decided.state)
        detail = decided.detail.removeprefix(f"{state}: ")  # shown after the state already
        return {"ref": ref, "id": decided.request.id, "key": decided.request.key,
                "status": str(decided.request.status), "cancel": state,
                "detail": detail, "new": decided.new}
    return {"ref": ref, "id": None, "key": None, "status": None, "cancel": "unknown",
            "detail": "no request with this id or key", "new": False}


def close_dead_letters(db: Database, request_id: int, by: str, reason: str | None) -> None:
    """A cancelled request's open dead letters are discarded, so no replay is offered."""
    dlq = DlqStore(db)
    ids = [r.id for r in dlq.list_records(request_id=request_id,
                                          status=sources_of(DlqStatus.DISCARDED))]
    if ids:
        why = f"request {request_id} cancelled: {reason or 'no reason'}"
        dlq.discard(ids, actor=by, reason=why)


def _bounded(value: Any, max_bytes: int) -> str | None:
    """A job type or key as a rejection keeps it: text bounded and storable; None stays None;
    anything else (an int, a list) by its bounded description."""
    if value is None:
        return None
    if isinstance(value, str):
        return storable(value, max_bytes)
    return digest(value, max_bytes).excerpt
