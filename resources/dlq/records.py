"""A DLQ record and what it is made of: its statuses and their transitions, the failure a
sensor or a worker reports, how any text is bounded before it is stored, and the tables.

The status machine is written here, beside the enum, and enforced by the store's conditional
updates (:mod:`resources.dlq.store`), the one writer of these tables.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from sqlalchemy import BigInteger, Column, Float, Integer, Table, Text

from resources.dlq.fingerprints import fingerprint
from resources.errors import SekaliError
from resources.retry.classify import FailureClass
from resources.storage.db import metadata
from resources.storage.json_text import from_text, storable, storable_key
from resources.storage.settings import ID_BYTES, KEY_BYTES


class DlqStatus(StrEnum):
    """Status of a DLQ record. Transitions (anything else is refused by the conditional updates):

    =================  ==========================================================  ================
    from               event                                                       to
    =================  ==========================================================  ================
    (absent)           a run failed for good for this request                      open
    open               an operator asks for a replay (CLI, UI job)                 replay_requested
    replay_requested   the replay sensor claims it and emits ``dlq-replay:{id}:{n}``  replaying
    replaying          the replay run succeeded                                    resolved
    replaying          the replay run failed or was canceled (count increased)     open
    replaying          its replay run cannot be built (the audit says why)         open
    open/replay_req.   an operator discards it (with a reason)                     discarded
    open               an amended replay made a new version (audit ``superseded``)  discarded
    open/replay_req.   the request completed some other way (late retry, relaunch) resolved
    resolved           a later failure of the same request                         open
    =================  ==========================================================  ================
    """

    OPEN = "open"
    REPLAY_REQUESTED = "replay_requested"
    REPLAYING = "replaying"
    RESOLVED = "resolved"
    DISCARDED = "discarded"


_D = DlqStatus
TRANSITIONS: dict[DlqStatus | None, frozenset[DlqStatus]] = {
    None: frozenset({_D.OPEN}),
    _D.OPEN: frozenset({_D.REPLAY_REQUESTED, _D.DISCARDED, _D.RESOLVED}),
    _D.REPLAY_REQUESTED: frozenset({_D.REPLAYING, _D.DISCARDED, _D.RESOLVED}),
    _D.REPLAYING: frozenset({_D.RESOLVED, _D.OPEN}),
    _D.RESOLVED: frozenset({_D.OPEN}),
    _D.DISCARDED: frozenset(),
}


def sources_of(target: DlqStatus) -> list[str]:
    return sorted(str(s) for s, targets in TRANSITIONS.items() if s and target in targets)


class DlqRecordNotFound(SekaliError):
    """No DLQ record has this id. List the records with ``sekali dlq list``."""

    permanent = True

    def __init__(self, record_id: int) -> None:
        super().__init__(f"no DLQ record {record_id}; see `sekali dlq list`")
        self.record_id = record_id


class RetentionTooShort(SekaliError):
    """A retention shorter than a weekend would drop failures before anyone could replay them."""

    permanent = True

    def __init__(self, seconds: float, minimum: float) -> None:
        super().__init__(
            f"retention of {seconds / 3600:.1f}h is shorter than the minimum "
            f"{minimum / 3600:.0f}h (a weekend's failures must survive until Monday); raise it"
        )
        self.seconds = seconds
        self.minimum = minimum


MIN_RETENTION_SECONDS = 72 * 3600.0

SUPERSEDED = "superseded"
"""The audit action of a record closed because a new version of its request replaced it (an
amended replay): the record is ``discarded`` and can never be replayed under the old key."""

MARK_WINDOW = 1000
"""Audit ids behind the newest in which a late commit still moves :meth:`DlqStore.change_mark`."""

UNRESOLVED = (_D.OPEN, _D.REPLAY_REQUESTED, _D.REPLAYING)


@dataclass(frozen=True)
class FailureInfo:
    """One failure of one request, as a sensor or the sweep found it."""

    job_type: str
    dedupe_key: str
    error_type: str
    message: str
    run_id: str
    error_class: FailureClass = FailureClass.UNKNOWN
    step: str = ""
    frame: str = ""
    trace: str = ""
    idempotency_key: str | None = None
    request_id: int | None = None
    payload: Any = None
    run_config: dict[str, Any] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    correlation_id: str | None = None
    failed_at: float | None = None
    dlq_id: int | None = None
    trace_id: str | None = None

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.error_type, self.message, self.frame)


def dedupe_key_for(
    job_type: str, *, request_id: int | None, idempotency_key: str | None, run_id: str, step: str
) -> str:
    """One record per request; else per job type and key; else per run and step."""
    if request_id is not None:
        return f"request:{request_id}"
    if idempotency_key:
        return f"key:{job_type}:{idempotency_key}"
    return f"run:{run_id}:{step}"


JSON_LIMIT_FACTOR = 4
"""A stored payload, run config or tags may be this many times ``InputLimits.payload_bytes``:
every payload the boundary accepts fits, even written with ASCII escapes."""

DEDUPE_KEY_BYTES = 1024  # dedupe keys: well under Postgres's 2,704-byte index row
DETAIL_BYTES = 2000
MESSAGE_BYTES = 4000
TRACE_BYTES = 16000


def whole_key(key: str | None, max_bytes: int = KEY_BYTES) -> str | None:
    """``key`` (or an id: ``max_bytes=ID_BYTES``) as a record keeps it: whole, or None when no
    database could store it whole (the boundary refuses such a value, so it never ran; see
    :mod:`resources.dlq.store`). Never a prefix: a replay or a lookup under a cut key would be
    another intent, an effect under a cut correlation id another request."""
    if key is None or _UNSTORABLE_KEY.search(key) or len(key.encode("utf-8")) > max_bytes:
        return None
    return key


_UNSTORABLE_KEY = re.compile("[\x00\ud800-\udfff]")


def storable_failure(info: FailureInfo) -> FailureInfo:
    """``info`` with every text field storable on both databases and bounded."""

    return dataclasses.replace(
        info,
        job_type=storable(info.job_type, ID_BYTES),
        dedupe_key=storable_key(info.dedupe_key, DEDUPE_KEY_BYTES),
        error_type=storable(info.error_type, ID_BYTES),
        message=storable(info.message, MESSAGE_BYTES),
        run_id=storable(info.run_id, ID_BYTES),
        step=storable(info.step, ID_BYTES),
        frame=storable(info.frame, ID_BYTES),
        trace=storable(info.trace, TRACE_BYTES),
        idempotency_key=whole_key(info.idempotency_key),
        correlation_id=whole_key(info.correlation_id, ID_BYTES),
    )


@dataclass(frozen=True)
class DlqRecord:
    id: int
    dedupe_key: str
    job_type: str
    idempotency_key: str | None
    request_id: int | None
    run_id: str | None
    step: str | None
    payload: Any
    run_config: dict[str, Any]
    tags: dict[str, str]
    error_class: str
    error_type: str
    fingerprint: str
    last_error: str | None
    trace: str | None
    failure_count: int
    replay_count: int
    first_failed_at: float
    last_failed_at: float
    correlation_id: str | None
    status: DlqStatus
    status_changed_at: float
    created_at: float
    updated_at: float
    trace_id: str | None = None

    @classmethod
    def from_row(cls, row: Any) -> DlqRecord:
        m = row._mapping
        return cls(
            id=int(m["id"]),
            dedupe_key=m["dedupe_key"],
            job_type=m["job_type"],
            idempotency_key=m["idempotency_key"],
            request_id=None if m["request_id"] is None else int(m["request_id"]),
            run_id=m["run_id"],
            step=m["step"],
            payload=from_text(m["payload"]),
            run_config=from_text(m["run_config"]) or {},
            tags=from_text(m["tags"]) or {},
            error_class=m["error_class"],
            error_type=m["error_type"],
            fingerprint=m["fingerprint"],
            last_error=m["last_error"],
            trace=m["trace"],
            failure_count=int(m["failure_count"]),
            replay_count=int(m["replay_count"]),
            first_failed_at=float(m["first_failed_at"]),
            last_failed_at=float(m["last_failed_at"]),
            correlation_id=m["correlation_id"],
            status=DlqStatus(m["status"]),
            status_changed_at=float(m["status_changed_at"]),
            created_at=float(m["created_at"]),
            updated_at=float(m["updated_at"]),
            trace_id=m["trace_id"],
        )

    @property
    def replay_run_key(self) -> str:
        """The run key of this record's current replay (``replay_count`` is its number)."""
        return f"dlq-replay:{self.id}:{self.replay_count}"

    def summary(self) -> dict[str, Any]:
        """The JSON-friendly view for ``sekali dlq list --json``."""
        return {
            "id": self.id,
            "status": str(self.status),
            "job_type": self.job_type,
            "idempotency_key": self.idempotency_key,
            "request_id": self.request_id,
            "error_class": self.error_class,
            "error_type": self.error_type,
            "fingerprint": self.fingerprint,
            "failure_count": self.failure_count,
            "replay_count": self.replay_count,
            "first_failed_at": self.first_failed_at,
            "last_failed_at": self.last_failed_at,
            "last_error": (self.last_error or "")[:200],
            "trace_id": self.trace_id,
        }


