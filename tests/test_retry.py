"""Error classes, retry delays, the shared retry budget, and the Dagster adapter.

Delays are checked as properties with a seeded ``random.Random`` (never by sleeping); error
classes on real exception instances raised by real sockets, SQLite, Redis and pydantic; the
budget against a real Redis from many threads in several processes; the adapter by really
executing a tiny Dagster job and reading the retry waits Dagster recorded.
"""


import multiprocessing
import random
import socket
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pydantic
import pytest
import redis
from dagster import (
    Config,
    DagsterInstance,
    Failure,
    OpExecutionContext,
    RetryRequested,
    job,
    op,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import create_engine, text

from resources.dagster_resources import RetryResource, to_dagster
from resources.errors import (
    AlreadyInProgress,
    IdempotencyConflict,
    LockNotAcquired,
    SekaliError,
    TransientJobError,
    ValidationError,
)
from resources.retry import (
    BUDGET_UNAVAILABLE,
    JITTERS,
    ErrorClass,
    RetryBudget,
    RetryPolicy,
    classify,
    retry_delay,
)
from resources.storage.redis import redis_client as connect_redis
from resources.storage.settings import RedisTimeouts
from sandbox.redis_server import free_port

# --- delays -----------------------------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(
    attempt=st.integers(0, 500),
    base=st.floats(0, 10),
    cap=st.floats(0, 120),
    jitter=st.sampled_from(JITTERS),
    previous=st.none() | st.floats(0, 200),
    seed=st.integers(0, 2**32),
)
def test_every_delay_lies_within_zero_and_the_cap(
    attempt: int, base: float, cap: float, jitter: str, previous: float | None, seed: int
) -> None:
    delay = retry_delay(attempt, base=base, cap=cap, jitter=jitter, previous=previous,
                        rng=random.Random(seed))
    assert 0.0 <= delay <= cap


def test_no_jitter_doubles_until_the_cap() -> None:
    delays = [retry_delay(a, base=0.5, cap=10, jitter="none") for a in range(8)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]


def test_full_jitter_spreads_over_the_whole_range_even_at_the_cap() -> None:
    """Regression: jitter lost at the cap (every job of a cohort waits exactly ``cap``)."""
    rng = random.Random(42)
    draws = [retry_delay(30, base=1, cap=60, jitter="full", rng=rng) for _ in range(4000)]
    assert min(draws) < 0.03 * 60 and max(draws) > 0.97 * 60
    assert abs(statistics.mean(draws) - 30) < 2.0
    buckets = [0] * 10
    for d in draws:
        buckets[min(9, int(d / 6))] += 1
    assert min(buckets) > 300  # roughly uniform: 400 expected per bucket


def test_full_jitter_grows_with_the_attempt() -> None:
    rng = random.Random(1)
    means = [
        statistics.mean(retry_delay(a, base=1, cap=60, jitter="full", rng=rng) for _ in range(800))
        for a in range(6)
    ]
    assert all(later > earlier for earlier, later in zip(means, means[1:], strict=False))
    assert means[0] < 0.6 and 14 < means[5] < 18  # 0.5 and 16 expected (32 < cap 60)


def test_equal_jitter_keeps_at_least_half() -> None:
    rng = random.Random(3)
    for a in range(10):
        ceiling = min(20, 2**a)
        d = retry_delay(a, base=1, cap=20, jitter="equal", rng=rng)
        assert ceiling / 2 <= d <= ceiling


def test_decorrelated_stays_between_base_and_three_times_previous() -> None:
    rng = random.Random(5)
    previous = None
    seen = []
    for a in range(200):
        d = retry_delay(a, base=0.5, cap=30, jitter="decorrelated", previous=previous, rng=rng)
        upper = min(30, 3 * (previous if previous is not None else 0.5))
        assert 0.5 <= d <= upper
        previous = d
        seen.append(d)
    at_cap = seen[50:]
    assert max(at_cap) > 25 and min(at_cap) < 15  # still spread once it reached the cap
    assert len({round(d, 6) for d in at_cap}) == len(at_cap)  # no pile-up on exactly ``cap``


