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
(:mod:`engine.privacy`).

Aggregates for the metrics: every write of an attempt row also updates ``job_attempt_rollups``
in the same transaction (one statement on Postgres): per minute of ``started_at`` and job type,
the count of attempts by outcome, retries by error class, takeovers, lock failures, and
histogram bins of the completed durations and of the lock waits. The row's previous contribution
is taken out and its new one added, so an attempt counts once, under its latest outcome. A
snapshot then sums a few aggregate rows per minute (:meth:`AttemptRecorder.totals`) and reads
raw rows only for the window's first partial minute and for the histogram bins that hold the
percentiles it reports (:meth:`AttemptRecorder.nearest_rank`): the same numbers as reading every
row, at a cost that does not grow with the window's attempts. Rows written by another version of
this module (a rolling upgrade) are not aggregated; :meth:`AttemptRecorder.rebuild_rollups`
recomputes the aggregates from the rows (``sekali db upgrade`` runs it when it adds the table).
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import os
import random
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from sqlalchemy import BigInteger, Column, Float, Integer, Table, Text, text

from resources.storage.db import Database, metadata
from resources.storage.driver import Sql, connect, transaction
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
    Column("send_bounds", Text),
)

job_attempt_rollups = Table(
    "job_attempt_rollups",
    metadata,
    Column("bucket", Float, primary_key=True),
    Column("job_type", Text, primary_key=True),
    Column("metric", Text, primary_key=True),
    Column("label", Text, primary_key=True),
    Column("bin", Integer, primary_key=True),
    Column("shard", Integer, primary_key=True),
    Column("n", BigInteger, nullable=False),
)

_FIELDS = [c.name for c in job_attempts.columns]
_Q = load_queries(Path(__file__).with_suffix(".sql"))

ROLLUPS_MIGRATION = "0090_attempt_rollups"
"""The ``sql/`` file that adds ``job_attempt_rollups``; aggregate older rows after applying it."""
ROLLUP_BUCKET_SECONDS = 60.0
ROLLUP_SHARDS = 4
HISTOGRAM_EDGES: tuple[float, ...] = tuple(1e-4 * 1.2**i for i in range(114))
"""Bin edges of the duration and lock-wait histograms: 100 microseconds to about a day, each bin
20% wider than the last. Bin ``b`` holds values in ``[EDGES[b-1], EDGES[b])``."""

RollupKey = tuple[str, str, int]
"""(metric, label, bin) of one aggregate an attempt contributes to."""


def histogram_bin(value: float) -> int:
    return bisect.bisect_right(HISTOGRAM_EDGES, value)


def bin_bounds(b: int) -> tuple[float, float]:
    """The values of bin ``b``: ``lo <= value < hi`` (the same floats in Python and SQL)."""
    lo = HISTOGRAM_EDGES[b - 1] if b > 0 else -math.inf
    hi = HISTOGRAM_EDGES[b] if b < len(HISTOGRAM_EDGES) else math.inf
    return lo, hi


def nearest_rank(q: float, n: int) -> int:
    """The 1-based rank of the ``q`` quantile of ``n`` values under the nearest-rank rule."""
    return min(max(1, math.ceil(q * n)), n)


def contribution(
    outcome: str,
    error_class: str | None,
    takeover: bool | int,
    lock_wait_seconds: float | None,
    duration_seconds: float | None,
) -> dict[RollupKey, int]:
    """What one attempt row adds to its minute's aggregates."""
    out: dict[RollupKey, int] = {("outcome", outcome, 0): 1}
    if outcome == Outcome.RETRIED:
        out["retry", error_class or "unknown", 0] = 1
    if takeover:
        out["takeover", "", 0] = 1
    if error_class == "LockNotAcquired":
        out["lock_failed", "", 0] = 1
    if lock_wait_seconds is not None:
        out["lock_wait", "", histogram_bin(float(lock_wait_seconds))] = 1
    if outcome == Outcome.COMPLETED and duration_seconds is not None:
        out["duration", "", histogram_bin(float(duration_seconds))] = 1
    if outcome == Outcome.LEASE_LOST and duration_seconds is not None:
        # the work needed at least this long: what a lease sized from durations must see
        out["duration", LEASE_LOST_LABEL, histogram_bin(float(duration_seconds))] = 1
    return out


LEASE_LOST_LABEL = "lease_lost"
"""The ``duration`` bins of attempts that lost their lease (label ``""``: completed ones)."""


def bucket_of(started_at: float) -> float:
    return math.floor(started_at / ROLLUP_BUCKET_SECONDS) * ROLLUP_BUCKET_SECONDS


