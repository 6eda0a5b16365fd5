"""The race invariant 1 is about: many callers in many processes, one effect per key.

4 processes x 16 threads call ``run_once`` on the same 50 keys (each thread in its own shuffled
order), all starting at the same instant. The effect inserts a row into a table with no unique
constraint in the same database, so a second effect for a key would be counted, not absorbed.
The same race runs again with half the threads claiming and completing in batches
(``begin_many`` / ``complete_many``) against the other half's single calls.
"""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest
from sqlalchemy import text

from resources.idempotency import IdempotencyStore, Status
from resources.storage.db import Database
from tests.idempotency_workers import EFFECTS_DDL, batch_race_worker, race_worker

PROCESSES = 4
THREADS = 16
KEYS = [f"payment:order-{i}" for i in range(50)]


@pytest.fixture(autouse=True)
def effects_table(db: Database) -> None:
    with db.transaction() as conn:
        conn.exec_driver_sql(EFFECTS_DDL)


def test_run_once_race_one_effect_per_key(db: Database, db_url: str) -> None:
    """Catches: a non-atomic claim (read-then-write) or a replay that re-runs the effect; either
    shows as a key with two effect rows or a caller that got another key's or no result."""
    start_at = time.time() + 6.0  # after every spawned process has imported and connected
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=PROCESSES, mp_context=ctx) as pool:
        futures = [
            pool.submit(race_worker, db_url, KEYS, THREADS, start_at, seed)
            for seed in range(PROCESSES)
        ]
        check_one_effect_per_key(db, [f.result(timeout=600) for f in futures])


def test_batched_claims_race_one_effect_per_key(db: Database, db_url: str) -> None:
    """Catches: a batch claim that is not one atomic decision per key (two batches, or a batch
    and a single claim, both taking a key), a batch completion that lands for a key its caller
    no longer owns, or a batch answer matched to the wrong key."""
    start_at = time.time() + 6.0
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=PROCESSES, mp_context=ctx) as pool:
        futures = [
            pool.submit(batch_race_worker, db_url, KEYS, 8, start_at, seed, 7)
            for seed in range(PROCESSES)
        ]
        check_one_effect_per_key(db, [f.result(timeout=600) for f in futures])


def check_one_effect_per_key(db: Database, reports: list[dict[str, Any]]) -> None:
    for report in reports:
        assert report["errors"] == [], report["errors"][:5]
        assert report["wrong"] == [], report["wrong"][:5]
    assert sum(r["ran"] for r in reports) == len(KEYS)

    with db.statement() as conn:
        counts: dict[str, int] = dict(
            conn.execute(text("SELECT key, count(*) FROM effects GROUP BY key")).tuples().all()
        )
    assert counts == dict.fromkeys(KEYS, 1)

    store = IdempotencyStore(db)
    for key in KEYS:
        record = store.get(key)
        assert record is not None and record.status is Status.COMPLETED, key
        assert record.result == {"key": key} and record.fence == 1 and record.attempt == 1