def test_plus_minus_is_dagsters_formula_within_the_cap() -> None:
    """Dagster's PLUS_MINUS: (2**(n+1) - 1) * base +/- base, for retry_number n."""
    rng = random.Random(9)
    for n in range(5):
        center = (2 ** (n + 1) - 1) * 1.0
        for _ in range(50):
            d = retry_delay(n, base=1.0, cap=1000, jitter="plus_minus", rng=rng)
            assert center - 1 <= d <= center + 1
    capped = [retry_delay(12, base=1, cap=60, jitter="plus_minus", rng=rng) for _ in range(200)]
    assert all(59 <= d <= 60 for d in capped)


def test_seeded_delays_are_reproducible_and_bad_arguments_refused() -> None:
    a = [retry_delay(i, jitter="full", rng=random.Random(11)) for i in range(5)]
    b = [retry_delay(i, jitter="full", rng=random.Random(11)) for i in range(5)]
    assert a == b
    with pytest.raises(ValueError):
        retry_delay(-1)
    with pytest.raises(ValueError):
        retry_delay(0, jitter="sometimes")
    with pytest.raises(ValueError):
        RetryPolicy(jitter="sometimes")


# --- error classes on real exceptions -----------------------------------------------------------


def _raised(fn: Callable[[], object]) -> BaseException:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        return exc
    raise AssertionError("expected an exception")


def test_classify_real_transient_errors(redis_url: str) -> None:
    refused = _raised(lambda: socket.create_connection(("127.0.0.1", free_port()), timeout=2))
    assert isinstance(refused, ConnectionRefusedError)

    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname(), timeout=2)
    client.settimeout(0.05)
    timed_out = _raised(lambda: client.recv(1))
    client.close()
    listener.close()
    assert isinstance(timed_out, TimeoutError)

    sqlite_down = _raised(
        lambda: create_engine("sqlite:////nonexistent-dir/x/app.db").connect().execute(text("1"))
    )
    redis_down = _raised(lambda: redis.Redis(port=free_port(), socket_connect_timeout=2).ping())
    blocked = connect_redis(redis_url, timeouts=RedisTimeouts(socket=0.1))
    redis_slow = _raised(lambda: blocked.blpop(["sekali-test-never-" + str(time.time())], 2))
    blocked.close()
    assert isinstance(redis_slow, redis.TimeoutError)

    for exc in (refused, timed_out, sqlite_down, redis_down, redis_slow,
                AlreadyInProgress("k", None, 1.0), LockNotAcquired("lock:a", 0.5),
                TransientJobError("503")):
        assert classify(exc) is ErrorClass.TRANSIENT, exc


def test_classify_real_permanent_and_unknown_errors() -> None:
    bad_data = _raised(lambda: pydantic.TypeAdapter(int).validate_python("not a number"))
    assert isinstance(bad_data, pydantic.ValidationError)
    permanent: list[BaseException] = [
        bad_data, ValidationError("amount", "must be positive", -1),
        IdempotencyConflict("k", "a", "b"), Failure("no", allow_retries=False),
    ]
    for exc in permanent:
        assert classify(exc) is ErrorClass.PERMANENT, exc
    empty: dict[str, int] = {}
    # Our own KeyError/ValueError/TypeError are bugs until proven otherwise: UNKNOWN.
    unknown: list[BaseException] = [
        _raised(lambda: empty["missing"]), _raised(lambda: int("x")),
        _raised(lambda: len(5)), RuntimeError("?"),  # type: ignore[arg-type]
    ]
    for exc in unknown:
        assert classify(exc) is ErrorClass.UNKNOWN, exc
    assert classify(SekaliError("plain")) is ErrorClass.TRANSIENT  # permanent = False


# --- the policy ------------------------------------------------------------------------------


