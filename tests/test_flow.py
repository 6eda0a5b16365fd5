"""Concurrency and rate limits against the real Redis, with real processes and real signals.

Each test's docstring names the regression it would catch.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from benchmarks.flow import KEYS, gauge_keys, take_slots, take_tokens
from resources.errors import LockLost, TransientJobError, ValidationError
from resources.flow import (
    ConcurrencyLimiter,
    LimitNotAcquired,
    RateLimited,
    RateLimiter,
    RateLimits,
    RateSetting,
)
from resources.retry import ErrorClass, classify
from resources.retry.classify import is_contention
from tests import flow_workers

FORK = multiprocessing.get_context("forkserver")
FORK.set_forkserver_preload(["resources.flow", "benchmarks.flow", "tests.flow_workers"])
"""Children fork from a server that imported the flow code once (a spawn costs ~1.5 s)."""


@pytest.fixture
def processes() -> Iterator[list[Any]]:
    """Processes a test starts; any still alive at the end are killed."""
    started: list[Any] = []
    yield started
    for proc in started:
        if proc.is_alive():
            proc.kill()
        proc.join(10)


def start(processes: list[Any], target: Any, *args: Any) -> Any:
    proc = FORK.Process(target=target, args=args)
    proc.start()
    processes.append(proc)
    return proc


def wait_until(condition: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


# -- concurrency limits ------------------------------------------------------------------------


def test_limit_never_exceeded_4_processes_x_3_threads_on_2_keys(
    redis_url: str, redis_client: redis.Redis, namespace: str, processes: list[Any]
) -> None:
    """12 workers in 4 processes take slots of 2 keys (limit 2) and count themselves inside.

    Catches a count and a grant that are not one atomic step (two callers both take the last
    slot), and fences that repeat or go back within a key."""
    limit, procs, threads, rounds = 2, 4, 3, 12
    barrier = FORK.Barrier(procs)
    out = FORK.Queue()
    for _ in range(procs):
        start(processes, take_slots, redis_url, namespace, limit, threads, rounds, None, 0.004,
              barrier, out)
    results = [out.get(timeout=120) for _ in range(procs)]
    assert [e for r in results for e in r["errors"]] == []
    per_thread = [grants for r in results for grants in r["grants"]]
    for key in KEYS:
        most = int(redis_client.get(gauge_keys(namespace, key)[1]) or 0)
        assert most == limit, f"{key}: {most} holders at once with limit {limit}"
        seen = [[fence for k, fence, _ in grants if k == key] for grants in per_thread]
        fences = [f for fs in seen for f in fs]
        assert len(fences) == len(set(fences)) == procs * threads * rounds // len(KEYS)
        assert all(fs == sorted(fs) for fs in seen), "a key's fences went back"
    assert ConcurrencyLimiter(redis_client, namespace, limit=limit).holders(KEYS[0]) == 0


def test_a_saturated_key_never_blocks_another_key(
    redis_url: str, redis_client: redis.Redis, namespace: str, processes: list[Any]
) -> None:
    """One process holds both slots of "hot" and two more wait in its queue; "cold" keys are
    granted at once. Catches a queue or a lock shared by the keys of one limiter."""
    out = FORK.Queue()
    start(processes, flow_workers.hold_forever, redis_url, namespace, "hot", 2, 10.0, 2, out)
    out.get(timeout=60)
    limiter = ConcurrencyLimiter(redis_client, namespace, limit=2)
    for ident in range(2):
        start(processes, flow_workers.queue_and_record, redis_url, namespace, "hot", 2, ident,
              f"{namespace}:order")
    wait_until(lambda: limiter.waiting("hot") == 2)
    for i in range(20):
        with limiter.hold(f"cold-{i}", blocking_timeout=0.5) as slot:
            assert limiter.holders(f"cold-{i}") == 1 and slot.fence > 0
    with pytest.raises(LimitNotAcquired) as info:
        limiter.acquire("hot", blocking_timeout=0.2)
    assert (info.value.key, info.value.limit) == ("hot", 2)
    assert limiter.holders("hot") == 2


def test_waiters_of_one_key_are_served_in_arrival_order(
    redis_url: str, redis_client: redis.Redis, namespace: str, processes: list[Any]
) -> None:
    """Four processes queue one after another behind a holder; on release they get the slot
    in that order. Catches a barging wait (whoever polls first wins) and a release that does
    not wake the head of the queue."""
    limiter = ConcurrencyLimiter(redis_client, namespace, limit=1)
    order_key = f"{namespace}:order"
    holder = limiter.acquire("k")
    for ident in range(4):
        start(processes, flow_workers.queue_and_record, redis_url, namespace, "k", 1, ident,
              order_key)
        wait_until(lambda n=ident + 1: limiter.waiting("k") == n)
    holder.release()
    wait_until(lambda: redis_client.llen(order_key) == 4)
    assert [int(x) for x in redis_client.lrange(order_key, 0, -1)] == [0, 1, 2, 3]


def test_a_waiter_is_woken_by_release_not_by_polling(
    redis_client: redis.Redis, namespace: str
) -> None:
    """With a 60 s lease and a 60 s queue poll, only the release's wake-up can hand the slot
    over within the waiter's 10 s. Catches a release that does not signal the waiters."""
    limiter = ConcurrencyLimiter(redis_client, namespace, limit=1, lease=60, queue_ttl=60)
    holder = limiter.acquire("k")
    got: list[int] = []

    def wait() -> None:
        with limiter.hold("k", blocking_timeout=10) as slot:
            got.append(slot.fence)

    thread = threading.Thread(target=wait)
    thread.start()
    wait_until(lambda: limiter.waiting("k") == 1)
    holder.release()
    thread.join(30)
    assert got == [holder.fence + 1]


