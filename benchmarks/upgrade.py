"""What upgrading Postgres from the previous release costs the intake while it runs, at 2 M job
requests: ``sekali bench --only upgrade``, or ``python -m benchmarks.upgrade [--quick]``.

The run's private cluster (:func:`benchmarks.backends.private_postgres`) holds 2 M requests (1 %
pending) at the previous release's schema, twice (the second a template copy of the first). On
one, the files as they stood before 0110 had a successor are applied the way the runner of that
time applied them (every pending file in one transaction); on the other, this release's upgrade
(0120, and 0121 online in 0110's place). Meanwhile, as in a rolling upgrade, the previous
release's producer inserts a request every 20 ms (its own statement, which knows no
``claim_rank``) and its intake claims a page of 50 every 50 ms, each on its own connection; a
watcher on another connection polls ``pg_locks`` every 5 ms for a granted ACCESS EXCLUSIVE lock
on ``job_requests``.

Reported per path: how long the upgrade took; the longest ACCESS EXCLUSIVE hold on
``job_requests`` (target: at most 1 s, the bound this release states); enqueue and claim latency
(p50, p99, max; time to an answer, refusals included) during the upgrade against p99 in a quiet
window just before (a ratio: the machine is shared); the old enqueues refused during the upgrade
and in the second after it (requests lost).

``--quick``: 50,000 requests instead of 2 M, the same windows (3 s quiet, 1 s after). The
statements then take milliseconds, so the quick run proves the path (no request refused, no
long exclusive hold) rather than measuring the hold the target is about.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import text

from benchmarks.backends import private_postgres
from benchmarks.suite import module_main, render_table
from resources.storage.db import Database
from resources.storage.migration_files import load_migrations, sql_through
from resources.storage.migrations import upgrade
from resources.storage.settings import DatabaseTimeouts, MigrationSettings

ROWS, QUICK_ROWS = 2_000_000, 50_000
TARGET_HOLD_SECONDS = 1.0
QUIET_SECONDS = 3.0
AFTER_SECONDS = 1.0
PREVIOUS_RELEASE = "0095"  # the newest migration the previous release shipped
BEFORE_THE_SUCCESSOR = "0115"  # 0110 applied, nothing after it yet

PREVIOUS_RELEASE_INSERT = """
INSERT INTO job_requests
    (job_type, key, payload, payload_hash, status, queue, correlation_id, created_at,
     updated_at, attempts, traceparent)
VALUES (:job_type, :key, :payload, :hash, 'pending', :queue, :cid, :now, :now, 0, :traceparent)
ON CONFLICT (key) DO NOTHING
RETURNING id
"""
"""The previous release's enqueue statement as it ships: it knows no claim_rank."""

PREVIOUS_RELEASE_CLAIM = """
WITH picked AS MATERIALIZED (
    SELECT id FROM job_requests
    WHERE (status = 'pending' OR (status = 'launched' AND updated_at <= :cutoff))
    ORDER BY id LIMIT :limit FOR UPDATE SKIP LOCKED
)
UPDATE job_requests SET status = 'launched', updated_at = :now
FROM picked
WHERE job_requests.id = picked.id
RETURNING job_requests.id
"""
"""The previous release's intake claim (Postgres), as it ships."""

_FILL = """
INSERT INTO job_requests (job_type, key, payload, payload_hash, status, queue, created_at,
    updated_at, attempts)
SELECT 'send_email', 'bench:' || g, '{"template": "welcome", "user_id": "u' || g || '"}', 'h',
    CASE WHEN g % 100 = 0 THEN 'pending' ELSE 'completed' END, 'light', 1.7e9 + g, 1.7e9 + g, 1
FROM generate_series(1, :n) AS g
"""