def test_policy_decisions() -> None:
    policy = RetryPolicy(max_attempts=4, base_delay=1, max_delay=10, jitter="none",
                         total_budget_seconds=30, max_unknown_attempts=2)
    transient = TransientJobError("503")
    assert policy.decide(ValidationError("x", "bad"), attempt=0, elapsed=0).reason == "permanent"
    first = policy.decide(transient, attempt=0, elapsed=0)
    assert first.retry and first.delay == 1 and first.error_class is ErrorClass.TRANSIENT
    assert policy.decide(transient, attempt=2, elapsed=0).delay == 4
    assert policy.decide(transient, attempt=3, elapsed=0).reason == "attempts exhausted"
    assert policy.decide(transient, attempt=1, elapsed=30).reason == "time budget exhausted"
    assert policy.decide(transient, attempt=2, elapsed=28).delay == 2  # cut to budget left
    unknown = RuntimeError("bug?")
    assert policy.decide(unknown, attempt=0, elapsed=0).retry
    assert policy.decide(unknown, attempt=1, elapsed=0).reason == "attempts exhausted"


def test_retry_after_is_honoured_but_bounded_by_the_time_budget() -> None:
    policy = RetryPolicy(max_attempts=5, base_delay=1, max_delay=10, jitter="full",
                         total_budget_seconds=100)
    slow_down = TransientJobError("429", retry_after=7.5)
    for attempt in range(3):
        d = policy.decide(slow_down, attempt=attempt, elapsed=0, rng=random.Random(attempt))
        assert d.retry and d.delay is not None and 7.5 <= d.delay <= 10
    explicit = policy.decide(TransientJobError("x"), attempt=0, elapsed=0, retry_after=40)
    assert explicit.delay == 40  # beyond max_delay: the server asked for it
    near_end = policy.decide(TransientJobError("x"), attempt=0, elapsed=95, retry_after=40)
    assert near_end.delay == 5


# --- the retry budget ------------------------------------------------------------------------


def _spend_worker(redis_url: str, namespace: str, capacity: float, threads: int,
                  tries: int) -> int:
    """Worker for spawned processes: ``threads`` threads each try ``tries`` spends."""
    client = connect_redis(redis_url)
    budget = RetryBudget(client, capacity=capacity, namespace=namespace)
    barrier = threading.Barrier(threads)

    def work(_: int) -> int:
        barrier.wait(timeout=60)
        return sum(budget.try_spend("gateway") for _ in range(tries))

    with ThreadPoolExecutor(max_workers=threads) as pool:
        total = sum(pool.map(work, range(threads)))
    client.close()
    return total


def test_budget_never_overspends_across_threads_and_processes(
    redis_url: str, redis_client: redis.Redis, namespace: str
) -> None:
    """Regression: a read-then-decrement budget lets concurrent workers spend the same token.

    2 spawned processes x 8 threads plus 8 threads here try 240 spends on 60 tokens: exactly
    60 succeed, and the bucket ends empty, not negative.
    """
    capacity = 60.0
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as procs:
        remote = procs.starmap_async(
            _spend_worker, [(redis_url, namespace, capacity, 8, 10)] * 2
        )
        local = _spend_worker(redis_url, namespace, capacity, 8, 10)
        spent = local + sum(remote.get(timeout=120))
    assert spent == 60
    budget = RetryBudget(redis_client, capacity=capacity, namespace=namespace)
    assert budget.level("gateway") == 0.0
    assert budget.level("mail") == capacity  # per downstream


