"""The anti-stampede cache on a real Redis: single flight, errors, None, invalidation races, jitter,
XFetch, hot keys, stats and the Dagster resource. Time and randomness are injected where the
behaviour depends on them; no test asserts a speed."""

from __future__ import annotations

import math
import random
import statistics
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from resources.cache import NO_VALUE, StampedeCache, key_pattern
from resources.cache.core import xfetch_factor
from resources.cache.scripts import KeyLayout
from resources.dagster_resources import CacheResource
from resources.errors import CacheLoaderFailed, CacheLoadTimeout, TransientJobError
from sandbox.redis_server import RedisServer

pytestmark = pytest.mark.redis


class FakeClock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Counter:
    def __init__(self) -> None:
        self.n = 0
        self._lock = threading.Lock()

    def hit(self) -> int:
        with self._lock:
            self.n += 1
            return self.n


@pytest.fixture
def caches(redis_url: str, namespace: str, redis_client: redis.Redis) -> Iterator[Any]:
    made: list[StampedeCache] = []

    def make(**kwargs: Any) -> StampedeCache:
        cache = StampedeCache.from_url(redis_url, namespace=namespace, **kwargs)
        made.append(cache)
        return cache

    yield make
    for cache in made:
        cache.close()


def _run_threads(n: int, fn: Any) -> list[Any]:
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n

    def call(i: int) -> None:
        barrier.wait(timeout=30)
        try:
            results[i] = fn()
        except Exception as exc:  # noqa: BLE001 - collected for assertions
            results[i] = exc

    threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def _wait_until(predicate: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


# -- single flight, hits, None -------------------------------------------------------------------


def test_50_threads_in_one_process_share_one_load(caches: Any) -> None:
    """Catches a broken in-process flight: each thread would run its own load."""
    cache = caches()
    calls = Counter()

    def loader() -> dict[str, int]:
        calls.hit()
        time.sleep(0.2)
        return {"id": 1}

    results = _run_threads(50, lambda: cache.get_or_load("user:1", loader, ttl=60))
    assert calls.n == 1
    assert results == [{"id": 1}] * 50
    stats = cache.stats()["user:*"]
    assert stats["loads"] == 1 and stats["misses"] == 50
    assert stats["waits"] == 49 and stats["wait_time"] > 0


def test_50_cold_callers_in_one_process_share_one_get_and_one_connection(
    redis_server: RedisServer,
) -> None:
    """Catches a hit path that reads Redis before joining the key's flight: 50 callers of a
    cold key would each take a pooled connection and send their own GET before sharing the
    load. Counted by a private server (INFO: connections accepted, scripts run), not by the
    client."""
    admin = redis_server.client()
    cache = StampedeCache.from_url(redis_server.url, namespace="cold", stats_flush_interval=60)
    cache.get_or_load("warm", lambda: 0, ttl=60)  # scripts loaded, one pooled connection open
    redis_server.admin("CONFIG", "RESETSTAT")
    before = int(admin.info("stats")["total_connections_received"])
    calls = Counter()

    def loader() -> dict[str, int]:
        calls.hit()
        time.sleep(0.2)
        return {"id": 1}

    try:
        results = _run_threads(50, lambda: cache.get_or_load("user:1", loader, ttl=60))
        commands = admin.info("commandstats")
        connections = int(admin.info("stats")["total_connections_received"]) - before
    finally:
        cache.close()
    assert results == [{"id": 1}] * 50 and calls.n == 1
    assert commands["cmdstat_evalsha"]["calls"] == 2  # the leader's fetch and write scripts
    assert connections == 0  # the warm pooled connection served them all


def test_fresh_hit_does_not_call_the_loader(caches: Any) -> None:
    cache = caches()
    assert cache.get_or_load("k", lambda: [1, 2], ttl=60) == [1, 2]
    assert cache.get_or_load("k", lambda: pytest.fail("loader called on a hit"), ttl=60) == [1, 2]
    assert cache.stats()["k"]["hits"] == 1


def test_cached_none_is_a_value_not_a_miss(caches: Any) -> None:
    """Catches treating None as 'absent' (every call would reload)."""
    cache = caches()
    assert cache.get("missing") is NO_VALUE
    assert cache.get_or_load("none", lambda: None, ttl=60) is None
    assert cache.get_or_load("none", lambda: pytest.fail("reloaded a cached None"), ttl=60) is None
    assert cache.get("none") is None
    assert cache.get("none") is not NO_VALUE


# -- loader errors -------------------------------------------------------------------------------


def test_loader_error_reaches_all_in_process_callers_from_one_load(caches: Any) -> None:
    cache = caches()
    calls = Counter()

    def loader() -> None:
        calls.hit()
        time.sleep(0.2)
        raise ValueError("database down")

    results = _run_threads(50, lambda: cache.get_or_load("acct:1", loader, ttl=60))
    assert calls.n == 1
    assert all(isinstance(r, ValueError) and str(r) == "database down" for r in results)
    assert cache.stats()["acct:*"]["errors"] == 1
    # No negative cache by default: the next call loads again.
    assert cache.get_or_load("acct:1", lambda: "ok", ttl=60) == "ok"


def test_waiter_in_another_process_gets_the_failed_load_error(
    caches: Any, namespace: str, redis_client: redis.Redis
) -> None:
    """Two cache instances stand for two processes. Catches waiters that, on failure, sleep to
    their timeout or all retry the loader at once."""
    a, b = caches(), caches()
    entered, release = threading.Event(), threading.Event()
    b_calls = Counter()

    def failing() -> None:
        entered.set()
        release.wait(10)
        raise ConnectionError("replica lag")

    holder = threading.Thread(target=lambda: _swallow(lambda: a.get_or_load("q:1", failing, ttl=9)))
    holder.start()
    assert entered.wait(10)
    outcome: list[Any] = []
    waiter = threading.Thread(
        target=lambda: outcome.append(_swallow(lambda: b.get_or_load("q:1", b_calls.hit, ttl=9)))
    )
    waiter.start()
    waiters_key = KeyLayout.of(namespace, "q:1").waiters
    _wait_until(lambda: redis_client.get(waiters_key) == b"1")
    release.set()
    holder.join(10)
    waiter.join(10)
    assert b_calls.n == 0
    assert isinstance(outcome[0], CacheLoaderFailed)
    assert isinstance(outcome[0], TransientJobError)
    assert outcome[0].error_class == "ConnectionError" and outcome[0].key == "q:1"


def test_negative_cache_answers_failures_without_loading(caches: Any) -> None:
    cache = caches(negative_ttl=30)
    calls = Counter()

    def failing() -> None:
        calls.hit()
        raise KeyError("gone")

    with pytest.raises(KeyError):
        cache.get_or_load("neg:1", failing, ttl=60)
    for _ in range(5):
        with pytest.raises(CacheLoaderFailed) as info:
            cache.get_or_load("neg:1", failing, ttl=60)
        assert info.value.error_class == "KeyError"
    assert calls.n == 1
    cache.invalidate("neg:1")
    assert cache.get_or_load("neg:1", lambda: "back", ttl=60) == "back"


def test_failed_refresh_keeps_the_stale_value_and_backs_off(caches: Any) -> None:
    """Stale-if-error: a failing refresh neither removes the stale value nor reruns per call."""
    clock = FakeClock()
    cache = caches(clock=clock, error_backoff=60)
    cache.get_or_load("cfg:1", lambda: "v1", ttl=10, stale_ttl=3600, jitter=0)
    clock.advance(20)
    calls = Counter()

    def failing() -> str:
        calls.hit()
        raise RuntimeError("boom")

    for _ in range(20):
        assert cache.get_or_load("cfg:1", failing, ttl=10, stale_ttl=3600) == "v1"
        cache.wait_for_refreshes(10)
    assert calls.n == 1
    stats = cache.stats()["cfg:*"]
    assert stats["stale_hits"] == 20 and stats["errors"] == 1


# -- bounded waits -------------------------------------------------------------------------------


def test_waiter_times_out_with_a_clear_error_when_the_holder_is_stuck(caches: Any) -> None:
    a, b = caches(), caches(wait_timeout=0.5, safety_tick=0.2)
    entered, release = threading.Event(), threading.Event()

    def stuck() -> str:
        entered.set()
        release.wait(20)
        return "late"

    holder = threading.Thread(target=lambda: a.get_or_load("slow:1", stuck, ttl=60))
    holder.start()
    assert entered.wait(10)
    with pytest.raises(CacheLoadTimeout) as info:
        b.get_or_load("slow:1", lambda: pytest.fail("second loader"), ttl=60)
    assert info.value.key == "slow:1" and info.value.waited >= 0.5
    release.set()
    holder.join(10)
    assert b.get_or_load("slow:1", lambda: pytest.fail("reloaded"), ttl=60) == "late"


def test_a_waiter_in_another_process_gets_the_value_from_its_wake_up(
    caches: Any, namespace: str, redis_client: redis.Redis
) -> None:
    """Catches a waiter that needs another round trip (and the holder's decode) before it can
    return: the wake-up pushed by the holder's write carries the stored envelope, so the waiter
    runs the fetch script once (to register) and returns the value from the push. A leftover
    wake-up of an older rebuild (another token, an outdated value) is never taken for it."""
    holder_cache, waiter_cache = caches(), caches(safety_tick=5)
    layout = KeyLayout.of(namespace, "w:1")
    old = '{"s":1.0,"h":9e99,"d":0.0,"n":0,"t":1.0,"st":0.0,"v":"outdated"}'
    redis_client.lpush(layout.signal, f"an-older-holder {old}")
    fetches = Counter()
    script = waiter_cache._fetch

    def counted(*args: Any, **kwargs: Any) -> Any:
        fetches.hit()
        return script(*args, **kwargs)

    waiter_cache._fetch = counted  # type: ignore[method-assign]

    def race() -> None:
        started = threading.Event()

        def slow() -> str:
            started.set()
            time.sleep(0.5)
            return "fresh"

        holder = threading.Thread(target=lambda: holder_cache.get_or_load("w:1", slow, ttl=60))
        holder.start()
        started.wait(10)
        assert waiter_cache.get_or_load("w:1", lambda: "second load", ttl=60) == "fresh"
        holder.join(10)

    race()
    assert fetches.n == 2  # registered, met the leftover (another holder's), registered again
    redis_client.delete(layout.env, layout.signal)
    fetches.n = 0
    race()
    assert fetches.n == 1  # registered once; the value came with the wake-up


def test_dead_holder_lock_expires_and_a_waiter_takes_over(
    caches: Any, namespace: str, redis_client: redis.Redis
) -> None:
    """A holder killed mid-load leaves its lock; it expires (lock_ttl) and the next bounded
    attempt of a waiter loads once."""
    cache = caches(wait_timeout=20, safety_tick=0.2)
    redis_client.set(KeyLayout.of(namespace, "dead:1").lock, "crashed-holder", px=600)
    calls = Counter()
    assert cache.get_or_load("dead:1", lambda: calls.hit(), ttl=60) == 1
    assert calls.n == 1


# -- invalidation --------------------------------------------------------------------------------


def test_invalidation_during_a_slow_rebuild_never_leaves_the_older_value(caches: Any) -> None:
    """The timeline of resources/cache_core.py: without the version check the rebuild would
    store v1 after the invalidation and serve it until the TTL ran out."""
    a, b = caches(), caches()
    db = {"row": "v1"}
    entered, release = threading.Event(), threading.Event()

    def slow_loader() -> str:
        value = db["row"]
        entered.set()
        release.wait(10)
        return value

    got: list[Any] = []
    rebuild = threading.Thread(
        target=lambda: got.append(a.get_or_load("inv:1", slow_loader, ttl=600))
    )
    rebuild.start()
    assert entered.wait(10)
    db["row"] = "v2"  # the commit ...
    b.invalidate("inv:1")  # ... then the invalidation
    release.set()
    rebuild.join(10)
    assert got == ["v1"]  # the overlapping read may see the old row; the cache may not keep it
    assert b.get("inv:1") is NO_VALUE
    assert b.get_or_load("inv:1", lambda: db["row"], ttl=600) == "v2"


def test_invalidation_during_a_stale_refresh_never_leaves_the_older_value(caches: Any) -> None:
    clock = FakeClock()
    cache = caches(clock=clock)
    db = {"row": "v1"}
    cache.get_or_load("inv:2", lambda: db["row"], ttl=10, stale_ttl=600, jitter=0)
    clock.advance(11)
    entered, release = threading.Event(), threading.Event()

    def slow_loader() -> str:
        value = db["row"]
        entered.set()
        release.wait(10)
        return value

    assert cache.get_or_load("inv:2", slow_loader, ttl=10, stale_ttl=600) == "v1"
    assert entered.wait(10)
    db["row"] = "v2"
    cache.invalidate("inv:2")
    release.set()
    cache.wait_for_refreshes(10)
    assert cache.get("inv:2") is NO_VALUE
    assert cache.get_or_load("inv:2", lambda: db["row"], ttl=10) == "v2"


def test_racing_rebuilds_and_invalidations_never_keep_an_outdated_row(caches: Any) -> None:
    """Many rounds with random timing: after each round the cache is empty or holds the row as
    committed last (never one read before the last invalidation)."""
    a, b = caches(), caches()
    rng = random.Random(4)
    db = {"row": 0}
    for round_ in range(25):

        def loader() -> int:
            value = db["row"]
            time.sleep(rng.random() * 0.02)
            return value

        threads = [
            threading.Thread(target=lambda c=c: c.get_or_load("race:1", loader, ttl=600))
            for c in (a, b, a)
        ]
        for t in threads:
            t.start()
        time.sleep(rng.random() * 0.02)
        db["row"] = round_ + 1
        b.invalidate("race:1")
        for t in threads:
            t.join(10)
        assert a.get("race:1") in (NO_VALUE, db["row"])


# -- jitter and XFetch ---------------------------------------------------------------------------


def test_jitter_spreads_expiries_uniformly_within_ten_percent(caches: Any) -> None:
    """1,000 keys written at one instant with one TTL. Catches missing jitter (all expire in the
    same second) and a wrong spread (outside +/-10%, or not uniform)."""
    clock = FakeClock()
    jittered = caches(clock=clock, random=random.Random(7).random)
    flat = caches(clock=clock)
    softs = []
    for i in range(1000):
        jittered.get_or_load(f"j:{i}", lambda i=i: i, ttl=100)
        envelope = jittered.envelope(f"j:{i}")
        assert envelope is not None
        softs.append(envelope.hard - clock.now)  # stale_ttl 0: the expiry
    assert min(softs) >= 90 and max(softs) <= 110
    assert abs(statistics.pstdev(softs) - 20 / math.sqrt(12)) < 0.6  # uniform(90, 110)
    bins = [0] * 10
    for s in softs:
        bins[min(9, int((s - 90) / 2))] += 1
    assert all(60 <= b <= 140 for b in bins), bins
    assert max(bins) / (sum(bins) / len(bins)) < 1.5

    flat.get_or_load("flat:1", lambda: 1, ttl=100, jitter=0)
    envelope = flat.envelope("flat:1")
    assert envelope is not None and envelope.hard - clock.now == 100


def test_a_cohort_loaded_together_comes_due_at_an_even_rate(caches: Any) -> None:
    """1,000 keys loaded on misses at one instant (a cold start). Catches the first expiry wave
    of such a cohort (every refresh due within +/-jitter of one TTL): with the defaults each
    key's first refresh point is spread uniformly over its TTL, while the value stays served
    until its (jittered) expiry, and a read past the refresh point gets the value at once while
    one background refresh stores it again with the usual TTL."""
    clock = FakeClock()
    cache = caches(clock=clock, random=random.Random(7).random)
    loads: list[int] = []

    def loader(i: int) -> Any:
        return lambda: loads.append(i) or i

    points, offsets = [], []
    for i in range(1000):
        cache.get_or_load(f"c:{i}", loader(i), ttl=100)
        envelope = cache.envelope(f"c:{i}")
        assert envelope is not None and 90 <= envelope.hard - clock.now <= 110
        offsets.append(envelope.soft - clock.now)
        points.append(offsets[-1] / (envelope.hard - clock.now))
    bins = [0] * 10
    for p in points:
        bins[min(9, int(p * 10))] += 1
    assert all(60 <= b <= 140 for b in bins), bins  # uniform over the TTL, not a wave at its end

    due = min(range(1000), key=lambda i: offsets[i])
    clock.advance(offsets[due] + 0.001)  # past its refresh point, long before any expiry
    loads.clear()
    assert cache.get_or_load(f"c:{due}", loader(due), ttl=100) == due  # answered at once
    cache.wait_for_refreshes(timeout=10)
    assert loads == [due]
    refreshed = cache.envelope(f"c:{due}")
    assert refreshed is not None and 90 <= refreshed.soft - clock.now <= 110  # the usual TTL


@pytest.mark.parametrize("beta", [0.5, 1.0, 2.0])
def test_xfetch_probability_follows_exp_minus_gap_over_beta_delta(beta: float) -> None:
    rng = random.Random(11)
    delta = 2.0
    for gap in (0.2, 1.0, 3.0, 6.0):
        n = 20_000
        early = sum(delta * xfetch_factor(beta, 1.0 - rng.random()) >= gap for _ in range(n))
        assert abs(early / n - math.exp(-gap / (beta * delta))) < 0.015
    assert xfetch_factor(0.0, 0.5) == 0.0


def test_xfetch_recomputes_early_through_redis_with_the_expected_shape(caches: Any) -> None:
    """End to end through the fetch script: with delta = 2 s and beta = 1, a read ``gap``
    seconds before expiry refreshes with probability exp(-gap / 2); beta = 0 never does."""
    clock = FakeClock()
    rng = random.Random(3)
    cache = caches(clock=clock, random=rng.random, beta=1.0)
    never = caches(clock=clock, random=rng.random, beta=0.0)
    refreshes = Counter()
    n = 150
    rates = []
    for gap, label in ((0.5, "half"), (2.0, "two"), (6.0, "six")):
        before = refreshes.n
        for i in range(n):
            key = f"{label}:{i}"

            def compute(i: int = i) -> int:
                clock.advance(2.0)  # the compute time XFetch scales with
                return i

            cache.get_or_load(key, compute, ttl=100, jitter=0)
            envelope = cache.envelope(key)
            assert envelope is not None and envelope.delta == 2.0
            clock.now = envelope.soft - gap
            assert never.get_or_load(key, lambda: pytest.fail("beta=0 refreshed"), ttl=100) == i
            assert cache.get_or_load(key, lambda: refreshes.hit() and -1, ttl=100, jitter=0) == i
            cache.wait_for_refreshes(10)
        rates.append((refreshes.n - before) / n)
    expected = [math.exp(-g / 2.0) for g in (0.5, 2.0, 6.0)]
    for rate, p in zip(rates, expected, strict=True):
        assert abs(rate - p) < 4 * math.sqrt(p * (1 - p) / n) + 0.01, (rates, expected)
    assert rates[0] > rates[1] > rates[2]
    assert cache.stats()["half:*"]["early_refreshes"] == round(rates[0] * n)


# -- refresh, hot keys, stats --------------------------------------------------------------------


def test_refresh_rebuilds_now_and_reuses_the_stored_ttl(caches: Any) -> None:
    clock = FakeClock()
    cache = caches(clock=clock)
    cache.get_or_load("r:1", lambda: "v1", ttl=50, stale_ttl=5, jitter=0)
    assert cache.refresh("r:1", lambda: "v2", jitter=0) == "v2"
    envelope = cache.envelope("r:1")
    assert envelope is not None
    assert (envelope.value, envelope.ttl, envelope.stale_ttl) == ("v2", 50, 5)
    assert envelope.soft == clock.now + 50
    assert cache.refresh("r:1", lambda: "v3", ttl=7, jitter=0) == "v3"
    assert cache.envelope("r:1").ttl == 7  # type: ignore[union-attr]


def test_concurrent_refreshes_run_one_loader(caches: Any) -> None:
    a, b = caches(), caches()
    a.get_or_load("r:2", lambda: 0, ttl=60)
    calls = Counter()

    def loader() -> int:
        time.sleep(0.2)
        return calls.hit()

    results = _run_threads(
        20, lambda: (a if threading.get_ident() % 2 else b).refresh("r:2", loader)
    )
    assert calls.n == 1
    assert set(results) <= {0, 1}
    assert a.get("r:2") == 1


def test_hot_keys_rank_by_decayed_access_counts(caches: Any) -> None:
    clock = FakeClock()
    cache = caches(clock=clock, hot_half_life=10)
    for key, n in (("h:a", 30), ("h:b", 10), ("h:c", 1)):
        for _ in range(n):
            cache.get_or_load(key, lambda: 1, ttl=600)
    top = cache.hot_keys(2)
    assert [k for k, _ in top] == ["h:a", "h:b"] and top[0][1] == 30
    clock.advance(10)
    assert cache.recorder.decay() == 1
    assert dict(cache.hot_keys(3)) == {"h:a": 15, "h:b": 5, "h:c": 0.5}


def test_stats_are_shared_per_pattern_across_instances(caches: Any) -> None:
    a, b = caches(), caches(stats_flush_interval=3600)
    a.get_or_load("order:1", lambda: 1, ttl=60)
    b.get_or_load("order:1", lambda: 2, ttl=60)
    b.get_or_load("order:2", lambda: 2, ttl=60)
    assert a.stats()["order:*"]["hits"] == 0  # b's counts stay local until it flushes
    b.flush_stats()
    stats = a.stats()
    assert stats["order:*"]["misses"] == 2 and stats["order:*"]["hits"] == 1
    assert stats["order:*"]["loads"] == 2
    assert key_pattern("a:b:c") == "a:*:*" and key_pattern("plain") == "plain"
    assert key_pattern("user:42:orders") == "user:*:*"  # ids mid-key do not multiply stats


# -- the Dagster resource ------------------------------------------------------------------------


def test_resource_builds_lazily_from_settings(
    redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")  # nothing listens: must not be dialled
    resource = CacheResource(namespace=namespace, ttl=30)
    assert resource._built is None
    monkeypatch.setenv("REDIS_URL", redis_url)
    cache = resource.get_cache()
    assert cache is resource.get_cache() and cache.ttl == 30
    assert cache.get_or_load("res:1", lambda: "ok") == "ok"
    resource.teardown_after_execution(None)


def _swallow(fn: Any) -> Any:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        return exc


# -- regressions from review ---------------------------------------------------------------------


def test_a_queued_refresh_that_finds_the_value_gone_loads_instead_of_holding_the_lock(
    caches: Any,
) -> None:
    """Catches a background refresh that, finding the envelope invalidated (or hard-expired)
    while it waited in the pool, took the rebuild lock and returned without loading: every
    reader in every process then waited on a lock nobody released until it expired."""
    clock = FakeClock()
    cache = caches(clock=clock, lock_ttl=30, refresh_workers=1)
    cache.get_or_load("rep:1", lambda: "v1", ttl=10, stale_ttl=3600, jitter=0)
    clock.advance(20)  # soft-expired, within the stale window
    gate = threading.Event()
    cache._pool.submit(gate.wait, 10)  # the one refresh worker is busy: the job queues
    calls = Counter()

    def loader() -> str:
        calls.hit()
        return "v2"

    assert cache.get_or_load("rep:1", loader, ttl=10, stale_ttl=3600) == "v1"
    cache.invalidate("rep:1")  # a commit invalidates K before the queued refresh runs
    gate.set()
    cache.wait_for_refreshes(10)
    other = caches(clock=clock, wait_timeout=3)  # another process: must not wait on the lock
    assert other.get_or_load("rep:1", loader, ttl=10) == "v2"
    assert calls.n == 1


def test_refresh_that_waited_on_a_readers_rebuild_does_not_load_again(caches: Any) -> None:
    """Catches ``refresh`` staying forced after waiting: the warming schedule and a reader
    missing at the same moment made two loader calls for one expiry."""
    reader, warmer = caches(), caches()  # two instances: no shared in-process flight
    started, release = threading.Event(), threading.Event()
    calls = Counter()

    def slow() -> dict[str, int]:
        calls.hit()
        started.set()
        release.wait(10)
        return {"v": 1}

    def second() -> dict[str, int]:
        calls.hit()
        return {"v": 2}

    got: list[Any] = []
    refreshed: list[Any] = []
    t1 = threading.Thread(target=lambda: got.append(reader.get_or_load("rep:2", slow, ttl=60)))
    t1.start()
    assert started.wait(10)
    t2 = threading.Thread(target=lambda: refreshed.append(warmer.refresh("rep:2", second, ttl=60)))
    t2.start()
    time.sleep(0.3)  # the warmer is now waiting on the reader's rebuild lock
    release.set()
    t1.join(15)
    t2.join(15)
    assert calls.n == 1
    assert got == [{"v": 1}] and refreshed == [{"v": 1}]


def test_invalidation_versions_never_repeat_after_the_version_key_expires(
    caches: Any, redis_client: redis.Redis
) -> None:
    """Catches INCR restarting at 1 once the version key expired: a rebuild that had read the
    earlier "1" would pass the version check and store its older value over the invalidation."""
    cache = caches()
    first = cache.invalidate("rep:3")
    redis_client.delete(KeyLayout.of(cache.namespace, "rep:3").ver)  # as if it expired
    second = cache.invalidate("rep:3")
    assert second != first and second > 1
    assert cache.invalidate("rep:3") > second  # and it still counts up from there
