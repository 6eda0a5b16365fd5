"""The per-minute aggregates behind the metrics give the numbers a scan of every attempt gives.

Random workloads write attempts through the real recorder (started then finished, finished
without a start, relabelled after the retry decision, left at ``started`` by a dead worker,
single and batched), spread over three hours so the window's edge cuts a minute in two. The
snapshot's attempt metrics must then equal what the rows say, computed here the old way (every
row of the window, nearest-rank percentiles), on SQLite and Postgres; and rebuilding the
aggregates from the rows must not change a number.
"""

from __future__ import annotations

import math
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from cli import main as cli
from engine.attempts import ROLLUPS_MIGRATION, Attempt, AttemptRecorder, Outcome, job_attempts
from engine.health.metrics import QUANTILES, MetricsCollector, MetricsSnapshot
from resources.storage.db import Database
from resources.storage.migrations import sql_dir, upgrade
from tests.metrics_support import FakeClock

NOW = 1_800_000_000.0
WINDOW = 3600.0
FINAL = [o for o in Outcome if o is not Outcome.STARTED]

attempt_script = st.fixed_dictionaries(
    {
        "age": st.floats(0, 3 * WINDOW),  # seconds before NOW
        "job_type": st.sampled_from(["a", "b"]),
        "outcome": st.sampled_from(FINAL),
        "relabel": st.none() | st.sampled_from(FINAL),
        "error_class": st.sampled_from([None, "TransientJobError", "LockNotAcquired"]),
        "takeover": st.booleans(),
        "lock_wait": st.none() | st.floats(0, 2),
        "duration": st.floats(0, 30),
        "path": st.sampled_from(["start_finish", "finish_only", "start_only", "batch"]),
    }
)


class _Error(Exception):
    pass


def _write(recorder: AttemptRecorder, clock: FakeClock, scripts: list[dict[str, Any]]) -> None:
    batch: list[tuple[Attempt, dict[str, Any]]] = []
    for s in scripts:
        record = Attempt(job_type=s["job_type"], attempt=0, started_at=NOW - s["age"])
        record.takeover = s["takeover"]
        error = None
        if s["error_class"] is not None:
            error = type(s["error_class"], (_Error,), {})("boom")
        if s["path"] in ("start_finish", "start_only", "batch"):
            recorder.start(record)
        if s["path"] == "start_only":
            continue  # a worker that died mid-attempt
        record.lock_wait_seconds = s["lock_wait"]
        clock.now = record.started_at + s["duration"]
        if s["path"] == "batch":
            batch.append((record, s))
            continue
        recorder.finish(record, s["outcome"], error=error, error_kind="transient")
        if s["relabel"] is not None:
            recorder.relabel(record, s["relabel"])
    if batch:
        for record, s in batch:
            clock.now = record.started_at + s["duration"]
            if s["error_class"] is not None:
                record.error_class = s["error_class"]
        recorder.finish_many([(record, s["outcome"], None, None) for record, s in batch])


def _expected(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The attempt metrics from every row of the window, as the snapshot once computed them."""
    rows = [r for r in rows if r["started_at"] >= NOW - WINDOW]
    outcomes = Counter((r["job_type"], r["outcome"]) for r in rows)
    durations: dict[str, list[float]] = {}
    for r in rows:
        if r["outcome"] == "completed" and r["duration_seconds"] is not None:
            durations.setdefault(r["job_type"], []).append(r["duration_seconds"])
    waits = [r["lock_wait_seconds"] for r in rows if r["lock_wait_seconds"] is not None]
    return {
        "outcomes": outcomes,
        "durations": durations,
        "retries": Counter(
            r["error_class"] or "unknown" for r in rows if r["outcome"] == "retried"
        ),
        "takeovers": sum(1 for r in rows if r["takeover"]),
        "rows": len(rows),
        "waits": waits,
        "lock_failed": sum(1 for r in rows if r["error_class"] == "LockNotAcquired"),
    }


def _rank(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


def _same(got: float | None, want: float) -> bool:
    assert got is not None
    return (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, abs=1e-9)


def _check(snap: MetricsSnapshot, want: dict[str, Any]) -> None:
    for (job_type, outcome), n in want["outcomes"].items():
        assert snap.get("sekali_attempts", job_type=job_type, outcome=outcome) == n
    assert sum(s.value for s in snap.samples if s.name == "sekali_attempts") == want["rows"]
    for job_type in {jt for jt, _ in want["outcomes"]}:
        values = want["durations"].get(job_type, [])
        for q in QUANTILES:
            got = snap.get("sekali_processing_seconds", job_type=job_type, quantile=str(q))
            assert _same(got, _rank(values, q)), (job_type, q, got, sorted(values))
        assert snap.get("sekali_processing_seconds_count", job_type=job_type) == len(values)
    for reason, n in want["retries"].items():
        assert snap.get("sekali_retries", reason=reason) == n
    assert snap.get("sekali_retries_total") == sum(want["retries"].values())
    assert snap.get("sekali_lease_takeovers") == want["takeovers"]
    assert snap.get("sekali_lock_acquired") == len(want["waits"])
    assert snap.get("sekali_lock_failed") == want["lock_failed"]
    for q in QUANTILES:
        got = snap.get("sekali_lock_wait_seconds", quantile=str(q))
        assert _same(got, _rank(want["waits"], q)), (q, got)


def test_snapshot_from_aggregates_equals_a_scan_of_the_rows(db: Database) -> None:
    """Catches an aggregate that drifts from its rows: an outcome counted twice after a relabel,
    a batch write that skips the aggregates, a bin edge that Python and SQL place differently,
    or the window's partial first minute counted from the wrong source."""
    clock = FakeClock(NOW)
    recorder = AttemptRecorder(db, clock=clock)

    @settings(
        max_examples=25,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(scripts=st.lists(attempt_script, min_size=1, max_size=25))
    def check(scripts: list[dict[str, Any]]) -> None:
        with db.transaction() as conn:
            conn.execute(text("DELETE FROM job_attempts"))
            conn.execute(text("DELETE FROM job_attempt_rollups"))
        _write(recorder, clock, scripts)
        clock.now = NOW
        want = _expected(recorder.all())
        collector = MetricsCollector(db, window_seconds=WINDOW, clock=lambda: NOW)
        _check(collector.collect(), want)
        assert recorder.rebuild_rollups() == len(scripts)
        _check(collector.collect(), want)

    check()


def test_db_upgrade_aggregates_attempts_written_before_the_table(
    sqlite_url: str, tmp_path: Path
) -> None:
    """Catches a deployment whose metrics undercount after the upgrade: attempts written by the
    previous version (no aggregates table yet) are aggregated by ``sekali db upgrade``."""
    older = tmp_path / "sql"
    older.mkdir()
    for path in sql_dir().glob("*.sql"):
        if not path.name.startswith(ROLLUPS_MIGRATION):
            shutil.copy(path, older / path.name)
    db = Database.from_url(sqlite_url)
    upgrade(db, older)
    rows = []
    for i in range(5):
        record = Attempt("a", 0, NOW - 60 * i, outcome=Outcome.COMPLETED)
        record.duration_seconds = 0.1 * (i + 1)
        rows.append(record.row())
    with db.transaction() as conn:
        conn.execute(job_attempts.insert(), rows)
    assert cli.main(["db", "upgrade", "--url", sqlite_url]) == 0
    snap = MetricsCollector(db, window_seconds=WINDOW, clock=lambda: NOW).collect()
    assert snap.get("sekali_jobs_executed") == 5
    assert snap.get("sekali_processing_seconds", job_type="a", quantile="0.5") == 0.1 * 3