_COLUMNS = {
    "fields": ", ".join(_FIELDS),
    "params": ", ".join(":" + c for c in _FIELDS),
    "upsert": ", ".join(f"{c} = excluded.{c}" for c in _FIELDS if c != "attempt_id"),
}
"""The table's columns as the templated statements of attempts.sql take them."""
_WRITE_PG = Sql(_Q["write_postgres"].format(**_COLUMNS))
_WRITE_ROW_SQLITE = Sql(_Q["write_row"].format(**_COLUMNS))
_WRITE_ROLLUP_SQLITE = Sql(_Q["write_rollup"])


def _write_postgres(db: Database, rows: list[dict[str, Any]],
                    rollups: list[dict[str, Any]]) -> None:
    with connect(db) as conn:
        conn.run(_WRITE_PG, {"rows": json.dumps(rows), "deltas": json.dumps(rollups)})


def _write_sqlite(db: Database, rows: list[dict[str, Any]],
                  rollups: list[dict[str, Any]]) -> None:
    with transaction(db) as conn:
        cursor = conn.raw.cursor()
        try:
            cursor.executemany(_WRITE_ROW_SQLITE.text, rows)
            cursor.executemany(_WRITE_ROLLUP_SQLITE.text, rollups)
        finally:
            cursor.close()


_WRITERS = {"postgresql": _write_postgres, "sqlite": _write_sqlite}
"""The rows and their aggregates in one transaction, each dialect its fastest way."""

_shard = threading.local()


def _my_shard() -> int:
    """A shard per thread: concurrent writers of one minute's counters take different rows."""
    shard = getattr(_shard, "value", None)
    if shard is None:
        shard = _shard.value = random.randrange(ROLLUP_SHARDS)
    return int(shard)


