"""The idempotency store: a key names one business intent, and its effect happens once.

A record per key holds the payload hash, a status, the owner of the current lease, a fencing token
that grows on every claim, the attempt count, a recovery point, and the stored result or failure.

Guarantees (on SQLite and Postgres alike):

- ``begin`` decides in one conditional statement (an upsert whose ``WHERE`` says when a claim may
  be taken), so two workers can never both hold a live claim on one key.
- Every later write (``heartbeat``, ``checkpoint``, ``complete``, ``fail``) is conditional on the
  owner token: a holder whose lease was taken over changes nothing and gets :class:`LeaseLost`.
  Pass ``conn=`` to put the write in your own transaction beside the business change; then the
  effect and the record commit together or not at all.
- The payload hash is checked on every path, completed keys included: the same key with another
  payload is an :class:`IdempotencyConflict`, never a silent replay.

Time comes from an injected clock (``time.time`` by default). Workers' clocks must agree to well
within a lease; the lease should be several times the p99 duration of the work between heartbeats
(``sekali doctor`` checks that).

A timeline of the race the lease-plus-owner-token design stops::

    t=0   worker A begins key K (fence 1), charges, then stalls (GC pause, SIGSTOP)
    t=60  A's lease expires; worker B begins K: takeover, fence 2, resumes at A's checkpoint
    t=61  B completes K
    t=62  A wakes and calls complete(K): owner token no longer matches -> LeaseLost, nothing written
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from enum import StrEnum
from typing import Any, Protocol, TypeVar

from sqlalchemy import BigInteger, Column, Float, Integer, Table, Text, bindparam, text
from sqlalchemy.engine import Connection

from resources.errors import (
    AlreadyInProgress,
    HandlerTimedOut,
    IdempotencyConflict,
    LeaseLost,
    SekaliError,
    StoredFailure,
)
from resources.storage import retention
from resources.storage.db import Database, metadata
from resources.storage.driver import (
    DriverConnection,
    Sql,
    connect,
    is_deadlock,
    transaction,
    within,
)
from resources.storage.json_text import canonical, from_text, to_text
from resources.storage.migrations import ensure_schema

__all__ = [
    "AlreadyInProgress",
    "BatchLeaseKeeper",
    "BeginOutcome",
    "Claim",
    "Completed",
    "IdempotencyConflict",
    "IdempotencyStore",
    "Keeper",
    "LeaseKeeper",
    "LeaseLost",
    "Record",
    "Status",
    "StoredFailure",
    "payload_hash",
]

Clock = Callable[[], float]
T = TypeVar("T")
logger = logging.getLogger(__name__)


class Status(StrEnum):
    """Status of a key. Transitions (anything else is refused by the conditional statements):

    ==============  =====================================================  ==================
    from            event                                                  to
    ==============  =====================================================  ==================
    (absent)        begin                                                  in_progress
    (absent)        continue_fences: a new key carrying another key's intent  retryable
    in_progress     heartbeat / checkpoint by the owner                    in_progress
    in_progress     begin by another after the lease expired (takeover)    in_progress
    in_progress     complete by the owner                                  completed
    in_progress     fail(permanent) by the owner                           failed
    in_progress     fail(transient) by the owner                           retryable
    retryable       begin                                                  in_progress
    failed          reset by an operator (DLQ replay)                      retryable
    completed       purge after retention, unless something unresolved     (absent)
                    still names the key (``purge(keep=...)``)
    failed/retry.   purge with ``include_failed``, under the same terms    (absent)
    ==============  =====================================================  ==================
    """

    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"
    RETRYABLE = "retryable"


TRANSITIONS: dict[Status | None, frozenset[Status | None]] = {
    None: frozenset({Status.IN_PROGRESS, Status.RETRYABLE}),
    Status.IN_PROGRESS: frozenset(
        {Status.IN_PROGRESS, Status.COMPLETED, Status.FAILED, Status.RETRYABLE}
    ),
    Status.RETRYABLE: frozenset({Status.IN_PROGRESS, None}),
    Status.FAILED: frozenset({Status.RETRYABLE, None}),
    Status.COMPLETED: frozenset({None}),
}

idempotency_records = Table(
    "idempotency_records",
    metadata,
    Column("key", Text, primary_key=True),
    Column("payload_hash", Text),
    Column("status", Text, nullable=False),
    Column("owner_token", Text),
    Column("lease_expires_at", Float),
    Column("fence", BigInteger, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("recovery_point", Text),
    Column("recovery_data", Text),
    Column("result", Text),
    Column("error_class", Text),
    Column("error_message", Text),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("retention_expires_at", Float),
    Column("crashes", Integer, nullable=False, server_default="0"),
    Column("solo_fence", BigInteger),
)

_COLUMNS = (
    "key, payload_hash, status, owner_token, lease_expires_at, fence, attempt, recovery_point,"
    " recovery_data, result, error_class, error_message, created_at, updated_at,"
    " retention_expires_at, crashes"
)
_NAMES = [name.strip() for name in _COLUMNS.split(",")]


def _columns(alias: str) -> str:
    return ", ".join(f"{alias}.{name}" for name in _NAMES)


_CLAIMABLE = """r.payload_hash = excluded.payload_hash
  AND (r.status = 'retryable' OR (r.status = 'in_progress' AND r.lease_expires_at <= :now))"""

_ON_CONFLICT = f"""ON CONFLICT (key) DO UPDATE SET
    status = 'in_progress',
    owner_token = excluded.owner_token,
    lease_expires_at = excluded.lease_expires_at,
    fence = r.fence + 1,
    attempt = r.attempt + 1,
    crashes = r.crashes
        + CASE WHEN r.status = 'in_progress' AND r.solo_fence = r.fence THEN 1 ELSE 0 END,
    solo_fence = CASE WHEN excluded.solo_fence IS NULL THEN NULL ELSE r.fence + 1 END,
    updated_at = excluded.updated_at
WHERE {_CLAIMABLE}"""  # nosec B608: SQL from code constants, values bound

_FRESH = ":key, :hash, 'in_progress', :owner, :expires, 1, 1, :now, :now, CAST(:solo AS BIGINT)"

_UPSERT = f"""
INSERT INTO idempotency_records AS r
    (key, payload_hash, status, owner_token, lease_expires_at, fence, attempt,
     created_at, updated_at, solo_fence)