def test_budget_refund_refills_up_to_capacity(redis_client: redis.Redis, namespace: str) -> None:
    budget = RetryBudget(redis_client, capacity=3, refill_per_success=0.5, namespace=namespace)
    assert [budget.try_spend("gw") for _ in range(4)] == [True, True, True, False]
    budget.refund("gw")
    assert not budget.try_spend("gw")  # half a token is not a retry
    assert budget.refund("gw") == 1.0
    assert budget.try_spend("gw")
    for _ in range(20):
        budget.refund("gw")
    assert budget.level("gw") == 3.0
    policy = RetryPolicy(max_attempts=10, base_delay=0.01, jitter="full")
    for _ in range(3):
        assert policy.decide(TransientJobError("x"), attempt=0, elapsed=0, budget=budget,
                             downstream="gw").retry
    empty = policy.decide(TransientJobError("x"), attempt=0, elapsed=0, budget=budget,
                          downstream="gw")
    assert empty.reason == "retry budget exhausted"
    # permanent errors never touch the budget
    budget.reset("gw")
    policy.decide(ValidationError("f", "bad"), attempt=0, elapsed=0, budget=budget,
                  downstream="gw")
    assert budget.level("gw") == 3.0


# --- the Dagster adapter ------------------------------------------------------------------------


def test_adapter_returns_retry_requested_or_failure() -> None:
    policy = RetryPolicy(max_attempts=3, base_delay=0.5, max_delay=10, jitter="none")
    retry = to_dagster(TransientJobError("503"), attempt=1, policy=policy)
    assert isinstance(retry, RetryRequested)
    assert retry.max_retries == 2 and retry.seconds_to_wait == 1.0
    fail = to_dagster(ValidationError("amount", "must be positive"), attempt=0, policy=policy)
    assert isinstance(fail, Failure) and not fail.allow_retries
    assert fail.metadata["error_class"].value == "permanent"
    assert fail.metadata["reason"].value == "permanent"
    assert fail.metadata["attempt"].value == 0
    done = to_dagster(TransientJobError("503"), attempt=2, policy=policy)
    assert isinstance(done, Failure) and done.metadata["reason"].value == "attempts exhausted"


ATTEMPTS: dict[str, list[float]] = {}


class FlakyConfig(Config):
    tag: str
    permanent: bool = False
    downstream: str | None = None


@op
def flaky(context: OpExecutionContext, config: FlakyConfig, retry: RetryResource) -> None:
    ATTEMPTS.setdefault(config.tag, []).append(time.monotonic())
    try:
        if config.permanent:
            raise ValidationError("amount_cents", "must be positive", -1)
        raise TransientJobError("downstream answered 503")
    except SekaliError as exc:
        raise retry.to_dagster(exc, attempt=context.retry_number,
                               downstream=config.downstream) from exc


@job
def flaky_job() -> None:
    flaky()


@pytest.fixture(scope="module")
def instance() -> DagsterInstance:
    return DagsterInstance.ephemeral()


def _run(
    instance: DagsterInstance, tag: str, resource: RetryResource, **cfg: object
) -> tuple[Any, list[Any], list[Any]]:
    result = flaky_job.execute_in_process(
        run_config={"ops": {"flaky": {"config": {"tag": tag, **cfg}}}},
        resources={"retry": resource},
        instance=instance,
        raise_on_error=False,
    )
    waits = [
        e.event_specific_data.seconds_to_wait  # type: ignore[union-attr]
        for e in result.all_events
        if e.event_type_value == "STEP_UP_FOR_RETRY"
    ]
    failures = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    return result, waits, failures


def test_dagster_permanent_error_runs_once(instance: DagsterInstance, namespace: str) -> None:
    resource = RetryResource(max_attempts=5, base_delay=0.05, budget_enabled=False)
    result, waits, failures = _run(instance, namespace, resource, permanent=True)
    assert not result.success
    assert len(ATTEMPTS[namespace]) == 1 and waits == []
    meta = failures[0].event_specific_data.user_failure_data.metadata
    assert meta["error_class"].value == "permanent" and meta["reason"].value == "permanent"