def test_a_live_holder_is_renewed_and_a_killed_one_is_freed_by_its_lease(
    redis_url: str, redis_client: redis.Redis, namespace: str, processes: list[Any]
) -> None:
    """Limit 2, 1 s leases: a process and this test each hold a slot; after 2.5 s both are
    still held (renewal). The process is SIGKILLed; a waiter gets its slot after the lease,
    with a higher fence, while this test's slot stays held. Catches a slot that expires under
    a live holder, and a dead holder's slot kept alive by the other holder's renewals."""
    out = FORK.Queue()
    proc = start(processes, flow_workers.hold_forever, redis_url, namespace, "k", 2, 1.0, 1, out)
    [fence] = out.get(timeout=60)
    limiter = ConcurrencyLimiter(redis_client, namespace, limit=2, lease=1.0)
    with limiter.hold("k", blocking_timeout=5) as mine:
        time.sleep(2.5)
        with pytest.raises(LimitNotAcquired):
            limiter.acquire("k", blocking_timeout=0)
        assert limiter.holders("k") == 2
        os.kill(proc.pid, signal.SIGKILL)
        with limiter.hold("k", blocking_timeout=20) as slot:
            assert slot.fence > max(fence, mine.fence)
            mine.check()
            slot.check()


def test_fences_grow_per_key_and_a_stale_holder_is_told(
    redis_client: redis.Redis, namespace: str
) -> None:
    """Limit 2: a renewed holder keeps the key alive while a stalled one (no renewal) outlives
    its lease. Catches a stale holder that still passes check() or whose release reports
    success, an expired slot that still counts, and a fence that repeats."""
    limiter = ConcurrencyLimiter(redis_client, namespace, limit=2, lease=0.3)
    stalled = ConcurrencyLimiter(redis_client, namespace, limit=2, lease=0.3, auto_renew=False)
    live = limiter.acquire("k")
    stale = stalled.acquire("k")
    time.sleep(0.6)
    with pytest.raises(LockLost):
        stale.check()
    assert stale.release() is False
    assert limiter.holders("k") == 1
    with limiter.hold("k", blocking_timeout=0) as second:
        assert second.fence > stale.fence > live.fence
        live.check()
    assert live.release() is True
    third = limiter.acquire("k", blocking_timeout=0)
    assert third.fence > second.fence
    third.release()


def test_limit_errors_are_transient_contention() -> None:
    """Catches a limit or rate refusal that spends retry budget or is never retried."""
    for exc in (LimitNotAcquired("n", "k", 2, 0.5), RateLimited("n", retry_after=0.25)):
        assert classify(exc) is ErrorClass.TRANSIENT
        assert is_contention(exc)
    assert RateLimited("n", retry_after=0.25).retry_after == 0.25


# -- rate limits ---------------------------------------------------------------------------------


def test_rate_across_4_processes_is_within_5_percent_of_rate_times_time_plus_burst(
    redis_url: str, namespace: str, processes: list[Any]
) -> None:
    """Four processes call acquire() flat out for 2 s at 40/s, burst 10: the grants whose turn
    fell in the window number 10 + 40 * 2 within 5 %. Catches a bucket refilled by client
    clocks or not atomically (too many), and waiters that poll and miss turns (too few)."""
    rate, burst, seconds, procs = 40.0, 10.0, 2.0, 4
    barrier = FORK.Barrier(procs)
    out = FORK.Queue()
    for _ in range(procs):
        start(processes, take_tokens, redis_url, namespace, rate, burst, seconds + 0.5, barrier,
              out)
    grants = sorted(g for _ in range(procs) for g in out.get(timeout=120)["turns"])
    window = [g for g in grants if g <= grants[0] + seconds]
    expected = burst + rate * seconds
    assert abs(len(window) - expected) <= 0.05 * expected, (len(window), expected)