@dataclass
class AttemptTotals:
    """The window's aggregates: ``counts[(job_type, metric, label, bin)]``."""

    since: float
    counts: Counter[tuple[str, str, str, int]]

    def by(self, metric: str) -> Counter[tuple[str, str]]:
        """``{(job_type, label): n}`` of one metric (bins summed)."""
        out: Counter[tuple[str, str]] = Counter()
        for (job_type, m, label, _), n in self.counts.items():
            if m == metric and n:
                out[job_type, label] += n
        return out

    def histogram(
        self, metric: str, job_type: str | None = None, label: str = ""
    ) -> dict[int, int]:
        """``{bin: n}`` of a histogram metric, of one job type or of all (``label`` ``""``:
        completed attempts' durations; :data:`LEASE_LOST_LABEL`: those that lost their lease)."""
        out: Counter[int] = Counter()
        for (jt, m, lb, b), n in self.counts.items():
            if m == metric and lb == label and (job_type is None or jt == job_type) and n:
                out[b] += n
        return dict(out)


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
    send_bounds: list[tuple[float, float]] = field(default_factory=list)
    """Each lease confirmation before a downstream call: ``(asked, bound)`` on this process's
    wall clock, ``bound`` the send bound it granted (:meth:`JobContext.confirm_lease`). The
    evidence that every effect left under a confirmed lease (``sekali chaos``)."""
    stored: bool = field(default=False, repr=False)
    personal: tuple[str, ...] = field(default=(), repr=False)  # values masked in errors and logs
    rolled: dict[RollupKey, int] = field(default_factory=dict, repr=False, compare=False)

    def add_send_bound(self, asked: float, bound: float) -> None:
        """Note a lease confirmation (wall clock): see :attr:`send_bounds`."""
        self.send_bounds.append((round(asked, 6), round(bound, 6)))

    def add_duration(self, name: str, seconds: float) -> None:
        """Accumulate a critical step's duration (``lock``, ``gateway``, ``commit`` ...)."""
        self.durations[name] = round(self.durations.get(name, 0.0) + seconds, 6)

    def row(self) -> dict[str, Any]:
        values = {k: getattr(self, k) for k in _FIELDS}  # no deep copy: every value is written
        values["durations"] = json.dumps(self.durations, sort_keys=True)
        values["send_bounds"] = json.dumps(self.send_bounds) if self.send_bounds else None
        values["takeover"] = int(self.takeover)
        values["outcome"] = str(self.outcome)
        return values

    def log_fields(self) -> dict[str, Any]:
        values = self.row()
        values["durations"] = self.durations
        values["send_bounds"] = self.send_bounds
        return values

    def contribution(self) -> dict[RollupKey, int]:
        return contribution(
            str(self.outcome),
            self.error_class,
            self.takeover,
            self.lock_wait_seconds,
            self.duration_seconds,
        )


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
        self._write([record])
        return record

    def start_many(self, records: Sequence[Attempt]) -> None:
        """:meth:`start` for a batch: one statement on Postgres, one transaction on SQLite."""
        self._write(records)

    def finish(
        self,
        record: Attempt,
        outcome: Outcome | str,
        *,
        error: BaseException | None = None,
        error_kind: str | None = None,
    ) -> Attempt:
        """Store how the attempt ended and log one structured line with every field."""
        self._end(record, outcome, error, error_kind)
        self._write([record])
        self._log(record)
        return record

    def finish_many(
        self, ends: Sequence[tuple[Attempt, Outcome | str, BaseException | None, str | None]]
    ) -> None:
        """:meth:`finish` for a batch of ``(record, outcome, error, error_kind)``, written
        together (one statement on Postgres, one transaction on SQLite)."""
        for record, outcome, error, error_kind in ends:
            self._end(record, outcome, error, error_kind)
        self._write([record for record, *_ in ends])
        for record, *_ in ends:
            self._log(record)

    def _end(
        self,
        record: Attempt,
        outcome: Outcome | str,
        error: BaseException | None,
        error_kind: str | None,
    ) -> None:
        record.outcome = Outcome(outcome)
        record.ended_at = self.clock()
        record.duration_seconds = round(record.ended_at - record.started_at, 6)
        if error is not None:
            record.error_class = type(error).__name__
            record.error_reason = redact(str(error), record.personal)[:2000]
            record.error_kind = error_kind

    @staticmethod
    def _log(record: Attempt) -> None:
        level = logging.INFO if record.outcome in _QUIET else logging.WARNING
        if not logger.isEnabledFor(level):
            return
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

    def relabel(self, record: Attempt, outcome: Outcome | str) -> None:
        """Change the final outcome once the retry decision is known (retried -> dead_lettered)."""
        record.outcome = Outcome(outcome)
        self._write([record])

    def _write(self, records: Sequence[Attempt]) -> None:
        """Upsert the rows and move their aggregates from what they contributed when last
        written to what they contribute now, in one transaction. Never raises: logged."""
        if not records:
            return
        shard = _my_shard()
        rows = [record.row() for record in records]
        news = [record.contribution() for record in records]
        deltas: Counter[tuple[float, str, str, str, int]] = Counter()
        for record, new in zip(records, news, strict=True):
            bucket = bucket_of(record.started_at)
            for key in new.keys() | record.rolled.keys():
                delta = new.get(key, 0) - record.rolled.get(key, 0)
                if delta:
                    deltas[(bucket, record.job_type, *key)] += delta
        rollups = [
            {"bucket": b, "job_type": jt, "metric": m, "label": label, "bin": bin_,
             "shard": shard, "n": n}
            for (b, jt, m, label, bin_), n in sorted(deltas.items()) if n
        ]
        try:
            _WRITERS[self.db.sql_dialect.name](self.db, rows, rollups)
        except Exception:  # noqa: BLE001 - recording must not fail the job
            logger.exception(
                "could not record attempt(s) %s", ", ".join(r.attempt_id for r in records)
            )
            return
        for record, new in zip(records, news, strict=True):
            record.stored = True
            record.rolled = new

    # -- the metrics' aggregates ------------------------------------------------------------

    def totals(self, since: float) -> AttemptTotals:
        """Aggregates of every attempt started at or after ``since``: the per-minute rollups
        from the first whole minute on, plus the rows of the partial minute before it."""
        boundary = math.ceil(since / ROLLUP_BUCKET_SECONDS) * ROLLUP_BUCKET_SECONDS
        counts: Counter[tuple[str, str, str, int]] = Counter()
        with self.db.statement() as conn:
            for r in conn.execute(text(_Q["rollup_totals"]), {"from_bucket": boundary}):
                counts[(r.job_type, r.metric, r.label, int(r.bin))] += int(r.n)
            head = conn.execute(
                text(_Q["contributions_between"]), {"since": since, "until": boundary}
            ).all()
        for r in head:
            for (m, label, b), n in contribution(
                r.outcome, r.error_class, r.takeover, r.lock_wait_seconds, r.duration_seconds
            ).items():
                counts[(r.job_type, m, label, b)] += n
        return AttemptTotals(since, counts)

    def duration_bins(self, since: float) -> dict[str, dict[int, int]]:
        """``{job_type: {bin: n}}`` of the durations in the whole minutes from ``since`` on
        (:mod:`engine.durations`), of completed attempts and of those that lost their lease
        (their work needed at least that long): a bounded read of the aggregates."""
        boundary = math.ceil(since / ROLLUP_BUCKET_SECONDS) * ROLLUP_BUCKET_SECONDS
        out: dict[str, dict[int, int]] = {}
        with self.db.statement() as conn:
            for r in conn.execute(text(_Q["duration_bins"]), {"from_bucket": boundary}):
                if int(r.n) > 0:
                    out.setdefault(r.job_type, {})[int(r.bin)] = int(r.n)
        return out

    def nearest_rank(
        self,
        totals: AttemptTotals,
        metric: str,
        quantiles: Sequence[float],
        job_types: Sequence[str | None] = (None,),
    ) -> dict[str | None, list[float]]:
        """The exact nearest-rank quantiles of ``duration`` (completed attempts, per job type)
        or ``lock_wait`` (every attempt; job type None) in the totals' window.

        The histogram says which bin holds each rank and how many values lie below it; only the
        rows of those bins are read (one query for every job type and quantile), and the value
        is picked among them. NaN without data.
        """
        wanted: dict[tuple[str | None, int], list[tuple[int, int]]] = {}
        out: dict[str | None, list[float]] = {}
        for job_type in job_types:
            out[job_type] = [math.nan] * len(quantiles)
            hist = totals.histogram(metric, job_type)
            n = sum(hist.values())
            for i, q in enumerate(quantiles if n else ()):
                rank, below = nearest_rank(q, n), 0
                for b in sorted(hist):
                    if below + hist[b] >= rank:
                        wanted.setdefault((job_type, b), []).append((i, rank - below))
                        break
                    below += hist[b]
        if not wanted:
            return out
        column = "duration_seconds" if metric == "duration" else "lock_wait_seconds"
        params: dict[str, Any] = {"since": totals.since}
        bins: list[str] = []
        picks: list[str] = []
        slots: list[tuple[str | None, int, int, int]] = []
        for n, ((job_type, b), ranks) in enumerate(wanted.items()):
            params[f"lo{n}"], params[f"hi{n}"] = bin_bounds(b)
            when = f"{column} >= :lo{n} AND {column} < :hi{n}"
            if metric == "duration":
                params[f"j{n}"] = job_type
                when = f"job_type = :j{n} AND {when}"
            bins.append(f"WHEN {when} THEN {n}")
            for i, rank in ranks:
                params[f"r{len(slots)}"] = rank
                # the bin can hold fewer rows than its aggregate says while attempts are written
                picks.append(f"(k = {n} AND rn = CASE WHEN cnt < :r{len(slots)} THEN cnt"
                             f" ELSE :r{len(slots)} END)")
                slots.append((job_type, i, n, rank))
        query = _Q["ranked_in_bins"].format(
            value=column,
            rows="outcome = 'completed'" if metric == "duration" else f"{column} IS NOT NULL",
            bins=" ".join(bins),
            picks=" OR ".join(picks),
        )
        with self.db.statement() as conn:
            found = {(int(k), int(rn)): float(v) for k, rn, v in conn.execute(text(query), params)}
        last = {k: rn for k, rn in sorted(found)}
        for job_type, i, n, rank in slots:
            value = found.get((n, min(rank, last.get(n, rank))))
            if value is not None:
                out[job_type][i] = value
        return out

    def rebuild_rollups(self) -> int:
        """Recompute every aggregate from the rows (after the table is added to a database that
        has attempts, or to repair it). Returns the number of attempts aggregated."""
        counts: Counter[tuple[float, str, str, str, int]] = Counter()
        with self.db.statement() as conn:
            rows = conn.execute(text(_Q["all_contributions"])).all()
        for r in rows:
            for (m, label, b), n in contribution(
                r.outcome, r.error_class, r.takeover, r.lock_wait_seconds, r.duration_seconds
            ).items():
                counts[(bucket_of(r.started_at), r.job_type, m, label, b)] += n
        with self.db.transaction() as conn:
            conn.execute(job_attempt_rollups.delete())
            if counts:
                conn.execute(
                    job_attempt_rollups.insert(),
                    [
                        {"bucket": b, "job_type": jt, "metric": m, "label": label, "bin": bin_,
                         "shard": 0, "n": n}
                        for (b, jt, m, label, bin_), n in counts.items()
                    ],
                )
        return len(rows)

    def for_key(self, key: str) -> list[dict[str, Any]]:
        """Every attempt of one key, oldest first (for tests, the CLI and the doctor)."""
        with self.db.statement() as conn:
            rows = conn.execute(
                text(_Q["for_key"].format(**_COLUMNS)), {"key": key}
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
            _Q["expired"],
            {"cutoff": self.clock() - older_than},
            keep=keep,
        )

    def all(self, job_type: str | None = None) -> list[dict[str, Any]]:
        query, params = (("all_of_type", {"jt": job_type}) if job_type else
                         ("all_attempts", {}))
        with self.db.statement() as conn:
            rows = conn.execute(text(_Q[query].format(**_COLUMNS)), params).all()
        return [_decode(dict(r._mapping)) for r in rows]


_QUIET = {Outcome.COMPLETED, Outcome.DUPLICATE_SUPPRESSED}


def _decode(row: dict[str, Any]) -> dict[str, Any]:
    row["durations"] = json.loads(row["durations"]) if row["durations"] else {}
    row["takeover"] = bool(row["takeover"])
    return row
