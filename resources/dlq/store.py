"""The dead letter queue: what failed for good, kept with its reason until a person decides.

A DLQ is not a trash can. Each record is one failed job request (or, when a run names no request,
one job type and idempotency key), however many runs failed for it. It keeps what is needed to
understand the failure (error class, fingerprint, last error and trace, failure count, first and
last failure time, correlation id) and to replay it safely (the job type, the run config and the
tags of the run, the original idempotency key). An audit trail says who did what.

Guarantees (SQLite and Postgres alike):

- :meth:`DlqStore.record_failure` is idempotent per failed run: each (record, run, step) is
  listed once in ``dlq_failures``, so a sensor and a sweep that both see a run make one record and
  count one failure. Concurrent callers for one request make one record (unique ``dedupe_key``).
- Every status change is one conditional ``UPDATE`` checked against :data:`TRANSITIONS`, and is
  written to ``dlq_audit`` in the same transaction.
- :meth:`DlqStore.request_replay` moves only ``open`` records, and resets only their idempotency
  keys (``failed`` -> ``retryable``, :meth:`IdempotencyStore.reset`); a second request for the
  same record is a no-op. :meth:`DlqStore.claim_for_replay` hands each requested record to one
  caller with a new replay number, so ``dlq-replay:{id}:{n}`` run keys never repeat a replay.
- Records are never dropped while open: :meth:`DlqStore.purge` deletes only resolved or discarded
  ones past their retention.
- Whatever a failure holds, it is stored (SQLite and Postgres): NUL and lone surrogates in its
  text are escaped, every text column is bounded (message 4,000 bytes, trace 16,000, ids and
  keys a few hundred), and a payload, run config or tags whose JSON text is larger than
  :data:`JSON_LIMIT_FACTOR` times ``InputLimits.payload_bytes`` (or has no JSON text) is kept as
  a ``{"sekali_truncated": ...}`` object with its size, sha256 and excerpt. The idempotency key
  is stored whole (:func:`whole_key`), so every lookup by key (the replay's reset, resolving a
  completed key, amending, retention's references) finds the key that ran; a key no database
  stores whole (NUL, a lone surrogate, past :data:`KEY_BYTES`) was refused at the boundary and
  never ran: the record keeps none, its run config keeps it (escaped), and a replay is refused
  there. The dedupe key, longer or escaped, is kept as a prefix and a hash of the whole, so
  distinct keys stay distinct.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from sqlalchemy import BigInteger, Column, Float, Integer, Table, Text, bindparam, text
from sqlalchemy.engine import Connection

from resources.errors import SekaliError
from resources.retry.classify import FailureClass
from resources.storage import retention
from resources.storage.db import Database, metadata
from resources.storage.json_text import digest, from_text, storable, storable_key, to_text
from resources.storage.settings import ID_BYTES, KEY_BYTES, InputLimits

log = logging.getLogger(__name__)

Clock = Callable[[], float]


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
_UNRESOLVED_SQL = ", ".join(f"'{s}'" for s in UNRESOLVED)

# -- fingerprints ------------------------------------------------------------------------------

_UUID = re.compile(
    r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"
)
_HEX = re.compile(
    r"\b0x[0-9a-fA-F]+\b|\b(?=[0-9a-fA-F]*[a-fA-F])(?=[0-9a-fA-F]*\d)[0-9a-fA-F]{8,}\b"
)
_NUM = re.compile(r"(?<![A-Za-z_])-?\d+(?:\.\d+)?")
_FRAME = re.compile(r'File "([^"\n]+)", line \d+, in (\S+)')
_FRAME_TAIL = 20_000  # top_frame reads the innermost frame: the last characters of a trace
def normalise_message(message: str) -> str:
    """The message with what varies between occurrences (uuids, hex ids, numbers) replaced."""
    message = _UUID.sub("<uuid>", message)
    message = _HEX.sub("<hex>", message)
    message = _NUM.sub("<n>", message)
    return " ".join(message.split())[:500]


def top_frame(stack: Sequence[str] | str | None) -> str:
    """``file:function`` of the innermost frame (where it was raised); line numbers dropped so a
    fingerprint survives unrelated edits."""
    if not stack:
        return ""
    text_ = stack if isinstance(stack, str) else "".join(stack)
    frames = _FRAME.findall(text_[-_FRAME_TAIL:])
    if not frames:
        return ""
    path, func = frames[-1]  # the innermost frame: the end of the text is enough
    return f"{path.rsplit('/', 1)[-1]}:{func}"


_TRACE_START = re.compile(r"\n\s*(?:Stack Trace:|Traceback \(most recent call last\):)")


def failure_line(error_type: str | None, message: str | None) -> str:
    """A failure as one line for a person: ``Type: message``, the type said once (a message
    that starts with it, qualified or not, is not prefixed again), any stack trace the message
    carries (a run failure's ``Stack Trace:``, a ``Traceback``) left out, whitespace folded.
    What ``sekali dlq list|show`` and the ``dead_letters`` asset print."""
    text_ = _TRACE_START.split(message or "", maxsplit=1)[0]
    text_ = " ".join(text_.split())
    kind = error_type or ""
    if not kind:
        return text_
    qualified = re.match(rf"[\w.]*\.{re.escape(kind)}:", text_)
    if qualified:  # ``pkg.module.UnknownSku: ...`` reads as ``UnknownSku: ...``
        return kind + text_[qualified.end() - 1:]
    if text_.startswith(f"{kind}:") or text_ == kind:
        return text_
    return f"{kind}: {text_}" if text_ else kind


def fingerprint(error_type: str, message: str, frame: str) -> str:
    """Groups failures with one cause: exception type + normalised message + top frame."""
    raw = f"{error_type}|{normalise_message(message)}|{frame}"
    return hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()[:16]


# -- records -----------------------------------------------------------------------------------


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

_KEY_BYTES = 1024  # dedupe keys: well under Postgres's 2,704-byte index row
_ID_BYTES = ID_BYTES  # job type, run id, step, error type, actor: the longest id admitted
_DETAIL_BYTES = 2000
_MESSAGE_BYTES = 4000
_TRACE_BYTES = 16000


def whole_key(key: str | None, max_bytes: int = KEY_BYTES) -> str | None:
    """``key`` (or an id: ``max_bytes=ID_BYTES``) as a record keeps it: whole, or None when no
    database could store it whole (the boundary refuses such a value, so it never ran; see the
    module docstring). Never a prefix: a replay or a lookup under a cut key would be another
    intent, an effect under a cut correlation id another request."""
    if key is None or _UNSTORABLE_KEY.search(key) or len(key.encode("utf-8")) > max_bytes:
        return None
    return key


_UNSTORABLE_KEY = re.compile("[\x00\ud800-\udfff]")


def storable_failure(info: FailureInfo) -> FailureInfo:
    """``info`` with every text field storable on both databases and bounded."""

    return dataclasses.replace(
        info,
        job_type=storable(info.job_type, _ID_BYTES),
        dedupe_key=storable_key(info.dedupe_key, _KEY_BYTES),
        error_type=storable(info.error_type, _ID_BYTES),
        message=storable(info.message, _MESSAGE_BYTES),
        run_id=storable(info.run_id, _ID_BYTES),
        step=storable(info.step, _ID_BYTES),
        frame=storable(info.frame, _ID_BYTES),
        trace=storable(info.trace, _TRACE_BYTES),
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


_COLUMNS = (
    "id, dedupe_key, job_type, idempotency_key, request_id, run_id, step, payload, run_config,"
    " tags, error_class, error_type, fingerprint, last_error, trace, failure_count,"
    " replay_count, first_failed_at, last_failed_at, correlation_id, status,"
    " status_changed_at, created_at, updated_at, trace_id"
)

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

_INSERT = f"""
INSERT INTO dlq_records (dedupe_key, job_type, idempotency_key, request_id, run_id, step, payload,
    run_config, tags, error_class, error_type, fingerprint, last_error, trace, failure_count,
    replay_count, first_failed_at, last_failed_at, correlation_id, status, status_changed_at,
    created_at, updated_at, trace_id)
VALUES (:dedupe_key, :job_type, :ikey, :request_id, :run_id, :step, :payload, :run_config, :tags,
    :eclass, :etype, :fp, :msg, :trace, 1, 0, :failed_at, :failed_at, :cid, 'open', :now, :now,
    :now, :trace_id)
ON CONFLICT (dedupe_key) DO NOTHING
RETURNING {_COLUMNS}
"""  # nosec B608: SQL from code constants, values bound


class DlqStore:
    """The DLQ over a :class:`Database`. Thread-safe; share one per process."""

    def __init__(
        self, db: Database, *, clock: Clock = time.time, limits: InputLimits | None = None
    ) -> None:
        self.db = db
        self.clock = clock
        self.json_limit = JSON_LIMIT_FACTOR * (limits or InputLimits.from_env()).payload_bytes

    # -- dead-lettering ---------------------------------------------------------------------

    def record_failure(
        self, info: FailureInfo, *, actor: str = "dlq_sensor", conn: Connection | None = None
    ) -> RecordedFailure:
        """Create or update the record for ``info``; a run and step seen before changes nothing.
        Any text is stored, escaped and bounded (module docstring). ``conn``: in the caller's
        transaction (the request's final state and its record commit together)."""
        if conn is not None:
            return self._record_failure(conn, info, actor)
        with self.db.transaction() as own:
            return self._record_failure(own, info, actor)

    def _record_failure(self, conn: Connection, info: FailureInfo, actor: str) -> RecordedFailure:
        info = storable_failure(info)
        now = self.clock()
        failed_at = info.failed_at if info.failed_at is not None else now
        params = {
            "dedupe_key": info.dedupe_key,
            "job_type": info.job_type,
            "ikey": info.idempotency_key,
            "request_id": info.request_id,
            "run_id": info.run_id,
            "step": info.step,
            "payload": None if info.payload is None else self._json(info.payload),
            "run_config": self._json(info.run_config),
            "tags": self._json(info.tags),
            "eclass": str(info.error_class),
            "etype": info.error_type,
            "fp": info.fingerprint,
            "msg": info.message,
            "trace": info.trace,
            "failed_at": failed_at,
            "cid": info.correlation_id,
            "now": now,
            "trace_id": info.trace_id,
        }
        row = None
        if info.dlq_id is not None:
            row = self._select(conn, "id = :id", {"id": info.dlq_id}, lock=True)
        created = False
        if row is None:  # looked up first: an insert that meets a conflict spends an id
            row = self._select(conn, "dedupe_key = :k", {"k": info.dedupe_key}, lock=True)
        if row is None:
            row = conn.execute(text(_INSERT), params).first()
            created = row is not None
            if row is None:  # another process inserted it meanwhile
                row = self._select(conn, "dedupe_key = :k", {"k": info.dedupe_key}, lock=True)
        assert row is not None
        record = DlqRecord.from_row(row)
        seen = conn.execute(
            text(
                "INSERT INTO dlq_failures (record_id, run_id, step, seen_at)"
                " VALUES (:rid, :run, :step, :now) ON CONFLICT DO NOTHING"
            ),
            {"rid": record.id, "run": info.run_id, "step": info.step, "now": now},
        ).rowcount
        if created:
            self._audit(
                conn,
                record.id,
                "dead_lettered",
                actor,
                None,
                _D.OPEN,
                f"run {info.run_id} {info.error_type}",
                now,
            )
            return RecordedFailure(record, True, True)
        if not seen:
            return RecordedFailure(record, False, False)
        status = record.status
        action = "failed_again"
        if status is _D.REPLAYING and info.dlq_id == record.id:
            status, action = _D.OPEN, "replay_failed"
        elif status is _D.RESOLVED and failed_at > record.status_changed_at:
            status, action = _D.OPEN, "reopened"
        conn.execute(
            text(
                "UPDATE dlq_records SET run_id = :run_id, step = :step, error_class = :eclass,"
                # A record first seen without them (batch, sweep) gets a later run's.
                " run_config = CASE WHEN run_config IS NULL OR run_config = '{}'"
                "   THEN :run_config ELSE run_config END,"
                " tags = CASE WHEN tags IS NULL OR tags = '{}' THEN :tags ELSE tags END,"
                " error_type = :etype, fingerprint = :fp, last_error = :msg, trace = :trace,"
                " failure_count = failure_count + 1,"
                " last_failed_at = CASE WHEN last_failed_at > :failed_at"
                "   THEN last_failed_at ELSE :failed_at END,"
                " status = :status,"
                " status_changed_at = CASE WHEN status = :status THEN status_changed_at"
                "   ELSE :now END,"
                " updated_at = :now WHERE id = :id"
            ),
            {**params, "status": str(status), "id": record.id},
        )
        self._audit(
            conn,
            record.id,
            action,
            actor,
            record.status,
            status,
            f"run {info.run_id} {info.error_type}",
            now,
        )
        updated = self._select(conn, "id = :id", {"id": record.id}, lock=False)
        assert updated is not None
        return RecordedFailure(DlqRecord.from_row(updated), False, True)

    # -- operators --------------------------------------------------------------------------

    def request_replay(
        self,
        ids: Iterable[int],
        *,
        actor: str,
        reason: str = "",
        idempotency: Any = None,
        dry_run: bool = False,
    ) -> list[ReplayDecision]:
        """Ask for a replay of each ``open`` record; others are reported, not touched.

        For each record moved, its idempotency key is reset from ``failed`` to ``retryable``
        through ``idempotency.reset(key)`` (an :class:`IdempotencyStore`), and only for those.
        ``dry_run`` changes nothing and says what would be replayed.
        """
        decisions: list[ReplayDecision] = []
        for record_id in ids:
            record = self.get(record_id)
            if record.status is not _D.OPEN:
                decisions.append(ReplayDecision(record, False, f"status is {record.status}"))
                continue
            if dry_run:
                decisions.append(ReplayDecision(record, True, "would replay (dry run)"))
                continue
            moved = self._move(
                record.id,
                _D.REPLAY_REQUESTED,
                actor=actor,
                action="replay_requested",
                detail=reason,
            )
            if not moved:
                decisions.append(ReplayDecision(self.get(record.id), False, "changed meanwhile"))
                continue
            reset = False
            if idempotency is not None and record.idempotency_key:
                reset = bool(idempotency.reset(record.idempotency_key))
            decisions.append(ReplayDecision(self.get(record.id), True, "replay requested", reset))
        return decisions

    def discard(self, ids: Iterable[int], *, actor: str, reason: str) -> list[ReplayDecision]:
        """Give up on records for good (kept, marked ``discarded``, with the reason)."""
        if not reason.strip():
            raise ValueError("a discard needs a reason")
        out = []
        for record_id in ids:
            moved = self._move(
                record_id, _D.DISCARDED, actor=actor, action="discarded", detail=reason
            )
            record = self.get(record_id)
            out.append(
                ReplayDecision(
                    record, moved, "discarded" if moved else f"status is {record.status}"
                )
            )
        return out

    def supersede(
        self, record_id: int, *, actor: str, detail: str, conn: Connection
    ) -> bool:
        """Close an ``open`` record because a new version of its request carries the intent
        (status ``discarded``, audit action ``superseded``, ``detail`` naming the version), in
        the caller's transaction so the close and the version's link commit together. False
        when the record is no longer open (another amendment or replay got there first)."""
        now = self.clock()
        moved = conn.execute(
            text(
                "UPDATE dlq_records SET status = 'discarded', status_changed_at = :now,"
                " updated_at = :now WHERE id = :id AND status = 'open'"
            ),
            {"now": now, "id": record_id},
        ).rowcount
        if moved:
            self._audit(conn, record_id, SUPERSEDED, actor, _D.OPEN, _D.DISCARDED, detail, now)
        return bool(moved)

    def note(self, record_id: int, action: str, *, actor: str, detail: str = "") -> None:
        """An audit line that changes no status (a bulk replay's skipped record, with why)."""
        with self.db.transaction() as conn:
            self._audit(conn, record_id, action, actor, None, None, detail, self.clock())

    # -- the replay sensor ------------------------------------------------------------------

    def claim_for_replay(self, limit: int, *, actor: str = "dlq_replay_sensor") -> list[DlqRecord]:
        """Move up to ``limit`` ``replay_requested`` records (oldest request first) to
        ``replaying`` with their replay number increased, and return them."""
        if limit <= 0:
            return []
        now = self.clock()
        skip = " FOR UPDATE SKIP LOCKED" if self.db.is_postgres else ""
        with self.db.transaction() as conn:
            ids = [
                int(r.id)
                for r in conn.execute(
                    text(
                        "SELECT id FROM dlq_records WHERE status = 'replay_requested'"
                        f" ORDER BY status_changed_at, id LIMIT :limit{skip}"  # nosec B608: SQL from code constants, values bound
                    ),
                    {"limit": limit},
                )
            ]
            if not ids:
                return []
            conn.execute(
                text(
                    "UPDATE dlq_records SET status = 'replaying', replay_count = replay_count + 1,"
                    " status_changed_at = :now, updated_at = :now"
                    " WHERE id IN :ids AND status = 'replay_requested'"
                ).bindparams(bindparam("ids", expanding=True)),
                {"ids": ids, "now": now},
            )
            for record_id in ids:
                self._audit(
                    conn,
                    record_id,
                    "replay_launched",
                    actor,
                    _D.REPLAY_REQUESTED,
                    _D.REPLAYING,
                    None,
                    now,
                )
            rows = conn.execute(
                text(f"SELECT {_COLUMNS} FROM dlq_records WHERE id IN :ids").bindparams(  # nosec B608: SQL from code constants, values bound
                    bindparam("ids", expanding=True)
                ),
                {"ids": ids},
            ).all()
        return sorted((DlqRecord.from_row(r) for r in rows), key=lambda r: r.id)

    def refuse_replay(
        self, record_id: int, *, actor: str, detail: str, error_class: FailureClass | None = None
    ) -> bool:
        """A ``replaying`` record whose replay run cannot be built goes back to ``open`` (it
        would otherwise stay ``replaying`` for good); ``detail`` says why, for the operator.
        ``error_class``: the record's class from now on (``permanent`` when the stored request
        itself is refused: replaying it again cannot help)."""
        return self._move(
            record_id,
            _D.OPEN,
            actor=actor,
            action="replay_refused",
            detail=detail,
            sources=[str(_D.REPLAYING)],
            error_class=error_class,
        )

    def resolve(self, record_id: int, *, actor: str, detail: str = "") -> bool:
        """The request completed (a replay succeeded, or it finished some other way)."""
        return self._move(record_id, _D.RESOLVED, actor=actor, action="resolved", detail=detail)

    # -- reading ----------------------------------------------------------------------------

    def get(self, record_id: int) -> DlqRecord:
        with self.db.statement() as conn:
            row = self._select(conn, "id = :id", {"id": record_id}, lock=False)
        if row is None:
            raise DlqRecordNotFound(record_id)
        return DlqRecord.from_row(row)

    def find(self, dedupe_key: str) -> DlqRecord | None:
        with self.db.statement() as conn:
            row = self._select(
                conn, "dedupe_key = :k", {"k": storable_key(dedupe_key, _KEY_BYTES)}, lock=False
            )
        return None if row is None else DlqRecord.from_row(row)

    def list_records(
        self,
        *,
        status: Iterable[str] | str | None = None,
        job_type: str | None = None,
        error_class: str | None = None,
        fingerprint: str | None = None,
        older_than: float | None = None,
        newer_than: float | None = None,
        ids: Iterable[int] | None = None,
        request_id: int | None = None,
        limit: int | None = None,
        after_id: int | None = None,
        error_classes: Iterable[str] | None = None,
        by_id: bool = True,
        scan_ids: bool = False,
    ) -> list[DlqRecord]:
        """Records matching every filter given, by id; ages are seconds since the last failure.
        ``after_id`` with ``limit`` reads one page (ids above it): what a sensor tick reads.
        ``by_id=False``: in whatever order an index gives (a few matches of a large set, no
        sort). ``scan_ids``: read along the primary key, checking the status row by row (the
        first ``limit`` of a status most records have, without sorting all of them)."""
        where: list[str] = []
        params: dict[str, Any] = {}
        expanding: list[str] = []
        if after_id is not None:
            where.append("id > :after_id")
            params["after_id"] = int(after_id)
        if error_classes is not None:
            where.append("error_class IN :classes")
            params["classes"] = [str(c) for c in error_classes] or ["-"]
            expanding.append("classes")
        if status is not None:
            where.append(f"{self._by_id('status') if scan_ids else 'status'} IN :statuses")
            params["statuses"] = [status] if isinstance(status, str) else [str(s) for s in status]
            expanding.append("statuses")
        if ids is not None:
            where.append("id IN :ids")
            params["ids"] = [int(i) for i in ids] or [-1]
            expanding.append("ids")
        for column, value in (
            ("job_type", job_type),
            ("error_class", error_class),
            ("fingerprint", fingerprint),
            ("request_id", request_id),
        ):
            if value is not None:
                where.append(f"{column} = :{column}")
                params[column] = value
        now = self.clock()
        if older_than is not None:
            where.append("last_failed_at <= :old")
            params["old"] = now - older_than
        if newer_than is not None:
            where.append("last_failed_at >= :new")
            params["new"] = now - newer_than
        sql = f"SELECT {_COLUMNS} FROM dlq_records"  # nosec B608: SQL from code constants, values bound
        if where:
            sql += " WHERE " + " AND ".join(where)
        if by_id:
            sql += " ORDER BY id"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        stmt = text(sql)
        if expanding:
            stmt = stmt.bindparams(*(bindparam(n, expanding=True) for n in expanding))
        with self.db.statement() as conn:
            return [DlqRecord.from_row(r) for r in conn.execute(stmt, params)]

    def records_of_run(self, run_id: str) -> list[DlqRecord]:
        """The records a run's failures were counted on (each written or updated where its
        failure was decided), by id."""
        with self.db.statement() as conn:
            rows = conn.execute(
                text(f"SELECT {_COLUMNS} FROM dlq_records WHERE id IN"  # nosec B608: SQL from code constants, values bound
                     " (SELECT record_id FROM dlq_failures WHERE run_id = :run) ORDER BY id"),
                {"run": run_id},
            ).all()
        return [DlqRecord.from_row(r) for r in rows]

    def audit(self, record_id: int) -> list[dict[str, Any]]:
        with self.db.statement() as conn:
            rows = conn.execute(
                text(
                    "SELECT action, actor, from_status, to_status, detail, at FROM dlq_audit"
                    " WHERE record_id = :id ORDER BY id"
                ),
                {"id": record_id},
            ).all()
        return [dict(r._mapping) for r in rows]

    def failures(self, record_id: int) -> list[str]:
        """The run ids that failed for this record, each once."""
        with self.db.statement() as conn:
            return [
                r.run_id
                for r in conn.execute(
                    text("SELECT run_id FROM dlq_failures WHERE record_id = :id ORDER BY seen_at"),
                    {"id": record_id},
                )
            ]

    def key_page(
        self, statuses: Iterable[str], *, after_id: int, limit: int, window: int = 10_000
    ) -> tuple[list[tuple[int, str | None]], int]:
        """``(id, idempotency_key)`` of the records in ``statuses`` among the ids above
        ``after_id`` and at most ``window`` past it, by id, at most ``limit``: one page without
        the records' bodies, read along the primary key (at most ``window`` rows examined,
        whatever the table holds). Returns the page and where the next one starts (0: the
        oldest again)."""
        with self.db.statement() as conn:
            rows = conn.execute(
                text(
                    "SELECT id, idempotency_key FROM dlq_records WHERE id > :after"
                    f" AND id <= :hi AND {self._by_id('status')} IN :statuses"
                    " ORDER BY id LIMIT :limit"  # nosec B608: SQL from code constants, values bound
                ).bindparams(bindparam("statuses", expanding=True)),
                {"statuses": [str(s) for s in statuses], "after": after_id,
                 "hi": after_id + window, "limit": limit},
            ).all()
            if len(rows) >= limit:
                following = int(rows[-1].id)
            else:
                newest = conn.execute(text("SELECT MAX(id) FROM dlq_records")).scalar() or 0
                following = after_id + window if after_id + window < int(newest) else 0
        return [(int(r.id), r.idempotency_key) for r in rows], following

    def _by_id(self, column: str) -> str:
        """``column`` as a condition SQLite checks row by row along the primary key instead of
        through an index on it (which would read every match, then sort by id)."""
        return column if self.db.is_postgres else f"+{column}"

    def tally(self, statuses: Iterable[str]) -> dict[tuple[str, str], int]:
        """How many records there are per (status, class) among ``statuses``: one grouped count
        in the database (the covering index ``dlq_records_status_class``), a few rows back."""
        with self.db.statement() as conn:
            rows = conn.execute(
                text(
                    "SELECT status, error_class, COUNT(*) AS n FROM dlq_records"
                    " WHERE status IN :statuses GROUP BY status, error_class"
                ).bindparams(bindparam("statuses", expanding=True)),
                {"statuses": [str(s) for s in statuses]},
            ).all()
        return {(str(r.status), str(r.error_class)): int(r.n) for r in rows}

    def change_mark(self) -> int:
        """A number that changes whenever a record is written (every write of this store adds
        an audit line); 0 when none.

        Not the newest audit id alone: on Postgres ids are taken at insert and rows appear at
        commit, so a write can become visible after a newer one was read::

            T1 inserts audit N (uncommitted)    T2 inserts N+1, commits
            reader: MAX = N+1, publishes        T1 commits: MAX still N+1, nothing moves

        The mark is ``MAX * (W + 1) + rows among the newest W ids`` (W = :data:`MARK_WINDOW`):
        T1's commit adds a row inside the window, so the mark moves. Bounded work (a range of
        W ids on the primary key); a write in flight while W newer ones commit is still missed
        until the next write."""
        with self.db.statement() as conn:
            row = conn.execute(
                text(
                    "SELECT m.top, (SELECT COUNT(*) FROM dlq_audit WHERE id > m.top - :w)"
                    " FROM (SELECT COALESCE(MAX(id), 0) AS top FROM dlq_audit) m"
                ),
                {"w": MARK_WINDOW},
            ).one()
        return int(row[0]) * (MARK_WINDOW + 1) + int(row[1])

    def counts(self) -> dict[str, int]:
        with self.db.statement() as conn:
            rows = conn.execute(
                text("SELECT status, COUNT(*) AS n FROM dlq_records GROUP BY status")
            ).all()
        out = {str(s): 0 for s in DlqStatus}
        out.update({r.status: int(r.n) for r in rows})
        return out

    # -- retention --------------------------------------------------------------------------

    def purge(
        self,
        retention_seconds: float,
        *,
        keep: Sequence[str] = (),
        batch_size: int = retention.BATCH_SIZE,
        max_batches: int = retention.MAX_BATCHES,
    ) -> int:
        """Delete resolved and discarded records whose last change is older than the retention,
        with their failures and audit trail; returns how many (in batches:
        :mod:`resources.storage.retention`). Open records are never dropped; nor is one that a
        ``keep`` condition over ``dlq_records`` holds (an unfinished request still pointing at
        it: the DLQ sweep would dead-letter that request again)."""
        return self.expired(retention_seconds, keep=keep).purge(
            self.db, batch_size=batch_size, max_batches=max_batches
        )

    def expired(self, retention_seconds: float, *, keep: Sequence[str] = ()) -> retention.Expiry:
        """What :meth:`purge` with the same arguments deletes now."""
        if retention_seconds < MIN_RETENTION_SECONDS:
            raise RetentionTooShort(retention_seconds, MIN_RETENTION_SECONDS)
        return retention.Expiry.of(
            "dlq_records",
            "id",
            "status IN ('resolved', 'discarded') AND status_changed_at <= :cutoff",
            {"cutoff": self.clock() - retention_seconds},
            keep=keep,
            children=(("dlq_failures", "record_id"), ("dlq_audit", "record_id")),
        )

    @staticmethod
    def unresolved_key_reference(column: str) -> str:
        """SQL, true while an unresolved record (open, replay requested, replaying) names the
        idempotency key in ``column``: a replay may still run under that key."""
        return (
            "EXISTS (SELECT 1 FROM dlq_records d WHERE d.idempotency_key = "
            f"{column} AND d.status IN ({_UNRESOLVED_SQL}))"  # nosec B608: SQL from code constants, values bound
        )

    @staticmethod
    def unresolved_request_reference(column: str) -> str:
        """SQL, true while an unresolved record holds the request whose id is in ``column``."""
        return (
            "EXISTS (SELECT 1 FROM dlq_records d WHERE d.request_id = "
            f"{column} AND d.status IN ({_UNRESOLVED_SQL}))"  # nosec B608: SQL from code constants, values bound
        )

    @staticmethod
    def request_reference(column: str) -> str:
        """SQL, true when any record (whatever its status) holds the request in ``column``."""
        return f"EXISTS (SELECT 1 FROM dlq_records d WHERE d.request_id = {column})"  # nosec B608: SQL from code constants, values bound

    def at_retention_risk(self, limit_seconds: float, warn_before: float) -> list[DlqRecord]:
        """Unresolved records that a retention limit of ``limit_seconds`` (counted from the first
        failure: Dagster's run storage, the idempotency reaper) reaches within ``warn_before``."""
        cutoff = self.clock() - (limit_seconds - warn_before)
        return [
            r
            for r in self.list_records(status=["open", "replay_requested", "replaying"])
            if r.first_failed_at <= cutoff
        ]

    # -- internals --------------------------------------------------------------------------

    def _json(self, value: Any) -> str:
        """``value``'s JSON text (ASCII: escapes keep NUL and surrogates storable), or, past
        :attr:`json_limit` or without a JSON text, a small object that says what it was."""
        try:
            stored = to_text(value)
        except Exception:  # noqa: BLE001 - cycles, nesting past the recursion limit, bad keys
            stored = None
        if stored is not None and len(stored) <= self.json_limit:
            return stored
        described = digest(value, 1024)
        return to_text(
            {
                "sekali_truncated": True,
                "size": described.size,
                "sha256": described.sha256,
                "excerpt": described.excerpt,
            }
        )

    def _select(self, conn: Connection, where: str, params: dict[str, Any], *, lock: bool) -> Any:
        suffix = " FOR UPDATE" if lock and self.db.is_postgres else ""
        return conn.execute(
            text(f"SELECT {_COLUMNS} FROM dlq_records WHERE {where}{suffix}"), params  # nosec B608: SQL from code constants, values bound
        ).first()

    def _move(
        self,
        record_id: int,
        target: DlqStatus,
        *,
        actor: str,
        action: str,
        detail: str = "",
        sources: Sequence[str] | None = None,
        error_class: FailureClass | None = None,
    ) -> bool:
        now = self.clock()
        with self.db.transaction() as conn:
            before = self._select(conn, "id = :id", {"id": record_id}, lock=True)
            if before is None:
                raise DlqRecordNotFound(record_id)
            moved = conn.execute(
                text(
                    "UPDATE dlq_records SET status = :target, status_changed_at = :now,"
                    " error_class = COALESCE(:eclass, error_class),"
                    " updated_at = :now WHERE id = :id AND status IN :sources"
                ).bindparams(bindparam("sources", expanding=True)),
                {
                    "target": str(target),
                    "now": now,
                    "id": record_id,
                    "eclass": None if error_class is None else str(error_class),
                    "sources": list(sources) if sources is not None else sources_of(target),
                },
            ).rowcount
            if moved:
                self._audit(
                    conn,
                    record_id,
                    action,
                    actor,
                    DlqStatus(before._mapping["status"]),
                    target,
                    detail,
                    now,
                )
        return bool(moved)

    @staticmethod
    def _audit(
        conn: Connection,
        record_id: int,
        action: str,
        actor: str,
        from_status: DlqStatus | None,
        to_status: DlqStatus | None,
        detail: str | None,
        now: float,
    ) -> None:
        conn.execute(
            text(
                "INSERT INTO dlq_audit (record_id, action, actor, from_status, to_status, detail,"
                " at) VALUES (:rid, :action, :actor, :f, :t, :detail, :at)"
            ),
            {
                "rid": record_id,
                "action": action,
                "actor": storable(actor, _ID_BYTES),
                "f": None if from_status is None else str(from_status),
                "t": None if to_status is None else str(to_status),
                "detail": None if detail is None else storable(detail, _DETAIL_BYTES),
                "at": now,
            },
        )


_AGE = re.compile(r"(\d{1,12}(?:\.\d{1,9})?) ?([smhdw]?)")
_AGE_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_age(value: str | float | None) -> float | None:
    """``"90s"``, ``"15m"``, ``"2h"``, ``"3d"``, ``"1w"`` or seconds -> seconds."""
    if value is None or isinstance(value, (int, float)):
        return None if value is None else float(value)
    match = _AGE.fullmatch(value.strip()) if len(value) <= 64 else None  # bounded, then matched
    if not match:
        raise ValueError(f"age {value[:40]!r}: expected a number with s, m, h, d or w (e.g. 2h)")
    return float(match.group(1)) * _AGE_UNITS[match.group(2)]
