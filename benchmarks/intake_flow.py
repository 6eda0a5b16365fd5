"""Intake flow control: what priority ordering and debounce cost a sensor tick's claim.

The claim orders by ``claim_rank`` (``created_at - priority * aging``, set at enqueue, indexed
with the status), so a priority claim reads a page from an index like the id-ordered one did.

For each app-database backend (embedded SQLite, Postgres), on one table of ``n`` pending
requests (priorities spread over -10..10):

- ``priority claim``: :meth:`RequestStore.claim_for_launch` pages of 200 until the table is
  drained (aged-priority order plus the debounce step), against ``id claim``: the claim
  statement as it was before priorities (``ORDER BY id``), the same pages on the same rows,
  rounds alternating, medians kept.
- ``debounce claim``: ``n`` requests in 10 debounce groups claimed when due (10 launched,
  the rest coalesced in the same transaction), per request, against the ``id claim`` per
  request.

    .venv/bin/python -m benchmarks.intake_flow [--quick]
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from sqlalchemy import text

from benchmarks.intake import each_backend
from benchmarks.suite import module_main
from engine.requests import JobRequest, RequestStore
from engine.requests.base import QUERIES
from resources.storage.db import Database
from resources.storage.migrations import upgrade

PAGE = 200
_OLD_CLAIMABLE = "(status = 'pending' OR (status = 'launched' AND updated_at <= :cutoff))"


def _fill(db: Database, n: int, *, groups: int = 0) -> None:
    rng = random.Random(7)
    with db.transaction() as conn:
        conn.execute(text("DELETE FROM job_requests"))
        conn.execute(
            text(
                "INSERT INTO job_requests (job_type, key, payload, payload_hash, status, queue,"
                " created_at, updated_at, attempts, priority, claim_rank, debounce_key,"
                " debounce_wait, debounce_max_wait, coalesced_count) VALUES ('bench', :k, '{}',"
                " 'h', 'pending', 'light', :t, :t, 0, :p, :t - :p * 60.0, :g, :w, :w, 0)"
            ),
            [
                {"k": f"bench:{i}", "t": 1000.0 + i * 0.001, "p": rng.randint(-10, 10),
                 "g": f"bench:g{i % groups}" if groups else None, "w": 1.0 if groups else None}
                for i in range(n)
            ],
        )
    db.sql_dialect.refresh_statistics(db, "job_requests")  # as autovacuum would


def _reset(db: Database) -> None:
    with db.transaction() as conn:
        conn.execute(text("UPDATE job_requests SET status = 'pending', coalesced_into = NULL,"
                          " coalesced_count = 0"))


def _old_claim(db: Database, now: float) -> int:
    """The claim as it was before priorities: the same rows read back as requests, id order."""
    q = QUERIES[db.dialect]
    sql = (q["claim"].replace(q["claimable"], _OLD_CLAIMABLE).replace("claim_rank, id", "id")
           .replace("INDEXED BY job_requests_claim", ""))
    with db.transaction() as conn:
        rows = conn.execute(text(sql.format(plain="", types="", set=q["to_launched"])),
                            {"now": now, "cutoff": now - 120, "limit": PAGE}).all()
    return len(sorted((JobRequest.from_row(r) for r in rows), key=lambda r: r.id))


def _drain(claim: Any) -> tuple[float, int]:
    started, total = time.perf_counter(), 0
    while True:
        got = claim()
        if not got:
            return time.perf_counter() - started, total
        total += got


def _backend(url: str, n: int, rounds: int) -> dict[str, Any]:
    db = Database.from_url(url)
    upgrade(db)
    now = 10_000_000.0
    store = RequestStore(db, clock=lambda: now)
    try:
        _fill(db, n)
        new_s, old_s = [], []
        for _ in range(rounds):
            _reset(db)
            seconds, got = _drain(lambda: len(store.claim_for_launch(PAGE)))
            assert got == n, got
            new_s.append(seconds)
            _reset(db)
            seconds, got = _drain(lambda: _old_claim(db, now))
            assert got == n, got
            old_s.append(seconds)
        _fill(db, n, groups=10)
        debounce_s = []
        for _ in range(rounds):
            _reset(db)
            started = time.perf_counter()
            launched = store.claim_for_launch(PAGE)
            debounce_s.append(time.perf_counter() - started)
            assert len(launched) == 10 and sum(r.coalesced_count for r in launched) == n - 10
    finally:
        db.dispose()
    per = {
        "priority_claim_us": round(statistics.median(new_s) / n * 1e6, 2),
        "id_claim_us": round(statistics.median(old_s) / n * 1e6, 2),
        "debounce_claim_us": round(statistics.median(debounce_s) / n * 1e6, 2),
    }
    return {
        "rows": n,
        "per_request": per,
        "priority_ratio": round(per["priority_claim_us"] / per["id_claim_us"], 3),
        "debounce_ratio": round(per["debounce_claim_us"] / per["id_claim_us"], 3),
    }


def run(quick: bool = False) -> dict[str, Any]:
    n, rounds = (2_000, 1) if quick else (10_000, 3)
    out: dict[str, Any] = {
        "backends": each_backend(lambda url: _backend(url, n, rounds)), "summary": []
    }
    for name, res in out["backends"].items():
        if "error" in res:
            continue
        per = res["per_request"]
        for metric, key, ratio in (
            ("priority claim", "priority_claim_us", res["priority_ratio"]),
            ("debounce claim", "debounce_claim_us", res["debounce_ratio"]),
        ):
            out["summary"].append(
                {"metric": f"{name} {metric} per request", "value": per[key], "unit": "us",
                 "baseline": per["id_claim_us"], "ratio": ratio, "target": None, "ok": None}
            )
    return out


def render(result: dict[str, Any]) -> None:
    print(f"{'backend':<10} {'rows':>7} {'id claim':>10} {'priority':>10} {'ratio':>6} "
          f"{'debounce':>10} {'ratio':>6}   (us per request)")
    for name, res in result["backends"].items():
        if "error" in res:
            print(f"{name:<10} error: {res['error']}")
            continue
        per = res["per_request"]
        print(f"{name:<10} {res['rows']:>7} {per['id_claim_us']:>10} "
              f"{per['priority_claim_us']:>10} {res['priority_ratio']:>6} "
              f"{per['debounce_claim_us']:>10} {res['debounce_ratio']:>6}")


def main() -> None:
    module_main(__doc__, run, render)


if __name__ == "__main__":
    main()