def test_try_acquire_refuses_when_empty_and_rate_limited_carries_retry_after(
    redis_client: redis.Redis, namespace: str
) -> None:
    """Catches try_acquire taking tokens that are not there, and a refusal that reserves a
    turn anyway or gives no usable retry_after."""
    limiter = RateLimiter(redis_client, namespace, rate=2.0, burst=3)
    assert [limiter.try_acquire() for _ in range(4)] == [True, True, True, False]
    with pytest.raises(RateLimited) as info:
        limiter.acquire(blocking_timeout=0.1)
    assert 0.3 < info.value.retry_after <= 0.5
    assert limiter.state().tokens >= 0  # nothing was reserved by the refusal
    with pytest.raises(ValueError):
        limiter.try_acquire(cost=4)  # more than the bucket can ever hold


def test_acquire_reserves_turns_in_order(redis_client: redis.Redis, namespace: str) -> None:
    """Three callers on an empty bucket at 10/s get turns 0.1 s apart, without polling.
    Catches waiters that all sleep the same time and then race for one token."""
    slept: list[float] = []
    limiter = RateLimiter(redis_client, namespace, rate=10.0, burst=1, sleep=slept.append)
    first = limiter.acquire()
    grants = [limiter.acquire() for _ in range(3)]
    assert first.waited == 0
    assert slept == [g.waited for g in grants]
    for i, grant in enumerate(grants, start=1):
        assert grant.at == pytest.approx(first.at + i / 10, abs=0.02)
    assert limiter.state().tokens == pytest.approx(-3, abs=0.5)


def test_throttle_drops_saved_tokens_and_lowers_the_rate_for_a_while(
    redis_client: redis.Redis, namespace: str
) -> None:
    """A Retry-After of 1 s at rate 0 empties the bucket and refuses every call for that long;
    overlapping throttles keep the lower rate and the later end. Catches a throttle that lets
    the saved burst through, or that never ends."""
    limiter = RateLimiter(redis_client, namespace, rate=50.0, burst=20)
    limiter.throttle(5.0, 0.2)
    limiter.throttle(0.0, 1.0)
    state = limiter.state()
    assert state.throttled_rate == 0.0 and 0.8 < state.throttled_for <= 1.0
    assert limiter.try_acquire() is False
    with pytest.raises(RateLimited) as info:
        limiter.acquire(blocking_timeout=0.5)
    assert info.value.retry_after >= state.throttled_for - 0.1
    slept: list[float] = []
    limiter.sleep = slept.append
    grant = limiter.acquire()
    assert grant.waited == pytest.approx(state.throttled_for + 1 / 50, abs=0.1)


def test_paced_throttles_on_an_error_carrying_retry_after(
    redis_client: redis.Redis, namespace: str
) -> None:
    """Catches a Retry-After from the downstream that only delays the one job that saw it."""
    limits = RateLimits(redis_client, {"down": "100/s,burst=5,wait=0,throttled=0"},
                        prefix=f"{namespace}:rate:")
    with pytest.raises(TransientJobError, match="429"), limits.paced("down"):
        raise TransientJobError("the downstream answered 429", retry_after=2.0)
    limiter = limits.limiter("down")
    assert limiter is not None and limiter.state().throttled_for > 1.5
    with pytest.raises(RateLimited), limits.paced("down"):
        pass
    with limits.paced("other") as grant:
        assert grant is None  # no rate set: unlimited


def test_rate_settings_parse_and_name_the_variable() -> None:
    """Catches a typo in SEKALI_RATE_* that silently means unlimited."""
    assert RateSetting.parse("50/s,burst=20") == RateSetting(50.0, 20.0)
    assert RateSetting.parse("120/min") == RateSetting(2.0, 2.0)
    assert RateSetting.parse("0.5,wait=3,throttled=6/min") == RateSetting(0.5, 1.0, 3.0, 0.1)
    for bad in ("fast", "5/week", "5/s,burst", "5/s,brust=3", "0/s"):
        with pytest.raises(ValidationError) as info:
            RateSetting.parse(bad, name="SEKALI_RATE_SMTP")
        assert info.value.field == "SEKALI_RATE_SMTP"
