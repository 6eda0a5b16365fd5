"""Per-attempt records: the evidence behind invariant 6 and the metrics.

Each attempt of a job request is a row in ``job_attempts``. ``new`` makes the record in memory;
``start`` inserts it with outcome ``started`` once the attempt holds its claim (key, fence and
takeover known), before the side effect; ``finish`` fills in the end time, the outcome and the
status before and after the side effect (inserting the row if it was never started, as for a
duplicate or an attempt refused before its claim). A worker killed in between leaves its
row at ``started`` with no ``ended_at``; the attempt that takes over carries ``takeover = 1``.
So a reader can tell a real duplicate effect (two ``completed`` rows with the same key: never)
from a duplicate log line (one ``completed`` and several ``duplicate_suppressed``).

One structured log line per finished attempt carries the same fields (``extra={"sekali": ...}``),
with e-mail addresses and the payload's personal values masked, as in ``error_reason``
(:mod:`pipelines.privacy`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from sqlalchemy import BigInteger, Column, Float, Integer, Table, Text, text

from resources.storage.db import Database, metadata
from resources.storage.queries import load_queries
from resources.storage.retention import Expiry
from resources.telemetry.redact import redact, redact_data

logger = logging.getLogger(__name__)


class Outcome(StrEnum):
    """How an attempt ended. ``started`` is the only non-final value (or a dead worker)."""

    STARTED = "started"
    COMPLETED = "completed"
    DUPLICATE_SUPPRESSED = "duplicate_suppressed"
    RETRIED = "retried"
    FAILED_PERMANENT = "failed_permanent"
    DEAD_LETTERED = "dead_lettered"
    LEASE_LOST = "lease_lost"
    IN_PROGRESS_ELSEWHERE = "in_progress_elsewhere"


job_attempts = Table(
    "job_attempts",
    metadata,
    Column("attempt_id", Text, primary_key=True),
    Column("job_type", Text, nullable=False),
    Column("idempotency_key", Text),
    Column("resource_id", Text),
    Column("run_id", Text),
    Column("step", Text),
    Column("attempt", Integer, nullable=False),
    Column("claim_attempt", Integer),
    Column("host", Text, nullable=False),
    Column("pid", Integer, nullable=False),
    Column("started_at", Float, nullable=False),
    Column("ended_at", Float),
    Column("duration_seconds", Float),
    Column("lock_wait_seconds", Float),
    Column("fence", BigInteger),
    Column("takeover", Integer, nullable=False),
    Column("durations", Text),
    Column("outcome", Text, nullable=False),
    Column("error_class", Text),
    Column("error_kind", Text),
    Column("error_reason", Text),
    Column("status_before", Text),
    Column("status_after", Text),
    Column("correlation_id", Text),
    Column("request_id", BigInteger),
    Column("traceparent", Text),
)

_FIELDS = [c.name for c in job_attempts.columns]
_Q = load_queries(Path(__file__).with_suffix(".sql"))


@dataclass
class Attempt:
    """One attempt as it runs. The runtime fills it in; ``AttemptRecorder.finish`` stores it."""

    job_type: str
    attempt: int
    started_at: float
    attempt_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    idempotency_key: str | None = None
    resource_id: str | None = None
    run_id: str | None = None
    step: str | None = None
    claim_attempt: int | None = None
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    ended_at: float | None = None
    duration_seconds: float | None = None
    lock_wait_seconds: float | None = None
    fence: int | None = None
    takeover: bool = False
    durations: dict[str, float] = field(default_factory=dict)
    outcome: Outcome = Outcome.STARTED
    error_class: str | None = None
    error_kind: str | None = None
    error_reason: str | None = None
    status_before: str | None = None
    status_after: str | None = None
    correlation_id: str | None = None
    request_id: int | None = None
    traceparent: str | None = None
    stored: bool = field(default=False, repr=False)
    personal: tuple[str, ...] = field(default=(), repr=False)  # values masked in errors and logs

    def add_duration(self, name: str, seconds: float) -> None:
        """Accumulate a critical step's duration (``lock``, ``gateway``, ``commit`` ...)."""
        self.durations[name] = round(self.durations.get(name, 0.0) + seconds, 6)

    def row(self) -> dict[str, Any]:
        values = asdict(self)
        values.pop("stored")
        values.pop("personal")
        values["durations"] = json.dumps(self.durations, sort_keys=True)
        values["takeover"] = int(self.takeover)
        values["outcome"] = str(self.outcome)
        return {k: values[k] for k in _FIELDS}

    def log_fields(self) -> dict[str, Any]:
        values = self.row()
        values["durations"] = self.durations
        return values


