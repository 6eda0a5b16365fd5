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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

from sqlalchemy import BigInteger, Column, Float, Integer, Table, Text, bindparam, text
from sqlalchemy.engine import Connection

from resources.errors import IdempotencyConflict
from resources.idempotency import payload_hash
from resources.storage.db import Database, metadata
from resources.storage.json_text import canonical, digest, storable
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
    launched                    still launched after ``relaunch_after``: re-emit    launched
    pending/launched/running/   its op starts (or a step / run retry restarts it)   running
    failed
    pending/launched/running/   the op finished, or the key was already done        completed
    failed
    pending/launched/running    permanent error, retries exhausted, run failed      failed
    failed                      requeue (operator or DLQ replay)                    pending
    pending                     debounced: another request of its group ran         coalesced
    completed                   (terminal)
    coalesced                   (terminal; ``coalesced_into`` names the one that
                                ran, whose status is this request's outcome)
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


_S = RequestStatus
INTRODUCED_BY: dict[RequestStatus, str] = {_S.COALESCED: "0110_flow_intake"}
"""The migration that admitted each status the first releases did not have. A process of an
older release has no name for such a status (reading one, it fails), so it is written only
once every process is declared to know that migration (``sekali db contract``; a database this
release created knows it from the start): :meth:`RequestStore.writable`. Until then the
request takes the path the older release would (sql/README, "A new status")."""
TRANSITIONS: dict[RequestStatus | None, frozenset[RequestStatus]] = {
    None: frozenset({_S.PENDING}),
    _S.PENDING: frozenset({_S.LAUNCHED, _S.RUNNING, _S.COMPLETED, _S.FAILED, _S.COALESCED}),
    _S.LAUNCHED: frozenset({_S.LAUNCHED, _S.RUNNING, _S.COMPLETED, _S.FAILED}),
    _S.RUNNING: frozenset({_S.RUNNING, _S.COMPLETED, _S.FAILED}),
    _S.FAILED: frozenset({_S.PENDING, _S.RUNNING, _S.COMPLETED}),
    _S.COMPLETED: frozenset(),
    _S.COALESCED: frozenset(),
}


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
    " coalesced_count, superseded_by, amends"
)
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
     debounce_wait, debounce_max_wait, coalesced_count, amends)
VALUES (:job_type, :key, :payload, :hash, 'pending', :queue, :cid, :now, :now, 0, :traceparent,
        :priority, :rank, :dedupe_window, :debounce_key, :debounce_wait, :debounce_max_wait, 0,
        :amends)
ON CONFLICT (key) DO NOTHING
RETURNING {_COLUMNS}
"""

_CLAIMABLE = (
    "status IN ('pending', 'launched') AND ((status = 'pending'{plain})"
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
WHERE status = 'pending' AND debounce_key IS NOT NULL {types}
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
UPDATE job_requests SET status = 'launched', updated_at = :now
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
UPDATE job_requests SET status = 'launched', updated_at = :now
FROM picked
WHERE job_requests.id = picked.id
RETURNING {columns}
"""


