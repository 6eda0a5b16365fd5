"""The ledger's records: the table, its statuses and their transitions, the record as read, the
claim a worker holds and the outcomes of a claim; and the named statements over the table, which
only this package runs (:mod:`resources.idempotency.store` writes, :mod:`.views` reads,
:mod:`.dialects` claims).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from sqlalchemy import BigInteger, Column, Float, Integer, Table, Text

from resources.errors import SekaliError
from resources.storage.db import metadata
from resources.storage.json_text import canonical, from_text
from resources.storage.queries import filled_queries, load_dialect_queries, load_queries


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

RECORD_COLUMNS = (
    "key", "payload_hash", "status", "owner_token", "lease_expires_at", "fence", "attempt",
    "recovery_point", "recovery_data", "result", "error_class", "error_message", "created_at",
    "updated_at", "retention_expires_at", "crashes",
)
"""What a statement reads of a record, in :meth:`Record.from_row`'s order: ``{columns}`` in the
query files (``{r.columns}``: each prefixed with the alias ``r``)."""

_QUERY_FILE = Path(__file__).with_name("queries.sql")
QUERIES = {
    dialect: filled_queries(queries, fragments=("claim_on_conflict", "owner_check"),
                            columns=RECORD_COLUMNS)
    for dialect, queries in load_dialect_queries(_QUERY_FILE).items()
}
"""The ledger's named statements per dialect (fragments and column lists filled at import)."""
CONDITIONS = load_queries(_QUERY_FILE)
"""The same file's blocks as written, for the SQL conditions other stores and retention read
(``{column}``: a column name from code, never input)."""


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
        """From a SQLAlchemy row or a driver tuple whose first columns are
        :data:`RECORD_COLUMNS`."""
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