@dataclass(frozen=True)
class RecordedFailure:
    """What :meth:`DlqStore.record_failure` did: ``created`` a record, counted a ``new_failure``
    (False when this run was seen before), and the record as it is now."""

    record: DlqRecord
    created: bool
    new_failure: bool


@dataclass(frozen=True)
class ReplayDecision:
    """Whether a selected record will be (or, in a dry run, would be) replayed, and why not."""

    record: DlqRecord
    replay: bool
    reason: str
    key_reset: bool = False


dlq_records = Table(
    "dlq_records",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("dedupe_key", Text, nullable=False, unique=True),
    Column("job_type", Text, nullable=False),
    Column("idempotency_key", Text),
    Column("request_id", BigInteger),
    Column("run_id", Text),
    Column("step", Text),
    Column("payload", Text),
    Column("run_config", Text),
    Column("tags", Text),
    Column("error_class", Text, nullable=False),
    Column("error_type", Text, nullable=False),
    Column("fingerprint", Text, nullable=False),
    Column("last_error", Text),
    Column("trace", Text),
    Column("failure_count", Integer, nullable=False),
    Column("replay_count", Integer, nullable=False),
    Column("first_failed_at", Float, nullable=False),
    Column("last_failed_at", Float, nullable=False),
    Column("correlation_id", Text),
    Column("status", Text, nullable=False),
    Column("status_changed_at", Float, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("trace_id", Text),
)

dlq_failures = Table(
    "dlq_failures",
    metadata,
    Column("record_id", BigInteger, primary_key=True),
    Column("run_id", Text, primary_key=True),
    Column("step", Text, primary_key=True),
    Column("seen_at", Float, nullable=False),
)

dlq_audit = Table(
    "dlq_audit",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("record_id", BigInteger, nullable=False),
    Column("action", Text, nullable=False),
    Column("actor", Text, nullable=False),
    Column("from_status", Text),
    Column("to_status", Text),
    Column("detail", Text),
    Column("at", Float, nullable=False),
)
