"""What bounded purges cost against one unbounded DELETE, on SQLite and Postgres.

The baseline is the statement a purge without batches would run: one ``DELETE`` of every expired
``job_attempts`` row (the same condition, references to unfinished requests included) in one
transaction. The bounded purge deletes the same rows 1,000 per transaction
(:class:`resources.storage.retention.Expiry`). Reported: how long one transaction of each holds
its locks (the median batch, the longest too; what batching buys: how long writers of the table
wait behind the purge; the target), and rows per second of each (what batching costs: a
commit and a keyed delete per batch). One in ten
rows belongs to a request still pending and must stay; the run checks it did.

Run: ``python -m benchmarks.retention [--quick]``.
"""

from __future__ import annotations

import statistics
import time
import uuid
from typing import Any

from sqlalchemy import text

from benchmarks.intake import each_backend
from benchmarks.suite import module_main
from engine.attempts import AttemptRecorder
from engine.requests import RequestStore
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from resources.storage.retention import Expiry

TARGET_RATIO = 0.5  # a batch's transaction at most half as long as the unbounded DELETE's
BATCH = 1000
PINNED_EVERY = 10


def _fill(db: Database, n: int) -> None:
    with db.transaction() as conn:
        conn.execute(text("DELETE FROM job_attempts"))
        conn.execute(text("DELETE FROM job_requests"))
        conn.execute(
            text(
                "INSERT INTO job_requests (job_type, key, payload, payload_hash, status, queue,"
                " created_at, updated_at, attempts, claim_rank) VALUES"
                " ('bench', 'bench:pending', '{}', 'h', 'pending', 'light', 0, 0, 0, 0)"
            )
        )
        pending = conn.execute(text("SELECT id FROM job_requests")).scalar_one()
        conn.execute(
            text(
                "INSERT INTO job_attempts (attempt_id, job_type, attempt, host, pid, started_at,"
                " takeover, outcome, request_id) VALUES (:id, 'bench', 0, 'h', 1, :t, 0,"
                " 'completed', :rid)"
            ),
            [
                {"id": uuid.uuid4().hex, "t": 1000.0 + i,
                 "rid": pending if i % PINNED_EVERY == 0 else None}
                for i in range(n)
            ],
        )
    db.sql_dialect.refresh_statistics(db, "job_attempts", "job_requests")  # as autovacuum would


def _expiry(db: Database) -> Expiry:
    requests = RequestStore(db)
    return AttemptRecorder(db, clock=time.time).expired(
        60.0, keep=[requests.unfinished_request_reference("job_attempts.request_id")]
    )


def _unbounded(db: Database, expiry: Expiry) -> tuple[int, float]:
    started = time.perf_counter()
    with db.transaction() as conn:
        n = conn.execute(
            text(f"DELETE FROM job_attempts WHERE {expiry.where}"), dict(expiry.params)  # nosec B608: SQL from code constants, values bound
        ).rowcount
    elapsed = time.perf_counter() - started
    return int(n), elapsed


def _bounded(db: Database, expiry: Expiry) -> tuple[int, float, list[float]]:
    deleted, batches, started = 0, [], time.perf_counter()
    while True:
        t0 = time.perf_counter()
        n = expiry.purge(db, batch_size=BATCH, max_batches=1)
        batches.append(time.perf_counter() - t0)
        deleted += n
        if n < BATCH:
            return deleted, time.perf_counter() - started, batches


def _backend(url: str, n: int, rounds: int) -> dict[str, Any]:
    db = Database.from_url(url)
    upgrade(db)
    runs: dict[str, list[tuple[float, float, float]]] = {"unbounded": [], "bounded": []}
    expected = n - len(range(0, n, PINNED_EVERY))
    for _ in range(rounds):  # alternate, keep the median: like with like on a noisy machine
        _fill(db, n)
        deleted, elapsed = _unbounded(db, _expiry(db))
        assert deleted == expected, (deleted, expected)
        runs["unbounded"].append((deleted / elapsed, elapsed, elapsed))
        _fill(db, n)
        deleted, elapsed, batches = _bounded(db, _expiry(db))
        assert deleted == expected, (deleted, expected)
        runs["bounded"].append((deleted / elapsed, statistics.median(batches), max(batches)))
    with db.statement() as conn:
        kept = conn.execute(text("SELECT COUNT(*) FROM job_attempts")).scalar_one()
    assert kept == n - expected, "the purge deleted a row an unfinished request references"
    db.dispose()
    med = {k: sorted(v)[len(v) // 2] for k, v in runs.items()}
    return {
        "rows": n,
        "deleted": expected,
        "rows_per_second": {k: round(v[0], 1) for k, v in med.items()},
        "transaction_ms": {k: round(v[1] * 1000, 1) for k, v in med.items()},
        "longest_transaction_ms": {k: round(v[2] * 1000, 1) for k, v in med.items()},
        "ratio": round(med["bounded"][0] / med["unbounded"][0], 3),
    }


def run(quick: bool = False) -> dict[str, Any]:
    n, rounds = (20_000, 1) if quick else (100_000, 3)
    out: dict[str, Any] = {
        "backends": each_backend(lambda url: _backend(url, n, rounds)), "summary": []
    }
    for name, res in out["backends"].items():
        if "error" in res:
            continue
        out["summary"].append(
            {
                "metric": f"{name} bounded purge rows/s",
                "value": res["rows_per_second"]["bounded"],
                "unit": "rows/s",
                "baseline": res["rows_per_second"]["unbounded"],
                "ratio": res["ratio"],
                "target": None,
                "ok": None,
            }
        )
        tx = res["transaction_ms"]
        ratio = round(tx["bounded"] / tx["unbounded"], 3)
        out["summary"].append(
            {
                "metric": f"{name} purge transaction (median batch)",
                "value": tx["bounded"],
                "unit": "ms",
                "baseline": tx["unbounded"],
                "ratio": ratio,
                "target": TARGET_RATIO,
                "ok": ratio <= TARGET_RATIO,
            }
        )
    return out


def render(result: dict[str, Any]) -> None:
    print(
        f"{'backend':<10} {'rows':>7} {'unbounded/s':>12} {'bounded/s':>10} {'ratio':>6} "
        f"{'tx unbounded':>13} {'batch median':>13} {'batch max':>10}"
    )
    for name, res in result["backends"].items():
        if "error" in res:
            print(f"{name:<10} error: {res['error']}")
            continue
        rps, tx = res["rows_per_second"], res["transaction_ms"]
        print(
            f"{name:<10} {res['rows']:>7} {rps['unbounded']:>12} {rps['bounded']:>10} "
            f"{res['ratio']:>6} {tx['unbounded']:>10} ms {tx['bounded']:>10} ms "
            f"{res['longest_transaction_ms']['bounded']:>7} ms"
        )
    print(f"target: a purge transaction (median batch) <= {TARGET_RATIO} x the unbounded DELETE")


def main() -> None:
    module_main(__doc__, run, render)


if __name__ == "__main__":
    main()
