"""Cache warming against a real Redis and the report job's real loaders (SQLite/Postgres).

Loader calls are counted in ``report_snapshots``: the report loader records every build there.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from typing import Any

import dagster as dg
from sqlalchemy import text

from engine.upkeep.warming import Warmer, declared_loaders
from pipelines.assets.warming import cache_warming
from pipelines.jobs.report import report_loader
from resources.cache import StampedeCache
from resources.storage.db import Database

HOT = [
    "report:orders_by_status:2026-11-29",
    "report:stock_levels:2026-11-29",
    "report:fulfilment_by_status:2026-11-29",
]
COLD = "report:orders_by_status:2026-11-28"


def builds(db: Database, key: str) -> int:
    _, report, as_of = key.split(":", 2)
    with db.statement() as conn:
        return int(
            conn.execute(
                text("SELECT COUNT(*) FROM report_snapshots WHERE report = :r AND as_of = :a"),
                {"r": report, "a": as_of},
            ).scalar()
        )


def hits(cache: StampedeCache) -> float:
    return sum(v.get("hits", 0.0) for p, v in cache.stats().items() if p.startswith("report:"))


def read(cache: StampedeCache, db: Database, key: str, ttl: float = 2.0) -> Any:
    _, report, as_of = key.split(":", 2)
    return cache.get_or_load(key, report_loader(db, report, as_of), ttl=ttl)


def test_warming_refreshes_hot_keys_before_expiry_so_next_reads_hit(
    db: Database, redis_url: str, namespace: str
) -> None:
    """Catches: warming that refreshes cold keys instead of hot ones, or refreshes too late
    (after expiry the next readers miss and rebuild)."""
    lifetime = 5.0  # long enough that a loaded machine's 46 reads end before the first key expires
    # beta=0: no XFetch early refresh, which a slow loader makes likely within seconds of expiry
    cache = StampedeCache.from_url(
        redis_url, namespace=namespace, ttl=lifetime, jitter=0.0, beta=0.0
    )
    try:
        for key in HOT:
            for _ in range(15):
                read(cache, db, key, ttl=lifetime)
        read(cache, db, COLD, ttl=lifetime)
        all_written = time.monotonic()
        assert all(builds(db, k) == 1 for k in HOT + [COLD])
        report = Warmer(cache, declared_loaders(db), top_n=3, refresh_within=60.0, ttl=60.0).run()
        assert sorted(report.refreshed) == sorted(HOT)
        assert report.misses_avoided == 3 and not report.failed
        assert all(builds(db, k) == 2 for k in HOT)

        time.sleep(max(0.0, all_written + lifetime + 0.5 - time.monotonic()))  # past the old expiry
        before = hits(cache)
        for key in HOT:
            read(cache, db, key, ttl=lifetime)
        read(cache, db, COLD, ttl=lifetime)
        assert all(builds(db, k) == 2 for k in HOT), "a warmed key missed after its old expiry"
        assert builds(db, COLD) == 2  # not warmed: it expired and its next read rebuilt it
        assert hits(cache) - before == 3  # the three warmed keys, read after their old expiry

        # A second run finds them fresh and does nothing.
        again = Warmer(cache, declared_loaders(db), top_n=3, refresh_within=30.0).run()
        assert again.refreshed == [] and again.fresh == 3
    finally:
        cache.close()


def _reader(redis_url: str, namespace: str, url: str, key: str, barrier_at: float) -> None:
    db = Database.from_url(url)
    cache = StampedeCache.from_url(redis_url, namespace=namespace, ttl=60.0, jitter=0.0)
    time.sleep(max(0.0, barrier_at - time.time()))
    read(cache, db, key, ttl=60.0)
    cache.close()


def test_warming_during_a_burst_of_misses_adds_at_most_one_build(
    db: Database, db_url: str, redis_url: str, namespace: str
) -> None:
    """Catches: a warmer that bypasses the single flight: readers in threads and processes and
    the warmer hit one absent key at once; at most the miss rebuild plus one forced refresh."""
    key = HOT[0]
    cache = StampedeCache.from_url(redis_url, namespace=namespace, ttl=60.0, jitter=0.0)
    try:
        at = time.time() + 3.0  # every reader and the warmer start at the same moment
        ctx = multiprocessing.get_context("spawn")
        procs = [
            ctx.Process(target=_reader, args=(redis_url, namespace, db_url, key, at))
            for _ in range(2)
        ]
        for p in procs:
            p.start()
        threads = [
            threading.Thread(target=_reader, args=(redis_url, namespace, db_url, key, at))
            for _ in range(6)
        ]
        for t in threads:
            t.start()
        time.sleep(max(0.0, at - time.time()))
        report = Warmer(cache, declared_loaders(db), refresh_within=60.0).run([key])
        for t in threads:
            t.join(timeout=60)
        for p in procs:
            p.join(timeout=60)
            assert p.exitcode == 0
        assert report.refreshed == [key] or report.fresh == 1
        assert builds(db, key) <= 2  # one miss rebuild + at most the warmer's forced refresh
        assert builds(db, key) >= 1
    finally:
        cache.close()


def test_warming_asset_reports_metadata(
    db: Database, db_url: str, redis_url: str, namespace: str
) -> None:
    """Catches: an asset that does not record keys refreshed, time taken and misses avoided."""
    from resources.dagster_resources import CacheResource, DatabaseResource

    cache = StampedeCache.from_url(redis_url, namespace=namespace, ttl=30.0, jitter=0.0)
    for _ in range(5):
        read(cache, db, HOT[1], ttl=30.0)
    cache.close()
    result = dg.materialize(
        [cache_warming],
        resources={
            "cache": CacheResource(redis_url=redis_url, namespace=namespace),
            "app_db": DatabaseResource(database_url=db_url),
        },
        instance=dg.DagsterInstance.ephemeral(),
    )
    assert result.success
    (mat,) = result.asset_materializations_for_node("cache_warming")
    assert mat.metadata["keys_refreshed"].value == 1
    assert mat.metadata["misses_avoided"].value == 1
    assert mat.metadata["seconds"].value >= 0
    assert builds(db, HOT[1]) == 2
