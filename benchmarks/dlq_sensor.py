"""One DLQ replay-sensor tick at 10k, 100k and 500k open records, on SQLite and Postgres.

The records are bulk-inserted (open, as the run-failure sensor writes them: payload, run
config, a trace of about 1 KiB), then the real ``dlq_replay_sensor`` of the code location (with
the ``dead_letters`` publication) is evaluated against a Dagster instance: the first tick
publishes the asset (a grouped count and the oldest rows), the next ticks find the store
unchanged; then one record changes and the tick after publishes again. Reported per size: the
median tick time and the peak of Python memory (``tracemalloc``) of the steady ticks and of the
publishing tick, and how flat they are: the ratio of 500k to 10k (what the work per tick grows
with the number of open records; before paging, a tick listed every unresolved record: 7-8 s and
+465 MiB at 50,000). The baseline in the same run: listing every open record at 10k, what the
old tick did at least twice.

Run: ``python -m benchmarks.dlq_sensor [--quick]`` or ``sekali bench --only dlq_sensor``
(``--quick``: 1k, 5k, 20k, three ticks each: the ratio of 20k to 1k still shows a tick that
grows with the records, 20x of them; a tick at these sizes takes some ms, so one descheduling
moves a quick ratio by 0.2-0.5 on a loaded machine).
"""

from __future__ import annotations

import json
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import dagster as dg
from sqlalchemy import text

from benchmarks.intake import each_backend
from benchmarks.suite import module_main
from pipelines.assets import dead_letters
from resources.dagster_resources import DlqResource
from resources.dlq import DlqStore
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from sensors.dlq import build_dlq_replay_sensor

SIZES = (10_000, 100_000, 500_000)
QUICK_SIZES = (1_000, 5_000, 20_000)
TARGET_RATIO = 2.0  # a tick at the largest size at most twice as long as at the smallest
CHUNK = 5_000
TRACE = "Traceback (most recent call last):\n" + "  File \"x.py\", line 1, in f\n" * 30


def fill_open_records(db: Database, start: int, n: int) -> None:
    """``n`` more open records after the ``start`` already there, ``CHUNK`` per statement."""
    payload = json.dumps({"order_id": "o", "amount_cents": 100, "currency": "EUR"})
    run_config = json.dumps({"ops": {"charge_payment_op": {"config": {"payload": payload}}}})
    for lo in range(start, start + n, CHUNK):
        rows = [
            {"d": f"bench:{i}", "k": f"payment:o{i}", "p": payload, "rc": run_config,
             "fp": f"fp{i % 7}", "t": 1_000.0 + i, "c": ("transient", "permanent")[i % 2]}
            for i in range(lo, min(lo + CHUNK, start + n))
        ]
        with db.transaction() as conn:
            conn.execute(
                text(
                    "INSERT INTO dlq_records (dedupe_key, job_type, idempotency_key, run_id,"
                    " step, payload, run_config, tags, error_class, error_type, fingerprint,"
                    " last_error, trace, failure_count, replay_count, first_failed_at,"
                    " last_failed_at, status, status_changed_at, created_at, updated_at)"
                    " VALUES (:d, 'charge_payment', :k, 'run', 'charge_payment_op', :p, :rc,"
                    " '{}', :c, 'GatewayError', :fp, 'GatewayError: the gateway said no', :tr,"
                    " 1, 0, :t, :t, 'open', :t, :t, :t)"
                ),
                [{**r, "tr": TRACE} for r in rows],
            )
    with db.transaction() as conn:
        conn.execute(
            text(
                "INSERT INTO dlq_audit (record_id, action, actor, at) VALUES (1, 'bench', 'b', 1)"
            )
        )
    db.sql_dialect.refresh_statistics(db, "dlq_records")  # as autovacuum would


def _measure(fn: Callable[[], Any]) -> tuple[float, float]:
    """(seconds, peak MiB of Python allocations) of one call."""
    tracemalloc.start()
    started = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - started
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return elapsed, peak / 2**20