class RequestStore:
    """The intake table over a :class:`Database`. Thread-safe; share one per process."""

    def __init__(self, db: Database, *, clock: Clock = time.time) -> None:
        self.db = db
        self.clock = clock
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
        }
        if conn is not None:
            return self._enqueue(conn, params, given)
        with self.db.transaction() as own:
            return self._enqueue(own, params, given)

    def _enqueue(self, conn: Connection, params: dict[str, Any], given: str) -> EnqueueResult:
        row = conn.execute(text(_INSERT), params).first()
        if row is not None:
            return EnqueueResult(JobRequest.from_row(row), created=True)
        existing = conn.execute(
            text(f"SELECT {_COLUMNS} FROM job_requests WHERE key = :key"), {"key": params["key"]}
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

        Whatever was sent, the row is small and storable on both databases: the first
        ``excerpt_bytes`` of the payload's text (NUL and lone surrogates escaped) with the size
        and sha256 of the whole, and the job type, key, field and error bounded the same way.
        """
        described = digest(payload, excerpt_bytes)
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
        if limit <= 0:
            return []
        now = self.clock()
        types = sorted(job_types) if job_types is not None else None
        if types is not None and not types:
            return []
        params: dict[str, Any] = {"now": now, "cutoff": now - relaunch_after, "limit": limit}
        coalesce = self.writable(_S.COALESCED)
        with self.db.transaction() as conn:
            claimed = self._claim_debounced(conn, params, types, merge) if coalesce else []
            if len(claimed) < limit:
                claimed += self._claim_plain(conn, {**params, "limit": limit - len(claimed)},
                                             types, debounced=not coalesce)
        return sorted(claimed, key=lambda r: (r.claim_rank, r.id))

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
        columns = _COLUMNS
        if self.db.is_postgres:
            columns = ", ".join(f"job_requests.{c.strip()}" for c in _COLUMNS.split(","))
        sql = template.format(
            indexed="" if self.db.is_postgres else "INDEXED BY job_requests_claim",
            claimable=_CLAIMABLE.format(plain="" if debounced else " AND debounce_key IS NULL"),
            order="claim_rank, id",
            types="AND job_type IN :types" if types is not None else "",
            columns=columns,
        )
        rows = conn.execute(self._typed(sql, types), {**params, "types": types}).all()
        return [JobRequest.from_row(r) for r in rows]

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
                    f" AND status = 'pending' ORDER BY created_at, id{lock}"
                ),
                {"k": group},
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
                    "UPDATE job_requests SET status = 'launched', updated_at = :now,"
                    " payload = :payload, payload_hash = :hash,"
                    " coalesced_count = coalesced_count + :n"
                    f" WHERE id = :id AND status = 'pending' RETURNING {_COLUMNS}"
                ),
                {"now": params["now"], "payload": canonical(payload),
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
                    " ORDER BY created_at, id"
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
    ) -> set[int]:
        """Move every request that may go to ``target`` in one statement; returns those moved.
        ``current``: only requests no newer version superseded."""
        if not request_ids:
            return set()
        same_run = " AND run_key = :run_key" if run_key is not None else ""
        if current:
            same_run += " AND superseded_by IS NULL"
        sql = text(
            "UPDATE job_requests SET status = :target, updated_at = :now,"
            " run_id = COALESCE(:run_id, run_id),"
            " last_error = CASE WHEN :target = 'failed' THEN :error"
            "   WHEN :target = 'completed' THEN NULL ELSE last_error END,"
            " error_class = CASE WHEN :target = 'failed' THEN :error_class"
            "   WHEN :target = 'completed' THEN NULL ELSE error_class END,"
            f" attempts = attempts + {1 if count_attempt else 0}"
            f" WHERE id IN :ids AND status IN :sources{same_run}"
            " RETURNING id"
        ).bindparams(bindparam("sources", expanding=True), bindparam("ids", expanding=True))
        with self.db.statement() as conn:
            result = conn.execute(
                sql,
                {
                    "target": str(target),
                    "now": self.clock(),
                    "run_id": run_id,
                    "error": error,
                    "error_class": error_class,
                    "ids": list(request_ids),
                    "sources": _sources(target),
                    "run_key": run_key,
                },
            )
            return {int(i) for i in result.scalars()}

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
        self, request_ids: Sequence[int], *, run_id: str | None = None
    ) -> set[int]:
        """:meth:`mark_completed` for a batch in one statement; returns the ids moved."""
        return self._move_many(request_ids, _S.COMPLETED, run_id=run_id)

    def mark_failed(
        self,
        request_id: int,
        error: str,
        *,
        error_class: str | None = None,
        run_id: str | None = None,
        run_key: str | None = None,
    ) -> bool:
        """Record a failure with the class the failure path decided; the DLQ picks failed
        requests up with ``last_error`` and ``error_class``."""
        moved = self._move_many(
            [request_id],
            _S.FAILED,
            run_id=run_id,
            error=error[:2000],
            error_class=error_class,
            run_key=run_key,
        )
        return bool(moved)

    def requeue(self, request_id: int) -> bool:
        """A failed request goes back to pending (operator or DLQ replay); never one a newer
        version superseded (:meth:`supersede`)."""
        return bool(self._move_many([request_id], _S.PENDING, current=True))

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

    # -- reading ---------------------------------------------------------------------------------

    def get(self, request_id: int) -> JobRequest | None:
        with self.db.statement() as conn:
            row = conn.execute(
                text(f"SELECT {_COLUMNS} FROM job_requests WHERE id = :id"), {"id": request_id}
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
        sql = text(f"SELECT {_COLUMNS} FROM job_requests WHERE id IN :ids ORDER BY id").bindparams(
            bindparam("ids", expanding=True)
        )
        with self.db.statement() as conn:
            return [JobRequest.from_row(r) for r in conn.execute(sql, {"ids": list(request_ids)})]

    def get_by_key(self, key: str) -> JobRequest | None:
        with self.db.statement() as conn:
            row = conn.execute(
                text(f"SELECT {_COLUMNS} FROM job_requests WHERE key = :key"), {"key": key}
            ).first()
        return None if row is None else JobRequest.from_row(row)

    def find(
        self,
        *,
        status: Sequence[str] | None = None,
        job_type: str | None = None,
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
        sql = f"SELECT {_COLUMNS} FROM job_requests"
        if where:
            sql += " WHERE " + " AND ".join(where)
        stmt = text(sql + " ORDER BY id DESC LIMIT :limit")
        if status:
            stmt = stmt.bindparams(bindparam("statuses", expanding=True))
        with self.db.statement() as conn:
            return [JobRequest.from_row(r) for r in conn.execute(stmt, params)]

    def counts(self, job_type: str | None = None) -> dict[str, int]:
        """Requests per status (every status present, zero if none)."""
        where = "WHERE job_type = :jt" if job_type else ""
        with self.db.statement() as conn:
            rows = conn.execute(
                text(f"SELECT status, COUNT(*) AS n FROM job_requests {where} GROUP BY status"),
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

    def queue_stats(self) -> list[dict[str, Any]]:
        """Per job type and status (pending, launched): how many, and the oldest ``created_at``."""
        with self.db.statement() as conn:
            return [dict(r._mapping) for r in conn.execute(text(_Q["queue_stats"]))]

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
            "updated_at <= :cutoff AND (status IN ('completed', 'coalesced')"
            f" OR (status = 'failed' AND {dead_lettered}))",
            {"cutoff": self.clock() - older_than},
            keep=keep,
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
            f" WHERE r.key = {column} AND r.status NOT IN ('completed', 'coalesced'))"
        )

    @staticmethod
    def unfinished_request_reference(column: str) -> str:
        """SQL, true while the request whose id is in ``column`` exists and has not completed."""
        return (
            "EXISTS (SELECT 1 FROM job_requests r"
            f" WHERE r.id = {column} AND r.status NOT IN ('completed', 'coalesced'))"
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
                    f" ORDER BY id {order}{bound}"
                ),
                {"job_type": job_type, "source": source},
            ).all()
        return [dict(r._mapping) for r in rows]

    def rejection(self, rejection_id: int) -> dict[str, Any] | None:
        """One refused request, or None."""
        with self.db.statement() as conn:
            row = conn.execute(
                text(f"SELECT {_REJECTION_COLUMNS} FROM job_rejections WHERE id = :id"),
                {"id": rejection_id},
            ).first()
        return None if row is None else dict(row._mapping)


def _bounded(value: Any, max_bytes: int) -> str | None:
    """A job type or key as a rejection keeps it: text bounded and storable; None stays None;
    anything else (an int, a list) by its bounded description."""
    if value is None:
        return None
    if isinstance(value, str):
        return storable(value, max_bytes)
    return digest(value, max_bytes).excerpt
