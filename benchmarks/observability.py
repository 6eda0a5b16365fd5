"""What a metrics snapshot and a doctor run cost, against the bare read of the same evidence.

The floor is the bare read of the evidence: one ``SELECT`` of the window's attempt rows,
fetched. The collector reads the per-minute aggregates written with each attempt instead, plus
the rows of the window's first partial minute and of the histogram bins that hold its
percentiles; the ratio ``collect / floor`` says what a whole snapshot (every source) costs
against that read. The doctor's ten checks are timed the same way. Rows are written in batches
through their owner (the recorder writes the rows and their aggregates), on SQLite (a file) and
Postgres (a schema made for the run, dropped after). Rounds alternate and the median is kept.

Run: ``python -m benchmarks.observability [--quick]``.
"""

from __future__ import annotations

import logging
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import text

from benchmarks.backends import BackendUnavailable, postgres_schema
from benchmarks.spread import REPETITIONS, Interleaved
from benchmarks.suite import module_main
from engine.attempts import Attempt, AttemptRecorder
from engine.health.diagnosis import DiagnosisSetup, diagnose
from engine.health.metrics import MetricsCollector
from resources.storage.db import Database
from resources.storage.migrations import upgrade

TARGET_RATIO = 2.0  # a snapshot may cost at most 2x the bare read of its rows
OUTCOMES = ["completed"] * 8 + ["duplicate_suppressed", "retried"]
JOB_TYPES = ["charge_payment", "send_email", "reserve_inventory", "fulfill_order"]


def _populate(db: Database, rows: int, now: float) -> None:
    """Write the attempts through their owner, the recorder (rows and aggregates), in batches."""
    rng = random.Random(1)
    recorder = AttemptRecorder(db)
    logging.getLogger("engine.attempts").setLevel(logging.ERROR)  # a line per attempt
    batch: list[tuple[Attempt, str, BaseException | None, str | None]] = []
    for i in range(rows):
        started = now - rng.uniform(0, 3000)
        duration = rng.lognormvariate(-1.0, 0.8)
        outcome = rng.choice(OUTCOMES)
        record = Attempt(
            job_type=rng.choice(JOB_TYPES), attempt=0 if outcome != "retried" else 1,
            started_at=started, idempotency_key=f"k{i % (rows // 2)}", claim_attempt=1,
            host="bench", pid=1, lock_wait_seconds=rng.uniform(0, 0.05), fence=1,
            takeover=rng.random() < 0.01, durations={"transaction": duration / 2},
            error_class="TransientJobError" if outcome == "retried" else None,
            correlation_id=f"c{i}",
        )
        batch.append((record, outcome, None, None))
        if len(batch) == 5000:
            _finish(recorder, batch)
            batch = []
    if batch:
        _finish(recorder, batch)


def _finish(
    recorder: AttemptRecorder, batch: list[tuple[Attempt, str, BaseException | None, str | None]]
) -> None:
    """Finish a batch with each attempt's own duration (the recorder stamps the end time)."""
    ends = iter([r.started_at + r.durations["transaction"] * 2 for r, *_ in batch])
    recorder.clock = lambda: next(ends)
    recorder.finish_many(batch)


def _median_ms(fn: Callable[[], Any], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def _measure(db: Database, rows: int, rounds: int) -> dict[str, Any]:
    now = time.time()
    _populate(db, rows, now)
    since = now - 3600

    def floor() -> int:
        with db.statement() as conn:
            return len(conn.execute(
                text("SELECT job_type, outcome, duration_seconds, lock_wait_seconds, takeover,"
                     " error_class, error_kind, attempt, started_at, ended_at"
                     " FROM job_attempts WHERE started_at >= :since"), {"since": since},
            ).all())

    collector = MetricsCollector(db, window_seconds=3600)
    setup = DiagnosisSetup(db=db, job_types={}, lease_seconds=60, window_seconds=3600)
    floor_ms, collect_ms, doctor_ms = [], [], []
    for _ in range(rounds):
        floor_ms.append(_median_ms(floor, 1))
        collect_ms.append(_median_ms(collector.collect, 1))
        doctor_ms.append(_median_ms(lambda: diagnose(setup), 1))
    f, c, d = (statistics.median(x) for x in (floor_ms, collect_ms, doctor_ms))
    collect = Interleaved(tuple(floor_ms), tuple(collect_ms)).ratio
    doctor = Interleaved(tuple(floor_ms), tuple(doctor_ms)).ratio
    return {"rows": rows, "floor_ms": round(f, 2), "collect_ms": round(c, 2),
            "doctor_ms": round(d, 2), "collect_ratio": round(collect.median, 2),
            "collect_ratio_spread": collect.as_dict(2),
            "doctor_ratio": round(doctor.median, 2)}


def run(quick: bool = False) -> dict[str, Any]:
    rows = 5_000 if quick else 50_000
    rounds = REPETITIONS if quick else REPETITIONS + 2
    results: dict[str, Any] = {"backends": {}}
    with tempfile.TemporaryDirectory() as tmp:
        db = Database.from_url(f"sqlite:///{tmp}/bench.db")
        upgrade(db)
        results["backends"]["sqlite"] = _measure(db, rows, rounds)
        db.dispose()
    try:
        with postgres_schema("bench_obs_") as url:
            db = Database.from_url(url)
            upgrade(db)
            results["backends"]["postgres"] = _measure(db, rows, rounds)
            db.dispose()
    except BackendUnavailable as exc:
        results["skipped"] = {"postgres": str(exc)}
    except Exception as exc:  # noqa: BLE001 - report, keep the SQLite numbers
        results["backends"]["postgres"] = {"error": f"{type(exc).__name__}: {exc}"}
    measured = {name: r for name, r in results["backends"].items() if "error" not in r}
    worse = max(measured.values(), key=lambda r: r["collect_ratio"], default=None)
    results["headline"] = {
        "metrics_snapshot_over_read": None if worse is None else worse["collect_ratio"],
        **{f"metrics_snapshot_over_read_{name}": r["collect_ratio"]
           for name, r in measured.items()},
    }
    results["headline_spread"] = {
        **({} if worse is None else {"metrics_snapshot_over_read": worse["collect_ratio_spread"]}),
        **{f"metrics_snapshot_over_read_{name}": r["collect_ratio_spread"]
           for name, r in measured.items()},
    }
    results["summary"] = [
        {"metric": f"metrics snapshot over {r['rows']} attempts ({name})",
         "value": r["collect_ms"], "unit": "ms", "baseline": r["floor_ms"],
         "ratio": r["collect_ratio"], "target": f"<= {TARGET_RATIO}x the bare read",
         "ok": r["collect_ratio"] <= TARGET_RATIO}
        for name, r in results["backends"].items() if "error" not in r
    ]
    return results


def render(result: dict[str, Any]) -> None:
    print(f"{'backend':<10} {'rows':>7} {'bare read':>10} {'snapshot':>10} {'ratio':>6} "
          f"{'doctor':>10} {'ratio':>6}")
    for name, r in result["backends"].items():
        if "error" in r:
            print(f"{name:<10} error: {r['error']}")
            continue
        print(f"{name:<10} {r['rows']:>7} {r['floor_ms']:>8.1f}ms {r['collect_ms']:>8.1f}ms "
              f"{r['collect_ratio']:>5.2f}x {r['doctor_ms']:>8.1f}ms {r['doctor_ratio']:>5.2f}x")
    print(f"target: snapshot <= {TARGET_RATIO}x the bare read of the same rows")



def main() -> None:
    module_main(__doc__, run, render)


if __name__ == "__main__":
    main()