def test_dagster_transient_error_retried_with_growing_capped_delays(
    instance: DagsterInstance, namespace: str
) -> None:
    resource = RetryResource(max_attempts=5, base_delay=0.05, max_delay=0.15, jitter="none",
                             budget_enabled=False)
    result, waits, failures = _run(instance, namespace + "n", resource)
    assert not result.success
    assert waits == pytest.approx([0.05, 0.1, 0.15, 0.15])
    stamps = ATTEMPTS[namespace + "n"]
    assert len(stamps) == 5
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    assert all(gap >= wait * 0.9 for gap, wait in zip(gaps, waits, strict=False))
    meta = failures[-1].event_specific_data.user_failure_data.metadata
    assert meta["reason"].value == "attempts exhausted" and meta["attempt"].value == 4

    jittered = RetryResource(max_attempts=6, base_delay=0.05, max_delay=0.2, jitter="full",
                             budget_enabled=False)
    _result, waits, _ = _run(instance, namespace + "f", jittered)
    assert len(waits) == 5 and len(ATTEMPTS[namespace + "f"]) == 6
    ceilings = [min(0.2, 0.05 * 2**n) for n in range(5)]
    assert all(0 <= w <= c for w, c in zip(waits, ceilings, strict=False))
    assert waits != pytest.approx(ceilings)  # jittered, not the bare exponential


def test_dagster_exhausted_budget_stops_retries(
    instance: DagsterInstance, redis_url: str, redis_client: redis.Redis, namespace: str
) -> None:
    resource = RetryResource(max_attempts=10, base_delay=0.05, jitter="full", redis_url=redis_url,
                             budget_capacity=2, budget_namespace=namespace)
    result, waits, failures = _run(instance, namespace, resource, downstream="gateway")
    assert not result.success
    assert len(waits) == 2 and len(ATTEMPTS[namespace]) == 3
    meta = failures[-1].event_specific_data.user_failure_data.metadata
    assert meta["reason"].value == "retry budget exhausted"
    assert meta["error_class"].value == "transient"
    assert resource.get_budget() is not None
    assert resource.get_budget().level("gateway") == 0.0  # type: ignore[union-attr]
    for _ in range(10):
        resource.record_success("gateway")
    assert resource.get_budget().level("gateway") == pytest.approx(1.0)  # type: ignore[union-attr]


def test_waiting_for_another_worker_spends_no_budget(
    redis_client: redis.Redis, namespace: str
) -> None:
    """A live lease or a held lock says nothing about the downstream: no token is spent, so a
    cohort of duplicates cannot drain the budget that protects a sick downstream."""
    budget = RetryBudget(redis_client, capacity=2, refill_per_success=0.1, namespace=namespace)
    policy = RetryPolicy(max_attempts=10, base_delay=0.01, jitter="full")
    for exc in (AlreadyInProgress("payment:o1", None, 1.0), LockNotAcquired("order:o1", 1.0)):
        for _ in range(5):
            assert policy.decide(exc, attempt=0, elapsed=0, budget=budget, downstream="gw").retry
    assert budget.level("gw") == 2.0
    assert policy.decide(TransientJobError("503"), attempt=0, elapsed=0, budget=budget,
                         downstream="gw").retry
    assert budget.level("gw") == 1.0


def test_a_budget_that_cannot_answer_retries_without_spending_and_says_so() -> None:
    """Catches: ``RetryPolicy.decide`` raising the budget's own ConnectionError (no decision at
    all) when the budget's Redis is down. The fallback: retry, not budgeted, with the reason."""
    dead = RetryBudget(connect_redis(f"redis://127.0.0.1:{free_port()}/0"), namespace="gone")
    policy = RetryPolicy(max_attempts=3, base_delay=0.01)
    decision = policy.decide(TransientJobError("503"), attempt=0, elapsed=0, budget=dead,
                             downstream="gw")
    assert decision.retry and decision.reason is not None
    assert decision.reason.startswith(BUDGET_UNAVAILABLE) and "without spending" in decision.reason
    last = policy.decide(TransientJobError("503"), attempt=2, elapsed=0, budget=dead,
                         downstream="gw")
    assert not last.retry and last.reason == "attempts exhausted"