class Load(threading.Thread):
    """One operation repeated every ``every`` seconds on its own connection; each sample is
    (started, seconds, ok), timed from the start of the call (a blocked call counts in full)."""

    def __init__(self, name: str, call: Callable[[], None], every: float) -> None:
        super().__init__(name=name, daemon=True)
        self.call, self.every = call, every
        self.samples: list[tuple[float, float, bool]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            started = time.perf_counter()
            try:
                self.call()
                ok = True
            except Exception:  # noqa: BLE001 - a failed enqueue is what is being counted
                ok = False
            took = time.perf_counter() - started
            self.samples.append((started, took, ok))
            self.stop.wait(max(0.0, self.every - took))


class LockWatch(threading.Thread):
    """Polls ``pg_locks`` for granted ACCESS EXCLUSIVE locks on ``table``; each hold runs from
    the poll that first saw it to the last poll that saw it (about 5 ms of resolution)."""

    def __init__(self, db: Database, table: str, every: float = 0.005) -> None:
        super().__init__(name="lock-watch", daemon=True)
        self.db, self.table, self.every = db, table, every
        self.holds: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        seen: dict[int, tuple[float, float]] = {}
        query = text("SELECT pid FROM pg_locks WHERE relation = to_regclass(:t)"
                     " AND mode = 'AccessExclusiveLock' AND granted")
        with self.db.session() as conn:
            while not self.stop.is_set():
                now = time.perf_counter()
                holders = {int(p) for p in conn.execute(query, {"t": self.table}).scalars()}
                for pid in holders:
                    first, _ = seen.get(pid, (now, now))
                    seen[pid] = (first, now)
                for pid in set(seen) - holders:
                    first, last = seen.pop(pid)
                    self.holds.append(last - first + self.every)
                self.stop.wait(self.every)
        self.holds += [last - first + self.every for first, last in seen.values()]


def _fill(url: str, n: int) -> None:
    db = Database.from_url(url)
    try:
        with db.transaction(statement_timeout=1800) as conn:
            conn.execute(text(_FILL), {"n": n})
        with db.statement() as conn:
            conn.execute(text("VACUUM ANALYZE job_requests"))
    finally:
        db.dispose()


def _one_transaction(db: Database, directory: Path) -> None:
    """The files applied as the runner before this release did: every pending file, one
    transaction, its locks held until the end."""
    with db.statement() as conn:
        done = {r[0] for r in conn.execute(text("SELECT name FROM sekali_schema_migrations"))}
    with db.transaction(statement_timeout=1800) as conn:
        for migration in load_migrations("postgresql", directory):
            if migration.name in done:
                continue
            for statement in migration.statements:
                conn.exec_driver_sql(statement.sql.replace("%", "%%"))
            conn.execute(text("INSERT INTO sekali_schema_migrations (name, checksum, applied_at)"
                              " VALUES (:n, :c, :t)"),
                         {"n": migration.name, "c": migration.checksum, "t": time.time()})


def _percentiles(samples: list[tuple[float, float, bool]]) -> dict[str, float | None]:
    """Time to an answer, failed calls included (a call blocked and then refused waited too)."""
    took = sorted(s[1] for s in samples)
    if not took:
        return {"p50_ms": None, "p99_ms": None, "max_ms": None}
    return {
        "p50_ms": round(statistics.median(took) * 1000, 1),
        "p99_ms": round(took[min(len(took) - 1, int(len(took) * 0.99))] * 1000, 1),
        "max_ms": round(took[-1] * 1000, 1),
    }


def _path(url: str, apply: Callable[[Database], None],
          steps: list[tuple[float, str]] | None = None) -> dict[str, Any]:
    """Run ``apply`` under the old producer and intake; what they and the lock watch saw, and,
    given the upgrade's progress lines (``steps``: when each statement started), per step."""
    patient = DatabaseTimeouts(statement=1800, lock=1800, margin=30)  # measure, never time out
    dbs = [Database.from_url(url, timeouts=patient) for _ in range(3)]
    producer_db, intake_db, watch_db = dbs
    counter = iter(range(10**9))

    def enqueue() -> None:
        with producer_db.transaction() as conn:
            conn.execute(text(PREVIOUS_RELEASE_INSERT), {
                "job_type": "send_email", "key": f"during:{next(counter)}", "payload": "{}",
                "hash": "h", "queue": "light", "cid": None, "now": time.time(),
                "traceparent": None})

    def claim() -> None:
        with intake_db.transaction() as conn:
            conn.execute(text(PREVIOUS_RELEASE_CLAIM),
                         {"cutoff": time.time() - 120, "limit": 50, "now": time.time()}).all()

    loads = [Load("enqueue", enqueue, 0.02), Load("claim", claim, 0.05)]
    watch = LockWatch(watch_db, "job_requests")
    for thread in (*loads, watch):
        thread.start()
    time.sleep(QUIET_SECONDS)
    upgrader = Database.from_url(url)
    began = time.perf_counter()
    try:
        apply(upgrader)
    finally:
        ended = time.perf_counter()
        time.sleep(AFTER_SECONDS)
        for load in loads:
            load.stop.set()
        watch.stop.set()
        for thread in (*loads, watch):
            thread.join(timeout=1800)
        for db in (*dbs, upgrader):
            db.dispose()
    out: dict[str, Any] = {
        "upgrade_seconds": round(ended - began, 2),
        "longest_exclusive_hold_s": round(max(watch.holds, default=0.0), 3),
        "exclusive_holds": len(watch.holds),
    }
    marks = [(t, line.split(": ", 1)[-1]) for t, line in (steps or [])
             if " batch " not in line and not line.startswith("applied")]
    out["steps"] = [
        {"statement": what, "seconds": round(end - start, 2),
         **{load.name: _percentiles([s for s in load.samples if start <= s[0] < end])
            for load in loads}}
        for (start, what), end in zip(marks, [t for t, _ in marks[1:]] + [ended], strict=False)
    ]
    for load in loads:
        quiet = [s for s in load.samples if s[0] < began]
        during = [s for s in load.samples if began <= s[0] <= ended]
        after = [s for s in load.samples if s[0] > ended]
        out[load.name] = {
            "during": _percentiles(during),
            "quiet": _percentiles(quiet),
            "calls_during": len(during),
            "failed_during": sum(1 for s in during if not s[2]),
            "calls_after": len(after),
            "failed_after": sum(1 for s in after if not s[2]),
        }
    return out


def run(quick: bool = False) -> dict[str, Any]:
    n = QUICK_ROWS if quick else ROWS
    server = private_postgres()  # the run's, shared: the databases are this run's own
    suffix = uuid.uuid4().hex[:6]
    names = {name: f"upgrade_{name}_{suffix}" for name in ("previous", "one_transaction", "online")}
    results: dict[str, Any] = {"rows": n}
    admin = Database.from_url(server.url())
    try:
        with tempfile.TemporaryDirectory() as tmp:
            previous = sql_through(PREVIOUS_RELEASE, Path(tmp) / "previous")
            before = sql_through(BEFORE_THE_SUCCESSOR, Path(tmp) / "before")
            with admin.statement() as conn:
                conn.execute(text(f"CREATE DATABASE {names['previous']}"))
            template = Database.from_url(server.url(names["previous"]))
            upgrade(template, previous)
            template.dispose()
            print(f"upgrade: filling {n:,} requests", file=sys.stderr, flush=True)
            _fill(server.url(names["previous"]), n)
            with admin.statement() as conn:
                for name in ("one_transaction", "online"):
                    conn.execute(text(
                        f"CREATE DATABASE {names[name]} TEMPLATE {names['previous']}"))
            print("upgrade: the files before 0110's successor, in one transaction",
                  file=sys.stderr, flush=True)
            results["one_transaction"] = _path(
                server.url(names["one_transaction"]), lambda db: _one_transaction(db, before))
            print("upgrade: this release's upgrade (online)", file=sys.stderr, flush=True)
            steps: list[tuple[float, str]] = []

            def progress(line: str) -> None:
                steps.append((time.perf_counter(), line))
                print(f"  {line}", file=sys.stderr, flush=True)

            results["online"] = _path(
                server.url(names["online"]),
                lambda db: upgrade(db, settings=MigrationSettings(), progress=progress), steps)
    finally:
        with admin.statement() as conn:
            for name in names.values():
                conn.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        admin.dispose()
    results["summary"] = _summary(results)
    results["headline"] = {
        "upgrade_longest_exclusive_hold_s": results["online"]["longest_exclusive_hold_s"]}
    return results


def _summary(r: dict[str, Any]) -> list[dict[str, Any]]:
    online, before = r["online"], r["one_transaction"]

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if not a or not b else round(a / b, 3)

    rows: list[dict[str, Any]] = [{
        "metric": f"longest ACCESS EXCLUSIVE hold on job_requests, {r['rows']:,} rows, online",
        "value": online["longest_exclusive_hold_s"], "unit": "s",
        "baseline": before["longest_exclusive_hold_s"],
        "ratio": ratio(online["longest_exclusive_hold_s"], before["longest_exclusive_hold_s"]),
        "target": f"<= {TARGET_HOLD_SECONDS:g}",
        "ok": online["longest_exclusive_hold_s"] <= TARGET_HOLD_SECONDS,
    }]
    for op in ("enqueue", "claim"):
        for path, res in (("online", online), ("one transaction", before)):
            rows.append({
                "metric": f"old {op} p99 during the upgrade over quiet, {path}",
                "value": res[op]["during"]["p99_ms"], "unit": "ms",
                "baseline": res[op]["quiet"]["p99_ms"],
                "ratio": ratio(res[op]["during"]["p99_ms"], res[op]["quiet"]["p99_ms"]),
                "target": None, "ok": None,
            })
    failed = {path: res["enqueue"]["failed_during"] + res["enqueue"]["failed_after"]
              for path, res in (("online", online), ("one transaction", before))}
    rows.append({
        "metric": f"old enqueues refused during and {AFTER_SECONDS:g} s after the upgrade, "
                  "online",
        "value": failed["online"], "unit": "requests", "baseline": failed["one transaction"],
        "ratio": None, "target": "0", "ok": failed["online"] == 0,
    })
    rows.append({
        "metric": "upgrade duration, online", "value": online["upgrade_seconds"], "unit": "s",
        "baseline": before["upgrade_seconds"],
        "ratio": ratio(online["upgrade_seconds"], before["upgrade_seconds"]),
        "target": None, "ok": None,
    })
    return rows


def _render(result: dict[str, Any]) -> None:
    print(render_table([{"suite": "upgrade", **row} for row in result["summary"]]))


if __name__ == "__main__":
    sys.exit(module_main(__doc__, run, _render))