VALUES ({_FRESH})
{_ON_CONFLICT}
"""  # nosec B608: SQL from code constants, values bound

# Postgres: the upsert is only attempted when the statement's snapshot shows the key absent or
# claimable (ON CONFLICT's WHERE still decides, on the latest row version). Without that filter
# every replay of a completed key would lock its row: a transaction id and a WAL flush per read,
# and replays of one hot key queued behind each other.
_UPSERT_PG = _UPSERT.replace(
    f"VALUES ({_FRESH})",
    f"""SELECT {_FRESH}
WHERE NOT EXISTS (
    SELECT 1 FROM idempotency_records x WHERE x.key = :key AND NOT (
        x.payload_hash = :hash AND (x.status = 'retryable'
        OR (x.status = 'in_progress' AND x.lease_expires_at <= :now))))""",  # nosec B608: SQL from code constants, values bound
)
assert _UPSERT_PG != _UPSERT

# Postgres: claim or read the existing record in one round trip. The second branch reads the
# statement's snapshot, so it sees the record as it was before the upsert tried it.
_BEGIN_PG = Sql(f"""
WITH claimed AS ({_UPSERT_PG} RETURNING {_columns("r")})
SELECT {_COLUMNS}, TRUE AS claimed,
       (SELECT p.status FROM idempotency_records p WHERE p.key = :key) AS previous_status
