"""Locks, fences, concurrency slots, rate buckets and the retry budget never sit on a Redis that
may evict them (docs/locks.md, "Eviction").

On a private redis-server with a small ``maxmemory`` and an evicting policy, memory pressure
deletes a held lock's key (a second holder gets in), a limit-1 slot's holders set (a second
holder), a drained rate bucket (it grants its burst again). So every one of them refuses such a
Redis at its client's first use (one ``INFO memory``), naming the policy and the fix; a policy
changed later is what ``sekali doctor`` reports; the cache is not refused (losing an entry is a
miss). The shared Redis is never reconfigured: each test starts its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from engine.health.diagnosis import DiagnosisSetup, check_redis_eviction
from engine.registry import JOB_TYPES
from resources.cache import StampedeCache
from resources.errors import EvictingRedis
from resources.flow import ConcurrencyLimiter, RateLimiter
from resources.locks import MemoryLockStats, RedisLock
from resources.retry import ErrorClass, RetryBudget, classify
from resources.storage.db import Database
from resources.storage.redis import redis_client
from sandbox.redis_server import RedisServer, free_port

EVICTING = ("allkeys-lru", "allkeys-lfu", "allkeys-random", "volatile-lru", "volatile-lfu",
            "volatile-random", "volatile-ttl")


@contextlib.contextmanager
def private_redis(tmp_path: Path, policy: str, headroom: int | None = None
                  ) -> Iterator[tuple[RedisServer, redis.Redis]]:
    """A redis-server of this test with ``policy``; with ``headroom``, ``maxmemory`` is what
    it uses now plus that many bytes."""
    server = RedisServer(tmp_path / policy, port=free_port()).start()
    admin = server.plain()
    try:
        server.config_set("maxmemory-policy", policy)
        if headroom is not None:
            used = int(admin.info("memory")["used_memory"])
            server.config_set("maxmemory", str(used + headroom))
        yield server, admin
    finally:
        admin.close()
        server.stop()


def _uses(client: Any) -> dict[str, Callable[[], Any]]:
    def lock() -> None:
        with RedisLock(client, "order:o1", ttl=30, blocking_timeout=0,
                       observer=MemoryLockStats()):
            pass

    def slot() -> None:
        with ConcurrencyLimiter(client, "order", limit=1).hold("o1", blocking_timeout=0):
            pass

    return {
        "lock": lock,
        "slot": slot,
        "rate bucket": lambda: RateLimiter(client, "gateway", rate=1, burst=5).try_acquire(),
        "retry budget": lambda: RetryBudget(client).try_spend("gateway"),
    }


@pytest.mark.parametrize("policy", EVICTING)
def test_an_evicting_redis_is_refused_at_first_use_naming_the_policy_and_the_fix(
    tmp_path: Path, policy: str
) -> None:
    """Catches: locks, slots, rate buckets and the budget kept on a Redis whose policy can evict
    their keys (nothing in the code or the docs asked for noeviction)."""
    with private_redis(tmp_path, policy, headroom=4 * 1024 * 1024) as (server, _admin):
        client = redis_client(server.url)
        for what, use in _uses(client).items():
            with pytest.raises(EvictingRedis) as refused:
                use()
            message = str(refused.value)
            assert policy in message and "noeviction" in message, (what, message)
            assert "docs/locks.md" in message
            assert classify(refused.value) is ErrorClass.PERMANENT
        cache = StampedeCache(client, namespace="ev")  # a cache may lose entries: allowed
        assert cache.get_or_load("k", lambda: "v") == "v"


def test_the_check_costs_one_info_per_client(tmp_path: Path) -> None:
    """The first use per client asks ``INFO memory`` once; every later script call asks
    nothing more (catches a check on every call, a round trip on the hot path)."""
    with private_redis(tmp_path, "noeviction") as (server, admin):

        def info_calls() -> int:  # INFO's own call is counted after it answers
            return int(admin.info("commandstats").get("cmdstat_info", {}).get("calls", 0))

        client = redis_client(server.url)
        before = info_calls()
        for use in _uses(client).values():
            use()
        for _ in range(20):
            with RedisLock(client, "order:o2", ttl=5, observer=MemoryLockStats()):
                pass
        after = info_calls()
        assert after - before == 2  # the client's one check, and the read of `before`
        RetryBudget(redis_client(server.url)).try_spend("gateway")
        assert info_calls() - after == 2  # a new client checks once too


def test_what_eviction_does_to_locks_slots_and_buckets(tmp_path: Path) -> None:
    """The failure the refusal prevents, reproduced: clients that passed their check on a
    noeviction Redis keep working after the policy is changed to allkeys-lru under a small
    maxmemory; writing other keys then evicts a held lock, a held limit-1 slot and a drained
    bucket, and a second holder gets each. ``sekali doctor`` (``redis_eviction``) reports it;
    a client built after the change refuses at its first use."""
    with private_redis(tmp_path, "noeviction") as (server, admin):
        client = redis_client(server.url)
        held = RedisLock(client, "order:o1", ttl=60, auto_renew=False,
                         observer=MemoryLockStats())
        held.acquire()
        slots = ConcurrencyLimiter(client, "order", limit=1, auto_renew=False, lease=60)
        slot = slots.acquire("o1", blocking_timeout=0)
        bucket = RateLimiter(client, "gateway", rate=0.001, burst=5)
        granted_before = sum(bucket.try_acquire() for _ in range(10))
        assert granted_before == 5
        server.config_set("maxmemory-policy", "allkeys-lru")
        used = int(admin.info("memory")["used_memory"])
        server.config_set("maxmemory", str(used + 512 * 1024))
        written = 0
        while admin.exists(held.key) and written < 64 * 1024 * 1024:
            admin.set(f"filler:{written}", "x" * 8192)
            written += 8192
        for i in range(0, 4 * 1024 * 1024, 8192):  # keep going: the others are evicted too
            admin.set(f"more:{i}", "x" * 8192)
        second_lock = RedisLock(client, "order:o1", ttl=60, blocking_timeout=0,
                                observer=MemoryLockStats()).acquire()
        second_slot = slots.acquire("o1", blocking_timeout=0)
        granted_after = sum(bucket.try_acquire() for _ in range(10))
        print(f"allkeys-lru, maxmemory used+512KiB: the held lock's key went after "
              f"{written / 1024:.0f} KiB of other writes; then a second lock holder "
              f"(fence {second_lock.fence} > {held.fence}), a second holder of a limit-1 slot, "
              f"and {granted_after} more grants of a burst-5 bucket")
        assert second_lock.fence is not None and held.fence is not None
        assert second_lock.fence > held.fence  # the fence still orders them (refuses the stale)
        assert second_slot.token != slot.token
        assert granted_after == 5
        finding = check_redis_eviction(
            DiagnosisSetup(db=_unused_db(tmp_path), job_types=JOB_TYPES, lease_seconds=60,
                           redis=client)
        )
        assert not finding.passed and finding.severity == "ERROR"
        assert "allkeys-lru" in finding.found and "noeviction" in finding.fix
        with pytest.raises(EvictingRedis):
            _uses(redis_client(server.url))["lock"]()


def test_the_doctor_passes_a_noeviction_redis(tmp_path: Path) -> None:
    with private_redis(tmp_path, "noeviction", headroom=1024 * 1024) as (server, _admin):
        finding = check_redis_eviction(
            DiagnosisSetup(db=_unused_db(tmp_path), job_types=JOB_TYPES, lease_seconds=60,
                           redis=redis_client(server.url))
        )
    assert finding.passed and "noeviction" in finding.found


def _unused_db(tmp_path: Path) -> Database:
    return Database.from_url(f"sqlite:///{tmp_path / 'unused.db'}")
