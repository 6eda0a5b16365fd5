"""Every Redis key sekali writes has a lifetime or a hard bound, on a throw-away redis-server.

The audit behind it (key formats in ``resources/`` and ``pipelines/``): cache envelopes, rebuild
locks, versions, waiter counts, signal lists, error and negative markers (``PX`` on every write);
lock keys, fences, wait queues and wake-up lists (``PX``/``PEXPIRE``); retry budgets (``PX``);
and the three that had none: the cache and lock stats hashes and the hot-key sorted set with its
decay time, now refreshed to a TTL on every flush and capped in size.
"""

from __future__ import annotations

import threading
import time

import pytest
import redis

from resources.cache import StampedeCache
from resources.errors import CacheLoaderFailed, LockNotAcquired
from resources.locks import RedisLock, RedisLockStats, lock_stats
from resources.retry import RetryBudget
from resources.storage.redis import redis_client
from resources.telemetry.patterns import key_pattern
from sandbox.redis_server import RedisServer

pytestmark = pytest.mark.redis


def _workload(client: redis.Redis) -> None:
    """Misses, hits, waiters, invalidation, failed loads; contended locks; a retry budget."""
    cache = StampedeCache(
        client, namespace="shop", ttl=60, stale_ttl=30, negative_ttl=5, stats_flush_interval=0
    )
    started = threading.Event()

    def slow() -> str:
        started.set()
        time.sleep(0.3)
        return "v"

    threads = [
        threading.Thread(target=cache.get_or_load, args=("report:daily:2026-11-01", slow))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(20):
        cache.get_or_load(f"order-{i}", lambda: {"n": 1})
        cache.get_or_load(f"order-{i}", lambda: {"n": 2})
    cache.invalidate("order-1")

    def broken() -> None:
        raise RuntimeError("downstream down")

    with pytest.raises(RuntimeError):
        cache.get_or_load("user:alice:profile", broken)
    with pytest.raises(CacheLoaderFailed):
        cache.get_or_load("user:alice:profile", broken)
    cache.close()

    stats = RedisLockStats(client, flush_interval=0)
    holder = RedisLock(client, "stock:sku-1", ttl=5, observer=stats)
    holder.acquire()

    def wait_then_release() -> None:
        with RedisLock(client, "stock:sku-1", ttl=5, blocking_timeout=2, observer=stats):
            pass

    waiter = threading.Thread(target=wait_then_release)
    waiter.start()
    time.sleep(0.2)
    with pytest.raises(LockNotAcquired):
        RedisLock(client, "stock:sku-1", ttl=5, blocking_timeout=0, observer=stats).acquire()
    holder.release()
    waiter.join()
    stats.flush()

    budget = RetryBudget(client, namespace="shop", capacity=3)
    budget.try_spend("smtp")
    budget.refund("gateway")
    budget.try_spend("gateway")


def test_every_key_a_workload_writes_has_a_ttl(redis_server: RedisServer) -> None:
    """Catches: a key written without PX/PEXPIRE (stats hashes, the hot-key set and its decay
    time were such keys): Redis memory that only grows."""
    client = redis_client(redis_server.url)
    _workload(client)
    keys = sorted(k.decode() for k in client.scan_iter(count=1000))
    families = {
        "cache envelope": "sekali:cache:{shop:order-0}",
        "cache version": "sekali:cache:{shop:order-1}:ver",
        "cache error marker": "sekali:cache:{shop:user:alice:profile}:err",
        "cache stats": "sekali:cache:{shop}:stats",
        "hot keys": "sekali:cache:{shop}:hot",
        "decay time": "sekali:cache:{shop}:hot:decayed",
        "lock fence": "sekali:lock:{stock:sku-1}:fence",
        "lock stats": "sekali:stats:locks",
        "retry budget": "shop:retry-budget:{smtp}",
    }
    missing = {name: key for name, key in families.items() if key not in keys}
    assert not missing, (missing, keys)
    without_ttl = [k for k in keys if client.pttl(k) < 0]
    assert without_ttl == [], without_ttl


def test_stats_hashes_stay_bounded_whatever_the_names(redis_server: RedisServer) -> None:
    """Catches: names no pattern folds (user names as whole keys) adding a stats field each,
    for ever; and counts lost when the cap is reached."""
    client = redis_client(redis_server.url)
    cache = StampedeCache(client, namespace="names", stats_flush_interval=3600)
    cache.recorder.counters.max_fields = 5
    names = [f"user{chr(97 + i)}x" for i in range(26)]  # no digit, no colon: kept as they are
    assert {key_pattern(n) for n in names} == set(names)
    for name in names:
        cache.get_or_load(name, lambda: 1)
    stats = cache.stats()
    assert len(client.hkeys("sekali:cache:{names}:stats")) <= 5 + 8  # + one overflow per counter
    assert "~overflow" in stats
    assert sum(row["misses"] for row in stats.values()) == len(names)
    cache.close()

    locks = RedisLockStats(client, key="sekali:stats:locks:t", flush_interval=3600, max_fields=3)
    for name in names:
        locks.record("acquired", name)
    locks.flush()
    counted = lock_stats(client, key="sekali:stats:locks:t")
    assert len(counted) <= 3 + 1 and sum(r["acquired"] for r in counted.values()) == len(names)


@pytest.mark.parametrize(
    ("name", "pattern"),
    [
        ("order:123", "order:*"),
        ("order-123", "order-*"),
        ("tenant7:order:9", "*:*:*"),
        ("email:welcome:alice:2026-11-01", "email:*:*:*"),
        ("report:orders_by_status:2026-11-01", "report:*:*"),
        ("0b8f3c2e-9d41-4c6a-8f0e-5a7b9c1d2e3f", "*"),
        ("session-5f3a9c0d1e2b4a67", "session-*"),
        ("12345678901234", "*"),
        ("nightly", "nightly"),
    ],
)
def test_key_pattern_folds_ids_and_every_segment_after_the_first(name: str, pattern: str) -> None:
    """Catches: ids without colons (order-123, uuids, digests) and non-numeric middle segments
    (a user name, a template) each becoming a stats pattern of their own."""
    assert key_pattern(name) == pattern