FROM claimed
UNION ALL
SELECT {_COLUMNS}, FALSE AS claimed, status AS previous_status
FROM idempotency_records WHERE key = :key AND NOT EXISTS (SELECT 1 FROM claimed)
""")  # nosec B608: SQL from code constants, values bound

# Postgres, a batch: the same decision for every key in one statement. ``before`` is the
# statement's snapshot of the batch's records (the previous status, or the record to answer
# with when the key is not claimed); rows are inserted in key order, so two batches that share
# keys take their row locks in the same order.
_BEGIN_MANY_PG = Sql(f"""
WITH input AS (
    SELECT i.key, i.hash, i.owner
    FROM unnest(CAST(:keys AS text[]), CAST(:hashes AS text[]), CAST(:owners AS text[]))
        AS i(key, hash, owner)
),
before AS (
    SELECT {_COLUMNS} FROM idempotency_records WHERE key = ANY(CAST(:keys AS text[]))
),
claimed AS (
    INSERT INTO idempotency_records AS r
        (key, payload_hash, status, owner_token, lease_expires_at, fence, attempt,
         created_at, updated_at, solo_fence)
    SELECT i.key, i.hash, 'in_progress', i.owner, :expires, 1, 1, :now, :now, NULL
    FROM input i
    WHERE NOT EXISTS (
        SELECT 1 FROM before x WHERE x.key = i.key AND NOT (
            x.payload_hash = i.hash AND (x.status = 'retryable'
            OR (x.status = 'in_progress' AND x.lease_expires_at <= :now))))
    ORDER BY i.key
    {_ON_CONFLICT}
    RETURNING {_columns("r")}
)
SELECT {_columns("c")}, TRUE AS claimed, b.status AS previous_status
FROM claimed c LEFT JOIN before b ON b.key = c.key
UNION ALL
SELECT {_columns("b")}, FALSE AS claimed, b.status AS previous_status
FROM before b WHERE NOT EXISTS (SELECT 1 FROM claimed c WHERE c.key = b.key)
""")  # nosec B608: SQL from code constants, values bound

_BEGIN_SQLITE = Sql(f"{_UPSERT} RETURNING {_COLUMNS}")
_SELECT_ONE = Sql(f"SELECT {_COLUMNS} FROM idempotency_records WHERE key = :key")  # nosec B608: SQL from code constants, values bound

# The owner's writes: each applies only while the caller still owns a live claim.
_OWNER = "WHERE key = :key AND owner_token = :owner AND status = 'in_progress'"
_HEARTBEAT = Sql(
    f"UPDATE idempotency_records SET lease_expires_at = :expires, updated_at = :now {_OWNER}"  # nosec B608: SQL from code constants, values bound
)
_CHECKPOINT = Sql(
    "UPDATE idempotency_records SET recovery_point = :point, recovery_data = :data,"
    f" lease_expires_at = :expires, updated_at = :now {_OWNER}"  # nosec B608: SQL from code constants, values bound
)
_COMPLETE = Sql(
    "UPDATE idempotency_records SET status = 'completed', result = :result,"
    " lease_expires_at = NULL, error_class = NULL, error_message = NULL,"
    f" retention_expires_at = :retain, updated_at = :now {_OWNER}"  # nosec B608: SQL from code constants, values bound
)
_FAIL = Sql(
    "UPDATE idempotency_records SET status = :status, error_class = :eclass,"
    f" error_message = :emsg, lease_expires_at = NULL, updated_at = :now {_OWNER}"  # nosec B608: SQL from code constants, values bound
)
_RUN_ALONE = Sql(f"UPDATE idempotency_records SET solo_fence = fence, updated_at = :now {_OWNER}")  # nosec B608: SQL from code constants, values bound

# Postgres, a batch of owner writes in one statement; returns the keys still owned (written).
_BATCH_OWNER = (
    "FROM unnest(CAST(:keys AS text[]), CAST(:owners AS text[]){extra}) AS i(key, owner{cols})"
    " WHERE r.key = i.key AND r.owner_token = i.owner AND r.status = 'in_progress'"
    " RETURNING r.key"
)
_HEARTBEAT_MANY_PG = Sql(
    "UPDATE idempotency_records AS r SET lease_expires_at = :expires, updated_at = :now "
    + _BATCH_OWNER.format(extra="", cols="")  # nosec B608: SQL from code constants, values bound
)
_COMPLETE_MANY_PG = Sql(
    "UPDATE idempotency_records AS r SET status = 'completed', result = i.result,"
    " lease_expires_at = NULL, error_class = NULL, error_message = NULL,"
    " retention_expires_at = :retain, updated_at = :now "
    + _BATCH_OWNER.format(extra=", CAST(:results AS text[])", cols=", result")  # nosec B608: SQL from code constants, values bound
)

def payload_hash(payload: Any) -> str:
    """Stable hash of a JSON-serialisable payload (key order does not matter)."""
    return hashlib.sha256(canonical(payload).encode()).hexdigest()


@dataclass(frozen=True)
class Record:
    """A row of the ledger, as read."""

    key: str
    payload_hash: str | None
    status: Status
    owner_token: str | None
    lease_expires_at: float | None
    fence: int
    attempt: int
    recovery_point: str | None
    recovery_data: Any
    result: Any
    error_class: str | None
    error_message: str | None
    created_at: float
    updated_at: float
    retention_expires_at: float | None
    crashes: int = 0

    @classmethod
    def from_row(cls, row: Any) -> Record:
        """From a SQLAlchemy row or a driver tuple whose first columns are ``_COLUMNS``."""
        (key, digest, status, owner, lease, fence, attempt, point, data, result, eclass, emsg,
         created, updated, retention, crashes) = tuple(row)[:16]
        return cls(
            key=key,
            payload_hash=digest,
            status=Status(status),
            owner_token=owner,
            lease_expires_at=lease,
            fence=int(fence),
            attempt=int(attempt),
            recovery_point=point,
            recovery_data=from_text(data),
            result=from_text(result),
            error_class=eclass,
            error_message=emsg,
            created_at=created,
            updated_at=updated,
            retention_expires_at=retention,
            crashes=int(crashes or 0),
        )


@dataclass(frozen=True)
class Claim:
    """A live claim on a key: the right to do its effect, while the lease holds.

    ``fence`` grows with every claim of the key; ``takeover`` says a previous owner's lease
    expired mid-work, and ``recovery_point`` / ``recovery_data`` say where it had got to.
    ``crashes`` counts the takeovers of the key whose previous holder ran its handler alone
    (:meth:`IdempotencyStore.run_alone`; a per-request claim always does): the workers that
    died (or stalled past their lease) on this key, what a crash-loop bound reads.
    """

    key: str
    owner_token: str
    fence: int
    attempt: int
    lease_expires_at: float
    recovery_point: str | None
    recovery_data: Any
    takeover: bool
    payload_hash: str
    crashes: int = 0
    lease_seconds: float = 60.0
    """The lease this claim was granted, renewed by every heartbeat: chosen per claim (the
    job type's observed durations, :mod:`engine.durations`), so one store serves short and
    long work alike."""


@dataclass(frozen=True)
class Completed:
    """The key was done before: this is its stored result. Do not run the effect again."""

    key: str
    result: Any
    fence: int
    attempt: int


BeginOutcome = Claim | Completed | SekaliError
"""One key's answer in :meth:`IdempotencyStore.begin_many`: a :class:`Claim`, the stored result
(:class:`Completed`), or the error ``begin`` would have raised for it (:class:`AlreadyInProgress`,
:class:`IdempotencyConflict`, :class:`StoredFailure`), returned rather than raised."""


class IdempotencyStore:
    """The ledger over a SQLAlchemy engine. Thread-safe; share one per process."""

    def __init__(
        self,
        db: Database,
        *,
        lease_seconds: float = 60.0,
        retention_seconds: float = 7 * 24 * 3600.0,
        clock: Clock = time.time,
    ) -> None:
        if lease_seconds <= 0:
            raise ValueError("lease_seconds must be positive")
        self.db = db
        self.lease_seconds = lease_seconds
        self.retention_seconds = retention_seconds
        self.clock = clock

    @classmethod
    def from_url(
        cls, url: str, *, lease_seconds: float = 60.0, create_schema: bool = True, **kwargs: Any
    ) -> IdempotencyStore:
        """Open the store at a SQLAlchemy URL. ``create_schema`` (the default): check the schema
        first, applying ``sql/`` where ``SEKALI_AUTO_MIGRATE`` allows (:func:`ensure_schema`)."""
        db = Database.from_url(url)
        if create_schema:
            ensure_schema(db)
        return cls(db, lease_seconds=lease_seconds, **kwargs)

    # -- claiming ---------------------------------------------------------------------------

    def begin(
        self, key: str, *, payload: Any = None, lease_seconds: float | None = None
    ) -> Claim | Completed:
        """Claim ``key``, or return its stored result.

        One round trip on Postgres (one conditional statement that also reads the record it did
        not claim); one ``BEGIN IMMEDIATE`` transaction of two statements on SQLite.

        Raises :class:`IdempotencyConflict` (payload differs), :class:`AlreadyInProgress`
        (another owner's lease is live: retry later) or :class:`StoredFailure` (failed
        permanently before: an operator must reset it). ``lease_seconds``: this claim's lease
        (default the store's), kept by its heartbeats.
        """
        if not key:
            raise ValueError("key must be a non-empty string")
        lease = self._lease(lease_seconds)
        digest = payload_hash(payload)
        owner = uuid.uuid4().hex
        for _ in range(5):
            now = self.clock()
            params = {
                "key": key,
                "hash": digest,
                "owner": owner,
                "now": now,
                "expires": now + lease,
                "solo": 1,
            }
            found: tuple[Record, bool, str | None] | None
            if self.db.is_postgres:
                with connect(self.db) as conn:
                    row = conn.row(_BEGIN_PG, params)
                found = None if row is None else (Record.from_row(row), bool(row[16]), row[17])
            else:
                with transaction(self.db) as conn:
                    found = _claim_sqlite(conn, params)
            if found is None:
                continue  # inserted concurrently after our snapshot: look again
            return self._outcome(*found, digest, now, lease)
        raise SekaliError(f"could not read or claim {key!r} after 5 tries; the store is unstable")

    def begin_many(
        self, items: Sequence[tuple[str, Any]], *, lease_seconds: float | None = None
    ) -> list[BeginOutcome]:
        """:meth:`begin` for a batch of ``(key, payload)``: one statement on Postgres, one
        transaction on SQLite, with exactly the single call's guarantees for every key.

        Returns one outcome per item, in order: a :class:`Claim`, a :class:`Completed`, or the
        error :meth:`begin` would raise for that key (returned, not raised), so one key's
        conflict or live lease never stops its neighbours. A key may appear once per batch.
        Every claim of the batch takes ``lease_seconds`` (default the store's).
        """
        lease = self._lease(lease_seconds)
        keys = [key for key, _ in items]
        if not all(keys):
            raise ValueError("every key must be a non-empty string")
        if len(set(keys)) != len(keys):
            raise ValueError("a key may appear only once in a batch")
        digests = {key: payload_hash(payload) for key, payload in items}
        owners = {key: uuid.uuid4().hex for key in keys}
        answers: dict[str, BeginOutcome] = {}
        todo = sorted(keys)
        for _ in range(5):
            if not todo:
                break
            now = self.clock()
            expires = now + lease
            if self.db.is_postgres:
                rows = self._begin_many_pg(todo, digests, owners, now, expires)
                found = {row[0]: (Record.from_row(row), bool(row[16]), row[17]) for row in rows}
            else:
                found = {}
                with transaction(self.db) as conn:
                    for key in todo:
                        params = {"key": key, "hash": digests[key], "owner": owners[key],
                                  "now": now, "expires": expires, "solo": None}
                        one = _claim_sqlite(conn, params)
                        if one is not None:
                            found[key] = one
            for key, (record, claimed, previous) in found.items():
                try:
                    answers[key] = self._outcome(record, claimed, previous, digests[key], now,
                                                 lease)
                except SekaliError as exc:
                    answers[key] = exc
            todo = [key for key in todo if key not in found]  # inserted after our snapshot
        for key in todo:
            answers[key] = SekaliError(
                f"could not read or claim {key!r} after 5 tries; the store is unstable"
            )
        return [answers[key] for key in keys]

    def _begin_many_pg(
        self,
        keys: list[str],
        digests: dict[str, str],
        owners: dict[str, str],
        now: float,
        expires: float,
    ) -> list[tuple[Any, ...]]:
        params = {
            "keys": keys,
            "hashes": [digests[k] for k in keys],
            "owners": [owners[k] for k in keys],
            "now": now,
            "expires": expires,
        }
        return _retry_deadlock(lambda: _rows_autocommit(self.db, _BEGIN_MANY_PG, params))

    def _lease(self, lease_seconds: float | None) -> float:
        if lease_seconds is None:
            return self.lease_seconds
        if not lease_seconds > 0:
            raise ValueError("lease_seconds must be positive")
        return float(lease_seconds)

    def _outcome(
        self, record: Record, claimed: bool, previous: str | None, digest: str, now: float,
        lease: float,
    ) -> Claim | Completed:
        if record.payload_hash != digest:
            raise IdempotencyConflict(record.key, record.payload_hash, digest)
        if claimed:
            assert record.owner_token is not None and record.lease_expires_at is not None
            return Claim(
                key=record.key,
                owner_token=record.owner_token,
                fence=record.fence,
                attempt=record.attempt,
                lease_expires_at=record.lease_expires_at,
                recovery_point=record.recovery_point,
                recovery_data=record.recovery_data,
                takeover=previous == Status.IN_PROGRESS,
                payload_hash=digest,
                crashes=record.crashes,
                lease_seconds=lease,
            )
        if record.status is Status.COMPLETED:
            return Completed(record.key, record.result, record.fence, record.attempt)
        if record.status is Status.FAILED:
            raise StoredFailure(record.key, record.error_class, record.error_message)
        expires = record.lease_expires_at or now
        raise AlreadyInProgress(record.key, record.lease_expires_at, max(0.0, expires - now))

    # -- the owner's writes -----------------------------------------------------------------

    def _owner_update(
        self, claim: Claim, sql: Sql, params: dict[str, Any], conn: Connection | None
    ) -> None:
        params = {**params, "key": claim.key, "owner": claim.owner_token, "now": self.clock()}
        if conn is not None:
            rowcount = within(conn).run(sql, params)
        else:
            with connect(self.db) as own:
                rowcount = own.run(sql, params)
        if rowcount != 1:
            raise LeaseLost(claim.key, claim.owner_token)

    def heartbeat(
        self, claim: Claim, *, conn: Connection | None = None, until: float | None = None
    ) -> float:
        """Extend the lease; returns the new expiry. :class:`LeaseLost` if it was taken over.
        ``until``: the latest expiry the holder may have (store time: its claim + its bound +
        a lease), so a renewal never carries a bounded holder past it."""
        expires = self.clock() + claim.lease_seconds
        if until is not None:
            expires = min(expires, until)
        self._owner_update(claim, _HEARTBEAT, {"expires": expires}, conn)
        return expires

    def checkpoint(
        self, claim: Claim, point: str, data: Any = None, *, conn: Connection | None = None
    ) -> None:
        """Record a recovery point (and extend the lease).

        Pass the ``conn`` of the transaction that made the phase's effect, so the effect and its
        checkpoint commit together: a crash then leaves both or neither.
        """
        self._owner_update(
            claim,
            _CHECKPOINT,
            {"point": point, "data": to_text(data), "expires": self.clock() + claim.lease_seconds},
            conn,
        )

    def complete(self, claim: Claim, result: Any = None, *, conn: Connection | None = None) -> None:
        """Store the result; later ``begin`` calls return it. The ack must come after this."""
        self._owner_update(
            claim,
            _COMPLETE,
            {"result": to_text(result), "retain": self.clock() + self.retention_seconds},
            conn,
        )

    def fail(
        self,
        claim: Claim,
        error: BaseException | str,
        kind: str | None = None,
        *,
        conn: Connection | None = None,
    ) -> None:
        """Record a failure. ``transient`` releases the key for a retry; ``permanent`` stores it,
        so duplicates get the stored failure until an operator resets the key.

        ``kind`` defaults to the error's own classification (``SekaliError.permanent``), and to
        transient for anything else.
        """
        if kind is None:
            kind = "permanent" if getattr(error, "permanent", False) else "transient"
        if kind not in ("permanent", "transient"):
            raise ValueError(f"kind must be 'permanent' or 'transient', not {kind!r}")
        status = Status.FAILED if kind == "permanent" else Status.RETRYABLE
        error_class = type(error).__name__ if isinstance(error, BaseException) else "Error"
        self._owner_update(
            claim,
            _FAIL,
            {"status": status.value, "eclass": error_class, "emsg": str(error)[:4000]},
            conn,
        )

    # -- the owner's writes, for a batch --------------------------------------------------------

    def heartbeat_many(
        self, claims: Sequence[Claim], *, conn: Connection | None = None
    ) -> tuple[float, set[str]]:
        """Extend the leases of a batch in one statement (Postgres) or one transaction (SQLite).

        Returns the new expiry and the keys whose lease was lost (taken over, or no longer in
        progress): nothing is written for those, exactly as :meth:`heartbeat` would refuse.
        Every lease is extended by the longest of the claims' (a batch claims them alike).
        """
        expires = self.clock() + max((c.lease_seconds for c in claims), default=0.0)
        written = self._owner_update_many(
            claims, _HEARTBEAT, _HEARTBEAT_MANY_PG, {"expires": expires}, None, conn
        )
        return expires, {c.key for c in claims} - written

    def complete_many(
        self, items: Sequence[tuple[Claim, Any]], *, conn: Connection | None = None
    ) -> list[LeaseLost | None]:
        """:meth:`complete` for a batch of ``(claim, result)``: one statement on Postgres, one
        transaction on SQLite (or the caller's, with ``conn``).

        Returns one entry per item, in order: None when stored, the :class:`LeaseLost` the single
        call would raise when the claim was taken over (nothing is written for that key). The
        ack of each key must come after this.
        """
        claims = [claim for claim, _ in items]
        results = {claim.key: to_text(result) for claim, result in items}
        written = self._owner_update_many(
            claims,
            _COMPLETE,
            _COMPLETE_MANY_PG,
            {"retain": self.clock() + self.retention_seconds},
            results,
            conn,
        )
        return [
            None if claim.key in written else LeaseLost(claim.key, claim.owner_token)
            for claim in claims
        ]

    def _owner_update_many(
        self,
        claims: Sequence[Claim],
        one: Sql,
        many_pg: Sql,
        params: dict[str, Any],
        results: dict[str, str] | None,
        conn: Connection | None,
    ) -> set[str]:
        """Apply an owner's write to every claim still owned; returns the keys written."""
        if not claims:
            return set()
        if len({c.key for c in claims}) != len(claims):
            raise ValueError("a key may appear only once in a batch")
        now = self.clock()
        if self.db.is_postgres:
            batch = {
                **params,
                "now": now,
                "keys": [c.key for c in claims],
                "owners": [c.owner_token for c in claims],
                "results": [results[c.key] for c in claims] if results is not None else None,
            }
            if conn is not None:
                rows = within(conn).rows(many_pg, batch)
            else:
                rows = _retry_deadlock(lambda: _rows_autocommit(self.db, many_pg, batch))
            return {str(row[0]) for row in rows}

        def apply(driver: DriverConnection) -> set[str]:
            written = set()
            for c in claims:
                each = {**params, "now": now, "key": c.key, "owner": c.owner_token}
                if results is not None:
                    each["result"] = results[c.key]
                if driver.run(one, each) == 1:
                    written.add(c.key)
            return written

        if conn is not None:
            return apply(within(conn))
        with transaction(self.db) as driver:
            return apply(driver)

    def run_alone(self, claim: Claim) -> None:
        """Say that this claim's handler runs alone now (a suspect isolated from its batch):
        if its worker dies before the key ends, the next claim counts a crash against the key.
        A batch's claims count none until then (a group's death names no culprit).
        :class:`LeaseLost` if the claim was taken over."""
        self._owner_update(claim, _RUN_ALONE, {}, None)

    def survived(self, claim: Claim) -> bool:
        """Say that this claim's holder is alive after all: it learnt :class:`LeaseLost`, so it
        stalled past its lease (a freeze, a paused VM) rather than died. The takeover that
        counted it as a crash (:attr:`Claim.crashes`) is taken back, so only holders that never
        came back count towards the crash-loop bound. Only for a claim that ran alone (a
        per-request claim, or after :meth:`run_alone`); only when the key was taken over
        (its fence moved past this claim's) and a crash is counted. Returns whether it was."""
        with self.db.statement() as conn:
            return (
                conn.execute(
                    text(
                        "UPDATE idempotency_records SET crashes = crashes - 1, updated_at = :now"
                        " WHERE key = :key AND fence > :fence AND crashes > 0"
                    ),
                    {"key": claim.key, "fence": claim.fence, "now": self.clock()},
                ).rowcount
                == 1
            )

    # -- operators and retention ------------------------------------------------------------

    def reset(self, key: str) -> bool:
        """Operator action: a permanently failed key becomes retryable (used by DLQ replay), its
        crash count back to zero (the operator replays a crash loop once its cause is fixed)."""
        with self.db.statement() as conn:
            return (
                conn.execute(
                    text(
                        "UPDATE idempotency_records SET status = 'retryable', crashes = 0,"
                        " updated_at = :now WHERE key = :key AND status = 'failed'"
                    ),
                    {"key": key, "now": self.clock()},
                ).rowcount
                == 1
            )

    def continue_fences(
        self, key: str, payload: Any, after: Sequence[str], *, conn: Connection
    ) -> bool:
        """Create ``key`` (absent) as ``retryable`` with the highest fence of the keys in
        ``after``, so its first claim's fence is above every fence they wrote: a new key that
        carries the same intent (a new version of it) writes the same fenced rows, and a fence
        restarting at 1 would be refused there. ``payload`` must be what :meth:`begin` will be
        given. In the caller's transaction; False when ``key`` exists already."""
        if not after:
            return False
        fence = conn.execute(
            text("SELECT MAX(fence) FROM idempotency_records WHERE key IN :keys").bindparams(
                bindparam("keys", expanding=True)
            ),
            {"keys": list(after)},
        ).scalar()
        now = self.clock()
        return bool(
            conn.execute(
                text(
                    "INSERT INTO idempotency_records (key, payload_hash, status, fence, attempt,"
                    " created_at, updated_at) VALUES (:key, :hash, 'retryable', :fence, 0,"
                    " :now, :now) ON CONFLICT (key) DO NOTHING"
                ),
                {"key": key, "hash": payload_hash(payload), "fence": int(fence or 0),
                 "now": now},
            ).rowcount
        )

    def get(self, key: str) -> Record | None:
        with connect(self.db) as conn:
            row = conn.row(_SELECT_ONE, {"key": key})
        return None if row is None else Record.from_row(row)

    def purge(
        self,
        older_than: float | timedelta | None = None,
        *,
        keep: Sequence[str] = (),
        include_failed: bool = False,
        batch_size: int = retention.BATCH_SIZE,
        max_batches: int = retention.MAX_BATCHES,
    ) -> int:
        """Delete completed records past retention; never in-progress ones, and failed or
        retryable ones only with ``include_failed``. Returns how many were deleted (in batches:
        :mod:`resources.storage.retention`).

        With ``older_than``, also completed records last updated before ``now - older_than``,
        and with ``include_failed`` failed and retryable ones too (a failure nothing will
        retry or replay any more; absent, the key reads as given up, as a failed one does).
        ``keep`` holds SQL conditions over ``idempotency_records.key`` that keep a record
        (written by the owners of what references a key: an open DLQ record, an unfinished
        request), so a key that an unresolved failure may still replay is never forgotten.
        """
        return self.expired(older_than, keep=keep, include_failed=include_failed).purge(
            self.db, batch_size=batch_size, max_batches=max_batches
        )

    def expired(
        self,
        older_than: float | timedelta | None = None,
        *,
        keep: Sequence[str] = (),
        include_failed: bool = False,
    ) -> retention.Expiry:
        """What :meth:`purge` with the same arguments deletes now."""
        now = self.clock()
        params = {"now": now}
        expired = "retention_expires_at <= :now"
        if older_than is not None:
            seconds = (
                older_than.total_seconds() if isinstance(older_than, timedelta) else older_than
            )
            expired = f"({expired} OR updated_at <= :cutoff)"
            params["cutoff"] = now - seconds
        condition = f"status = 'completed' AND {expired}"
        if include_failed and older_than is not None:
            condition += " OR status IN ('failed', 'retryable') AND updated_at <= :cutoff"
        return retention.Expiry.of("idempotency_records", "key", condition, params, keep=keep)

    def records(self, keys: Sequence[str], *, status: Status | None = None) -> dict[str, Record]:
        """The records of ``keys`` (those in ``status`` if given), by key; absent keys are left
        out. Reads 500 keys per statement."""
        where = " AND status = :status" if status is not None else ""
        out: dict[str, Record] = {}
        for i in range(0, len(keys), 500):
            with self.db.statement() as conn:
                rows = conn.execute(
                    text(
                        f"SELECT {_COLUMNS} FROM idempotency_records WHERE key IN :keys{where}"  # nosec B608: SQL from code constants, values bound
                    ).bindparams(bindparam("keys", expanding=True)),
                    {"keys": list(keys[i : i + 500]), "status": str(status)},
                ).all()
            out.update({r.key: Record.from_row(r) for r in rows})
        return out

    @staticmethod
    def held(conn: Connection, key: str, now: float) -> bool:
        """Does a live holder hold ``key`` at ``now``: claimed (``in_progress``) under a lease
        not yet run out, read in the caller's transaction. Such a holder may still reach an
        effect, so what would end its intent (a cancel) must wait for it. Expiry is judged as
        a takeover judges it: a holder past its lease can no longer heartbeat its way back
        (its keeper stops at the expiry it last confirmed), and a takeover then finds the key
        claimable."""
        return conn.execute(
            text("SELECT 1 FROM idempotency_records WHERE key = :key"
                 " AND status = 'in_progress' AND lease_expires_at > :now"),
            {"key": key, "now": now},
        ).first() is not None

    @staticmethod
    def unfinished_key_reference(column: str) -> str:
        """SQL, true while the key in ``column`` is claimed and not completed (in progress,
        retryable or failed): what its attempts and actions still explain."""
        return (
            "EXISTS (SELECT 1 FROM idempotency_records i"
            f" WHERE i.key = {column} AND i.status <> 'completed')"  # nosec B608: SQL from code constants, values bound
        )

    # -- convenience ------------------------------------------------------------------------

    @contextlib.contextmanager
    def keep_alive(
        self,
        claim: Claim,
        *,
        interval: float | None = None,
        confirmed_at: float | None = None,
        runtime: float | None = None,
    ) -> Iterator[LeaseKeeper]:
        """Heartbeat in the background while the block runs; ``keeper.check()`` raises
        :class:`LeaseLost` once a heartbeat found the lease taken over.

        ``confirmed_at``: the ``time.monotonic()`` taken just before the claim (or the last
        heartbeat) was asked for, so :meth:`LeaseKeeper.confirm` can skip a heartbeat while the
        claim is that fresh. ``runtime``: the work's bound in seconds from then (the job
        type's ``max_runtime_seconds``): the keeper renews no further (:class:`LeaseKeeper`).
        """
        keeper = LeaseKeeper(self, claim, interval or claim.lease_seconds / 3, confirmed_at,
                             runtime=runtime)
        keeper.start()
        try:
            yield keeper
        finally:
            keeper.stop()

    @contextlib.contextmanager
    def keep_alive_many(
        self,
        claims: Sequence[Claim],
        *,
        interval: float | None = None,
        confirmed_at: float | None = None,
    ) -> Iterator[BatchLeaseKeeper]:
        """:meth:`keep_alive` for a batch: one thread, one statement per beat for every claim."""
        shortest = min((c.lease_seconds for c in claims), default=self.lease_seconds)
        keeper = BatchLeaseKeeper(self, claims, interval or shortest / 3, confirmed_at)
        keeper.start()
        try:
            yield keeper
        finally:
            keeper.stop()

    def fresh_for(self, claims: Sequence[Claim]) -> float:
        """How long after a claim or heartbeat the lease is surely still ours without asking:
        a tenth of the (shortest) lease (a takeover needs the whole lease to pass first)."""
        return min((c.lease_seconds for c in claims), default=self.lease_seconds) / 10

    def run_once(
        self, key: str, fn: Callable[[], Any], *, payload: Any = None, wait: float = 0.0
    ) -> Any:
        """Run ``fn`` at most once per key and return its JSON-serialisable result; every later
        caller gets the stored result. A caller that finds the key in progress waits up to
        ``wait`` seconds for it to finish, then raises :class:`AlreadyInProgress`."""
        deadline = time.monotonic() + wait
        delay = 0.01
        while True:
            try:
                outcome = self.begin(key, payload=payload)
                break
            except AlreadyInProgress:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 0.5)
        if isinstance(outcome, Completed):
            return outcome.result
        with self.keep_alive(outcome) as keeper:
            try:
                result = fn()
            except BaseException as exc:
                try:
                    self.fail(outcome, exc)
                except Exception:  # noqa: BLE001 - the caller needs fn's error, not this one
                    logger.warning("could not record the failure of %s", key, exc_info=True)
                raise
            keeper.check()
        self.complete(outcome, result)
        return result


class Keeper(Protocol):
    """What a job sees of the keeper of its claim. ``until``: the monotonic time at which the
    work's bound runs out (None: unbounded); from then on :meth:`check` and :meth:`confirm`
    raise :class:`HandlerTimedOut` and no renewal is made."""

    @property
    def until(self) -> float | None: ...

    def check(self) -> None:
        """Raise :class:`LeaseLost` if a heartbeat found the lease taken over."""

    def confirm(self) -> None:
        """Make sure the lease is still ours now, asking the store unless it is surely fresh."""


class LeaseKeeper:
    """A daemon thread that heartbeats one claim until stopped, and tells its holder to stop.

    Each heartbeat extends the lease from the moment it was sent; the keeper remembers the
    expiry of the last one the store confirmed. :meth:`check` raises :class:`LeaseLost` once a
    heartbeat found the lease taken over, or once that confirmed expiry has passed: from then on
    another worker may take the key over, so the holder must stop before its next effect, even
    while a heartbeat is still stuck on a database that does not answer. A failed heartbeat
    (``StoreUnavailable``: every store call gives up within ``DatabaseTimeouts.bound``) is tried
    again after a quarter of the interval; once the confirmed expiry has passed the keeper stops
    beating, so a database that comes back does not revive a lease its holder gave up::

        t=0    A claims K (lease 60 s, heartbeat every 20 s); the database freezes at t=5
        t=20   A's heartbeat: no answer; StoreUnavailable at t=55 at the latest (35 s bound)
        t=60   the lease A last confirmed (t=0 + 60) runs out: A's check() raises LeaseLost
        later  the database answers again; B's begin(K) takes over; A writes nothing more

    With ``runtime`` (the work's bound, seconds from ``confirmed_at``) the keeper renews only
    until the bound: no beat after it, and none carries the lease past the claim's first expiry
    + ``runtime`` (store time), so a holder that hangs (a call that never returns) gives its key
    up within its bound + one lease whatever its process does. From the bound on, :meth:`check`
    and :meth:`confirm` raise :class:`HandlerTimedOut`::

        t=0    A claims K (lease 30 s, bound 120 s); A's call to a downstream never returns
        t=120  the bound: no more beats; A's confirm() (a late send) raises HandlerTimedOut
        t<=150 the last lease runs out; B's begin(K) takes over (a crash counted against K)
    """

    def __init__(
        self,
        store: IdempotencyStore,
        claim: Claim,
        interval: float,
        confirmed_at: float | None = None,
        *,
        runtime: float | None = None,
    ) -> None:
        self.store = store
        self.claim = claim
        self.interval = interval
        self.lost: LeaseLost | None = None
        self.expires = claim.lease_expires_at
        self.beats = 0
        self.confirmed_at = confirmed_at if confirmed_at is not None else -math.inf
        self.runtime = runtime
        start = confirmed_at if confirmed_at is not None else time.monotonic()
        self._until = None if runtime is None else start + runtime
        self.cap = None if runtime is None else claim.lease_expires_at + runtime
        self.overran: HandlerTimedOut | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease:{claim.key}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def until(self) -> float | None:
        return self._until

    def met(self) -> None:
        """The work returned within its bound: lift it (what follows, the completion, is the
        store's own call, bounded by the store's timeouts)."""
        if not self._overran():
            self._until = self.cap = None

    def _overran(self) -> bool:
        if self._until is None or time.monotonic() < self._until:
            return False
        if self.overran is None:
            assert self.runtime is not None
            self.overran = HandlerTimedOut(self.claim.key, self.runtime)
        return True

    def _run(self) -> None:
        delay = self.interval
        while not self._stop.wait(delay):
            if self._overran():
                return  # the bound: renew no more, the lease runs out on its own
            try:
                self._beat()
                self.beats += 1
                delay = self.interval
            except LeaseLost as exc:
                self.lost = exc
                return
            except Exception:  # noqa: BLE001 - store briefly unavailable: beat again soon
                if self._expired():
                    logger.warning("lease of %s ran out unrenewed; the holder must stop",
                                   self.claim.key, exc_info=True)
                    return
                logger.warning("heartbeat of %s failed; retrying", self.claim.key, exc_info=True)
                delay = self.interval / 4

    def _expired(self) -> bool:
        if self.store.clock() < self.expires:
            return False
        if self.lost is None:
            self.lost = LeaseLost(
                self.claim.key,
                self.claim.owner_token,
                reason="ran out before a heartbeat could renew it (the store did not answer)",
            )
        return True

    def _beat(self) -> None:
        asked = time.monotonic()
        self.expires = self.store.heartbeat(self.claim, until=self.cap)
        self.confirmed_at = asked

    def check(self) -> None:
        """Raise :class:`LeaseLost` if the lease was taken over or may have run out, and
        :class:`HandlerTimedOut` once the work's bound has passed."""
        if self.lost is not None:
            raise self.lost
        if self._overran():
            assert self.overran is not None
            raise self.overran
        if self._expired():
            assert self.lost is not None
            raise self.lost

    def confirm(self) -> None:
        """Heartbeat now, in this thread, unless the claim or a heartbeat was confirmed within
        :meth:`IdempotencyStore.fresh_for` (monotonic time, so a paused process always asks).
        Raises :class:`LeaseLost` if the key was taken over."""
        self.check()
        if time.monotonic() - self.confirmed_at < self.store.fresh_for([self.claim]):
            return
        try:
            self._beat()
        except LeaseLost as exc:
            self.lost = exc
            raise

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)




class BatchLeaseKeeper:
    """One daemon thread that keeps every claim of a batch alive with one statement per beat.

    A key leaves the batch with :meth:`release` once it completed or failed (its later beats
    would only report it "lost"). :meth:`keeper_for` gives each job its own :class:`Keeper`.

    It stops its jobs exactly as :class:`LeaseKeeper` stops one: a key's :meth:`check` raises
    :class:`LeaseLost` once a beat found the key taken over, or once the expiry the store last
    confirmed for it has passed (no beat got through: from then on another worker may take the
    key over), so each job stops before its next effect. An expired key is never beaten again,
    so a store that comes back does not revive a lease its holder gave up.

    :meth:`bound` gives a key its work's bound once its handler starts (the keys of a batch
    run one after another): from then on the key is beaten no more and its :meth:`check`
    raises :class:`HandlerTimedOut`, as :class:`LeaseKeeper` does with ``runtime``.
    """

    def __init__(
        self,
        store: IdempotencyStore,
        claims: Sequence[Claim],
        interval: float,
        confirmed_at: float | None = None,
    ) -> None:
        self.store = store
        self.interval = interval
        self.lost: dict[str, LeaseLost] = {}
        self.beats = 0
        self.confirmed_at = confirmed_at if confirmed_at is not None else -math.inf
        self._claims = {claim.key: claim for claim in claims}
        self._expires = {claim.key: claim.lease_expires_at for claim in claims}
        self._until: dict[str, tuple[float, float]] = {}
        self.overran: dict[str, HandlerTimedOut] = {}
        self._lock = threading.Lock()
        self._beating = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease:batch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def release(self, key: str) -> None:
        with self._lock:
            self._claims.pop(key, None)
            self._expires.pop(key, None)

    def bound(self, key: str, runtime: float) -> float:
        """Start ``key``'s bound of ``runtime`` seconds now; returns its monotonic end."""
        until = time.monotonic() + runtime
        with self._lock:
            self._until[key] = (until, runtime)
        return until

    def until(self, key: str) -> float | None:
        found = self._until.get(key)
        return None if found is None else found[0]

    def met(self, key: str) -> None:
        """``key``'s work returned within its bound: lift it, so the batch's completion after
        its later members ran is not refused."""
        if self._overran(key) is None:
            with self._lock:
                self._until.pop(key, None)

    def _overran(self, key: str) -> HandlerTimedOut | None:
        found = self._until.get(key)
        if found is None or time.monotonic() < found[0]:
            return None
        with self._lock:
            return self.overran.setdefault(key, HandlerTimedOut(key, found[1]))

    def check(self, key: str) -> None:
        """Raise :class:`LeaseLost` if ``key`` was taken over or its lease may have run out,
        :class:`HandlerTimedOut` once its bound has passed."""
        error: SekaliError | None = self.lost.get(key) or self._overran(key)
        error = error or self._expired(key)
        if error is not None:
            raise error

    def _expired(self, key: str) -> LeaseLost | None:
        with self._lock:
            claim = self._claims.get(key)
            if claim is None or self.store.clock() < self._expires[key]:
                return None
            return self.lost.setdefault(
                key,
                LeaseLost(
                    key,
                    claim.owner_token,
                    reason="ran out before a heartbeat could renew it (the store did not answer)",
                ),
            )

    def confirm(self, key: str) -> None:
        """:meth:`LeaseKeeper.confirm` for one key; a heartbeat, when needed, beats them all."""
        self.check(key)
        with self._lock:
            claims = list(self._claims.values())
        if time.monotonic() - self.confirmed_at >= self.store.fresh_for(claims):
            self._beat()
            self.check(key)

    def keeper_for(self, claim: Claim) -> Keeper:
        return _BatchMember(self, claim.key)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
                self.beats += 1
            except Exception:  # noqa: BLE001 - store briefly unavailable: beat again
                with self._lock:
                    keys = list(self._claims)
                if all(self._expired(key) is not None for key in keys):
                    logger.warning("the batch's leases ran out unrenewed; its jobs must stop",
                                   exc_info=True)
                    return
                logger.warning("heartbeat of a batch failed; retrying", exc_info=True)

    def _beat(self) -> None:
        with self._beating:
            with self._lock:
                keys = list(self._claims)
            for key in keys:
                self._expired(key)
                self._overran(key)
            with self._lock:
                live = [c for key, c in self._claims.items()
                        if key not in self.lost and key not in self.overran]
            if not live:
                return
            asked = time.monotonic()
            expires, lost = self.store.heartbeat_many(live)
            with self._lock:
                for claim in live:
                    if claim.key in lost and claim.key in self._claims:
                        self.lost[claim.key] = LeaseLost(claim.key, claim.owner_token)
                    elif claim.key in self._expires:
                        self._expires[claim.key] = expires
            self.confirmed_at = asked


@dataclass(frozen=True)
class _BatchMember:
    keeper: BatchLeaseKeeper
    key: str

    def check(self) -> None:
        self.keeper.check(self.key)

    def confirm(self) -> None:
        self.keeper.confirm(self.key)

    @property
    def until(self) -> float | None:
        return self.keeper.until(self.key)


def _claim_sqlite(
    conn: DriverConnection, params: dict[str, Any]
) -> tuple[Record, bool, str | None] | None:
    """One key's claim inside a ``BEGIN IMMEDIATE`` transaction: (record, claimed, previous
    status), or None when the key vanished between the two statements (look again)."""
    before = conn.row(_SELECT_ONE, params)
    row = conn.row(_BEGIN_SQLITE, params)
    if row is None and before is None:
        return None
    previous = before[2] if before is not None else None
    if row is not None:
        return Record.from_row(row), True, previous
    assert before is not None
    return Record.from_row(before), False, previous


def _rows_autocommit(db: Database, sql: Sql, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    with connect(db) as conn:
        return conn.rows(sql, params)


def _retry_deadlock(fn: Callable[[], T], tries: int = 5) -> T:
    """Run one autocommit statement again if Postgres rolled it back to break a deadlock (two
    batches, or a batch and a stale owner, waiting on each other's rows): nothing of it stayed."""
    for attempt in range(tries):
        try:
            return fn()
        except Exception as exc:
            cause = exc.__cause__ if exc.__cause__ is not None else exc
            if attempt == tries - 1 or not (is_deadlock(exc) or is_deadlock(cause)):
                raise
            time.sleep(0.005 * (attempt + 1))
    raise AssertionError("unreachable")
