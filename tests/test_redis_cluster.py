"""sekali on a real Redis Cluster (three masters started by the tests): ``REDIS_URL`` names the
cluster, the client honours the explicit timeouts on every node, and every defence's scripts
keep their keys in one slot, whatever the name. The lock, fence, cache, flow-control and budget
test modules run on the same kind of cluster in CI's second pass
(``SEKALI_TEST_REDIS_CLUSTER=true``)."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
from redis.cluster import RedisCluster, key_slot

from resources.cache import StampedeCache
from resources.cache.scripts import KeyLayout
from resources.errors import LockNotAcquired, StoreUnavailable
from resources.flow import ConcurrencyLimiter, LimitNotAcquired, RateLimiter
from resources.locks import MemoryLockStats, RedisLock
from resources.retry import RetryBudget
from resources.storage.redis import client_timeouts, hash_tag, redis_client
from resources.storage.settings import RedisTimeouts
from sandbox.redis_cluster import LocalRedisCluster

NAMES = ["order:o-1", "}starts-with-a-brace", "a{b}c", "{", "}", "%25", "😀 {x}"]
"""Names a key's hash tag must survive: plain, braces anywhere, a leading ``}`` (an empty tag
without :func:`hash_tag`), a leading ``%``, non-ASCII."""


def test_a_cluster_url_builds_a_cluster_client_with_the_explicit_timeouts(
    redis_cluster: LocalRedisCluster,
) -> None:
    """Catches: ``REDIS_URL`` unable to name a cluster, and a cluster client without our bounds
    (redis-py's default socket timeout is none before 8, and the cluster client retries 3
    times, multiplying the bound)."""
    bounds = RedisTimeouts(socket=1.5, connect=0.7, health_check_interval=0)
    client = redis_client(redis_cluster.url, timeouts=bounds)
    assert isinstance(client, RedisCluster)
    assert client.ping()
    assert client_timeouts(client) == bounds
    nodes = client.get_nodes()
    assert len(nodes) == 3
    for node in nodes:
        assert node.redis_connection is not None
        kwargs = node.redis_connection.connection_pool.connection_kwargs
        assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"]) == (1.5, 0.7)
    assert client.retry.get_retries() == 0


def test_every_scripts_keys_land_in_one_slot_whatever_the_name(
    redis_cluster: LocalRedisCluster,
) -> None:
    """Catches: a script whose KEYS (or the keys it derives, the wake-up lists) hash to two
    slots: CROSSSLOT on a cluster. A name that starts with ``}`` made the tag empty."""
    client = redis_client(redis_cluster.url)
    for name in NAMES:
        lock = RedisLock(client, name, ttl=5, observer=MemoryLockStats())
        limiter = ConcurrencyLimiter(client, name, limit=1)
        layout = KeyLayout.of("ns", name)
        groups = {
            "lock": [*lock._keys, lock._signal_prefix + "token"],
            "slot": [*limiter.redis_keys(name), limiter.redis_keys(name)[0] + ":signal:t"],
            "cache": [layout.env, layout.lock, layout.ver, layout.waiters, layout.signal,
                      layout.err, layout.neg],
        }
        for what, keys in groups.items():
            slots = {key_slot(k.encode()) for k in keys}
            assert len(slots) == 1, (name, what, keys)
    assert hash_tag("plain") == "plain" and hash_tag("}x") == "%}x" and hash_tag("%x") == "%%x"


def test_every_defence_works_on_a_cluster_client(redis_cluster: LocalRedisCluster) -> None:
    """Catches: ``RedisLock`` and ``StampedeCache`` failing on a cluster client with
    AttributeError (``client.connection_pool``), and scripts that cannot run there."""
    client = redis_client(redis_cluster.url)
    for i, name in enumerate(NAMES):
        ns = f"c{os.getpid()}-{i}-{time.monotonic_ns()}"
        held = RedisLock(client, f"{ns}:{name}", ttl=5, observer=MemoryLockStats())
        with held, pytest.raises(LockNotAcquired):
            RedisLock(client, f"{ns}:{name}", ttl=5, blocking_timeout=0,
                      observer=MemoryLockStats()).acquire()
        with RedisLock(client, f"{ns}:{name}", ttl=5, observer=MemoryLockStats()) as again:
            assert again.fence is not None and held.fence is not None
            assert again.fence > held.fence
        limiter = ConcurrencyLimiter(client, ns, limit=1)
        with limiter.hold(name), pytest.raises(LimitNotAcquired):
            limiter.acquire(name, blocking_timeout=0)
        assert limiter.holders(name) == 0
        rate = RateLimiter(client, f"{ns}:{name}", rate=0.001, burst=3)
        assert sum(rate.try_acquire() for _ in range(6)) == 3
        budget = RetryBudget(client, capacity=2, namespace=ns)
        assert [budget.try_spend(name) for _ in range(3)] == [True, True, False]
        cache = StampedeCache(client, namespace=ns)
        loads = []
        barrier = threading.Barrier(8)

        def read(cache: StampedeCache = cache, barrier: threading.Barrier = barrier,
                 name: str = name, loads: list[int] = loads) -> None:
            barrier.wait(10)
            assert cache.get_or_load(name, lambda: loads.append(1) or "v", ttl=30) == "v"

        threads = [threading.Thread(target=read) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert loads == [1]


def test_a_frozen_cluster_node_fails_a_command_within_the_bound(tmp_path: Path) -> None:
    """Catches: a cluster client without the explicit bounds, which waits on a node that
    stopped answering (SIGSTOP: the kernel still accepts and acknowledges) far longer than
    ``connect + socket``."""
    cluster = LocalRedisCluster(tmp_path / "frozen", node_timeout_ms=15000).start()
    try:
        bounds = RedisTimeouts(socket=1.0, connect=1.0, health_check_interval=0)
        client = redis_client(cluster.url, timeouts=bounds)
        name = "order:frozen"
        with RedisLock(client, name, ttl=5, observer=MemoryLockStats()):
            pass
        owner = cluster.servers[
            cluster.ports.index(
                int(client.get_node_from_key(f"sekali:lock:{{{name}}}").port)
            )
        ]
        assert owner.process is not None
        os.kill(owner.process.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                RedisLock(client, name, ttl=5, blocking_timeout=0,
                          observer=MemoryLockStats()).acquire()
            took = time.monotonic() - started
        finally:
            os.kill(owner.process.pid, signal.SIGCONT)
        assert took < bounds.bound + 2.0, f"took {took:.1f}s, bound {bounds.bound}s"
    finally:
        cluster.stop()