def _ticks(url: str, db: Database, rounds: int) -> dict[str, Any]:
    sensor = build_dlq_replay_sensor([], dead_letters.publish, name="bench_replay_sensor")
    steady: list[tuple[float, float]] = []
    publishing: list[tuple[float, float]] = []
    store = DlqStore(db)
    with dg.DagsterInstance.ephemeral() as instance:
        cursor: str | None = None

        def tick() -> None:
            nonlocal cursor
            context = dg.build_sensor_context(
                instance=instance, cursor=cursor, resources={"dlq": DlqResource(database_url=url)}
            )
            result = sensor.evaluate_tick(context)
            cursor = result.cursor

        tick()  # the first publication, and warm caches
        for r in range(rounds):
            steady.append(_measure(tick))
            store.note(1 + r, "bench", actor="bench", detail="a change to publish")
            publishing.append(_measure(tick))
    return {
        "steady_ms": round(statistics.median(t for t, _ in steady) * 1000, 1),
        "steady_peak_mib": round(statistics.median(m for _, m in steady), 2),
        "publish_ms": round(statistics.median(t for t, _ in publishing) * 1000, 1),
        "publish_peak_mib": round(statistics.median(m for _, m in publishing), 2),
    }


def _backend(url: str, sizes: tuple[int, ...], rounds: int) -> dict[str, Any]:
    db = Database.from_url(url)
    upgrade(db)
    out: dict[str, Any] = {"sizes": {}}
    done = 0
    for n in sizes:
        fill_open_records(db, done, n - done)
        done = n
        if n == sizes[0]:
            seconds, mib = _measure(lambda: DlqStore(db).list_records(status=["open"]))
            out["list_all_at_smallest"] = {
                "ms": round(seconds * 1000, 1), "peak_mib": round(mib, 2)
            }
        out["sizes"][str(n)] = _ticks(url, db, rounds)
    db.dispose()
    small, large = out["sizes"][str(sizes[0])], out["sizes"][str(sizes[-1])]
    out["ratio"] = {
        name: round(large[name] / max(small[name], 1e-9), 2)
        for name in ("steady_ms", "steady_peak_mib", "publish_ms", "publish_peak_mib")
    }
    return out


def run(quick: bool = False) -> dict[str, Any]:
    sizes, rounds = (QUICK_SIZES, 3) if quick else (SIZES, 5)
    out: dict[str, Any] = {
        "backends": each_backend(lambda url: _backend(url, sizes, rounds)), "summary": []
    }
    label = f"{sizes[-1] // 1000}k/{sizes[0] // 1000}k"
    for name, res in out["backends"].items():
        if "error" in res:
            continue
        small, large = res["sizes"][str(sizes[0])], res["sizes"][str(sizes[-1])]
        for what, unit in (("steady_ms", "ms"), ("publish_ms", "ms"),
                           ("steady_peak_mib", "MiB"), ("publish_peak_mib", "MiB")):
            timed = unit == "ms"
            out["summary"].append(
                {
                    "metric": f"{name} replay-sensor tick {what} {label}",
                    "value": large[what],
                    "unit": unit,
                    "baseline": small[what],
                    "ratio": res["ratio"][what],
                    "target": TARGET_RATIO if timed else None,
                    "ok": res["ratio"][what] <= TARGET_RATIO if timed else None,
                }
            )
    return out


def render(result: dict[str, Any]) -> None:
    print(f"{'backend':<9} {'records':>8} {'steady ms':>10} {'steady MiB':>11} "
          f"{'publish ms':>11} {'publish MiB':>12}")
    for name, res in result["backends"].items():
        if "error" in res:
            print(f"{name:<9} error: {res['error']}")
            continue
        for n, r in res["sizes"].items():
            print(f"{name:<9} {n:>8} {r['steady_ms']:>10} {r['steady_peak_mib']:>11} "
                  f"{r['publish_ms']:>11} {r['publish_peak_mib']:>12}")
        base = res["list_all_at_smallest"]
        print(f"{name:<9} ratio largest/smallest: {res['ratio']}; listing every open record at"
              f" the smallest size (the old tick's floor): {base['ms']} ms, {base['peak_mib']} MiB")


def main() -> None:
    module_main(__doc__, run, render)


if __name__ == "__main__":
    main()