class AttemptRecorder:
    """Writes attempt rows. A failure to record never hides the job's own outcome: it is logged."""

    def __init__(self, db: Database, *, clock: Callable[[], float] = time.time) -> None:
        self.db = db
        self.clock = clock

    def new(self, job_type: str, *, attempt: int = 0, **fields: Any) -> Attempt:
        """A record in memory, started now; nothing is written yet."""
        return Attempt(job_type=job_type, attempt=attempt, started_at=self.clock(), **fields)

    def start(self, record: Attempt) -> Attempt:
        """Insert the record with outcome ``started``: a worker that dies now leaves it so."""
        self._insert(record)
        return record

    def _insert(self, record: Attempt) -> None:
        cols = ", ".join(_FIELDS)
        params = ", ".join(f":{c}" for c in _FIELDS)
        try:
            with self.db.statement() as conn:
                conn.execute(
                    text(f"INSERT INTO job_attempts ({cols}) VALUES ({params})"), record.row()
                )
            record.stored = True
        except Exception:  # noqa: BLE001 - recording must not fail the job
            logger.exception("could not record attempt %s", record.attempt_id)

    def finish(
        self,
        record: Attempt,
        outcome: Outcome | str,
        *,
        error: BaseException | None = None,
        error_kind: str | None = None,
    ) -> Attempt:
        """Store how the attempt ended and log one structured line with every field."""
        record.outcome = Outcome(outcome)
        record.ended_at = self.clock()
        record.duration_seconds = round(record.ended_at - record.started_at, 6)
        if error is not None:
            record.error_class = type(error).__name__
            record.error_reason = redact(str(error), record.personal)[:2000]
            record.error_kind = error_kind
        self._update(record)
        level = logging.INFO if record.outcome in _QUIET else logging.WARNING
        logger.log(
            level,
            "attempt %s %s key=%s outcome=%s %s->%s fence=%s",
            record.job_type,
            record.attempt_id,
            redact(str(record.idempotency_key), record.personal),
            record.outcome,
            record.status_before,
            record.status_after,
            record.fence,
            extra={"sekali": redact_data(record.log_fields(), record.personal)},
        )
        return record

    def relabel(self, record: Attempt, outcome: Outcome | str) -> None:
        """Change the final outcome once the retry decision is known (retried -> dead_lettered)."""
        record.outcome = Outcome(outcome)
        self._update(record)

    def _update(self, record: Attempt) -> None:
        if not record.stored:
            self._insert(record)
            return
        row = record.row()
        sets = ", ".join(f"{c} = :{c}" for c in _FIELDS if c != "attempt_id")
        try:
            with self.db.statement() as conn:
                conn.execute(
                    text(f"UPDATE job_attempts SET {sets} WHERE attempt_id = :attempt_id"), row
                )
        except Exception:  # noqa: BLE001 - recording must not fail the job
            logger.exception("could not record the end of attempt %s", record.attempt_id)

    def for_key(self, key: str) -> list[dict[str, Any]]:
        """Every attempt of one key, oldest first (for tests, the CLI and the doctor)."""
        with self.db.statement() as conn:
            rows = conn.execute(
                text(
                    f"SELECT {', '.join(_FIELDS)} FROM job_attempts"
                    " WHERE idempotency_key = :key ORDER BY started_at, attempt"
                ),
                {"key": key},
            ).all()
        return [_decode(dict(r._mapping)) for r in rows]

    def recent(self, since: float, limit: int) -> list[dict[str, Any]]:
        """The newest ``limit`` attempts started since ``since`` (the metrics window)."""
        with self.db.statement() as conn:
            rows = conn.execute(text(_Q["recent"]), {"since": since, "limit": limit}).all()
        return [dict(r._mapping) for r in rows]

    def since(self, since: float) -> list[dict[str, Any]]:
        """Every attempt started since ``since``, oldest first, ``durations`` decoded."""
        with self.db.statement() as conn:
            rows = conn.execute(text(_Q["since"]), {"since": since}).all()
        out = []
        for r in rows:
            row = dict(r._mapping)
            row["durations"] = json.loads(row["durations"]) if row["durations"] else {}
            out.append(row)
        return out

    def latest_for_key(self, key: str) -> dict[str, Any] | None:
        """``job_type`` and ``run_id`` of the newest attempt of ``key``."""
        with self.db.statement() as conn:
            row = conn.execute(text(_Q["latest_for_key"]), {"key": key}).first()
        return None if row is None else dict(row._mapping)

    def effect_traceparent(self, key: str) -> str | None:
        """The trace context of the attempt that completed ``key`` (a duplicate links to it)."""
        with self.db.statement() as conn:
            return conn.execute(text(_Q["effect_traceparent"]), {"key": key}).scalar()

    def effect_run(self, key: str) -> str | None:
        """The run id of the attempt that made ``key``'s effect, if a run made it."""
        with self.db.statement() as conn:
            value = conn.execute(text(_Q["effect_run"]), {"key": key}).scalar()
        return None if value is None else str(value)

    def first_started(self, run_id: str, step: str) -> float | None:
        """When the first attempt of ``step`` in ``run_id`` began, if any was recorded."""
        with self.db.statement() as conn:
            value = conn.execute(text(_Q["first_started"]), {"run": run_id, "step": step}).scalar()
        return None if value is None else float(value)

    def expired(self, older_than: float, *, keep: Sequence[str] = ()) -> Expiry:
        """Attempts started more than ``older_than`` seconds ago, except those a ``keep``
        condition over ``job_attempts`` holds (the attempts of a request or key still
        unresolved: the evidence an operator reads before replaying). Purge with
        ``.purge(db)``, count with ``.count(db)``."""
        return Expiry.of(
            "job_attempts",
            "attempt_id",
            "started_at <= :cutoff",
            {"cutoff": self.clock() - older_than},
            keep=keep,
        )

    def all(self, job_type: str | None = None) -> list[dict[str, Any]]:
        where, params = ("WHERE job_type = :jt", {"jt": job_type}) if job_type else ("", {})
        with self.db.statement() as conn:
            rows = conn.execute(
                text(f"SELECT {', '.join(_FIELDS)} FROM job_attempts {where} ORDER BY started_at"),
                params,
            ).all()
        return [_decode(dict(r._mapping)) for r in rows]


_QUIET = {Outcome.COMPLETED, Outcome.DUPLICATE_SUPPRESSED}


def _decode(row: dict[str, Any]) -> dict[str, Any]:
    row["durations"] = json.loads(row["durations"]) if row["durations"] else {}
    row["takeover"] = bool(row["takeover"])
    return row
