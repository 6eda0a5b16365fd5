"""Invariant 4 across processes: 4 spawned processes x 50 threads on one key, real Redis."""

from __future__ import annotations

import multiprocessing
import time
from typing import Any

import pytest
import redis

from resources.cache import StampedeCache
from resources.cache.scripts import KeyLayout
from tests.cache_workers import calls_key, release_key, stampede_callers

pytestmark = pytest.mark.redis

PROCESSES = 4
THREADS = 50


def _start(redis_url: str, namespace: str, key: str, mode: str) -> tuple[list[Any], Any, Any]:
    ctx = multiprocessing.get_context("spawn")
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(
            target=stampede_callers,
            args=(redis_url, namespace, key, THREADS, mode, ready, go, out),
        )
        for _ in range(PROCESSES)
    ]
    for proc in procs:
        proc.start()
    for _ in procs:
        ready.get(timeout=120)
    return procs, go, out


def _collect(out: Any) -> list[Any]:
    results: list[Any] = []
    for _ in range(PROCESSES):
        results.extend(out.get(timeout=120))
    return results


def _join(procs: list[Any]) -> None:
    for proc in procs:
        proc.join(timeout=120)
        assert proc.exitcode == 0


def test_expired_key_is_loaded_once_by_200_callers_in_4_processes(
    redis_url: str, redis_client: redis.Redis, namespace: str
) -> None:
    """Catches any stampede: a second loader call anywhere, or a caller without the new value
    (a waiter that was never woken would report CacheLoadTimeout instead)."""
    key = "product:1"
    cache = StampedeCache.from_url(redis_url, namespace=namespace)
    cache.get_or_load(key, lambda: {"version": 1}, ttl=0.5, jitter=0.0)
    procs, go, out = _start(redis_url, namespace, key, "sleep")
    deadline = time.monotonic() + 30
    while redis_client.exists(KeyLayout.of(namespace, key).env):
        assert time.monotonic() < deadline, "the old value never expired"
        time.sleep(0.05)
    go.set()
    results = _collect(out)
    _join(procs)

    assert redis_client.get(calls_key(namespace)) == b"1"
    assert len(results) == PROCESSES * THREADS
    assert all(r == {"version": 2, "call": 1} for r in results), [
        r for r in results if r != {"version": 2, "call": 1}
    ][:3]
    stats = cache.stats()["product:*"]
    assert stats["loads"] == 2  # the seed write, then exactly one rebuild
    assert stats["misses"] == PROCESSES * THREADS + 1
    cache.close()


def test_stale_value_is_served_to_all_callers_while_exactly_one_refresh_runs(
    redis_url: str, redis_client: redis.Redis, namespace: str
) -> None:
    """The loader blocks until the parent releases it, and the parent releases it only after all
    200 callers have answered: a caller that waited for the loader would hang this test. Catches
    waiting on stale values and duplicate refreshes across processes."""
    key = "price:7"
    cache = StampedeCache.from_url(redis_url, namespace=namespace)
    cache.get_or_load(key, lambda: {"version": 1}, ttl=0.5, stale_ttl=600, jitter=0.0)
    envelope = cache.envelope(key)
    assert envelope is not None
    while time.time() < envelope.soft + 0.05:
        time.sleep(0.05)
    procs, go, out = _start(redis_url, namespace, key, "block")
    go.set()
    results = _collect(out)  # all answered while the one loader is still blocked
    assert len(results) == PROCESSES * THREADS
    wrong = [r for r in results if r != {"version": 1}]
    assert not wrong, wrong[:3]
    deadline = time.monotonic() + 30
    while redis_client.get(calls_key(namespace)) is None:  # the refresh starts in the background
        assert time.monotonic() < deadline, "no refresh ever started"
        time.sleep(0.02)
    time.sleep(0.5)  # room for a (wrong) second refresh to show up
    assert redis_client.get(calls_key(namespace)) == b"1"

    redis_client.lpush(release_key(namespace), "go")
    _join(procs)
    assert redis_client.get(calls_key(namespace)) == b"1"
    assert cache.get(key) == {"version": 2, "call": 1}
    stats = cache.stats()["price:*"]
    assert stats["stale_hits"] == PROCESSES * THREADS
    assert stats["waits"] == 0
    cache.close()
