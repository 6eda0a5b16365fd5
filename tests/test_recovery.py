"""Retry delays following the downstream's observed failure bursts (:mod:`engine.recovery`):
the bursts measured by the shared budget's scripts on a real Redis, the policy derived from
them (never below the declared, full jitter and the budget kept), and the step's decision."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest
import redis

from engine import Calls, Keying, Queue, Running
from engine.attempts import AttemptRecorder
from engine.contract import JobType
from engine.recovery import RecoveryWatch
from engine.registry import JOB_TYPES
from engine.services import Services
from engine.step import StepAttempt, StepRequest, failure_path
from resources.errors import TransientJobError
from resources.idempotency import IdempotencyStore
from resources.retry import RetryBudget, RetryPolicy
from resources.storage.db import Database


def test_the_budget_measures_each_burst_from_the_first_retry_to_the_next_success(
    redis_client: redis.Redis, namespace: str
) -> None:
    """Catches bursts measured from the last failure (shorter than the outage), failures of
    one burst counted as many, a success with no burst open recorded as a zero-length one,
    and an unbounded list in Redis."""
    budget = RetryBudget(redis_client, capacity=1000, namespace=namespace)
    budget.refund("gw")
    assert budget.bursts("gw") == []
    for length in (0.3, 0.1):
        budget.try_spend("gw")
        time.sleep(length / 2)
        budget.try_spend("gw")  # the same burst
        time.sleep(length / 2)
        budget.refund("gw")
        budget.refund("gw")  # no burst open: nothing recorded
    newest, oldest = budget.bursts("gw")
    assert 0.1 <= newest < 0.3 <= oldest < 1.5
    assert budget.bursts("mail") == []
    for _ in range(60):
        budget.try_spend("gw")
        budget.refund("gw")
    assert len(budget.bursts("gw")) == 50


def test_the_policy_follows_the_bursts_never_below_the_declared() -> None:
    """Catches delays shorter than declared when bursts are short, a single odd burst moving
    the policy, and jitter or the time budget changed along the way."""
    declared = RetryPolicy(base_delay=1, max_delay=60, jitter="full", total_budget_seconds=600)
    same, why = declared.following([40.0, 50.0])
    assert same is declared and why == "declared, 2<3 bursts observed"
    short, _ = declared.following([0.2] * 10)
    assert (short.base_delay, short.max_delay) == (1, 60)
    slow, why = declared.following([20.0] * 8 + [100.0, 120.0])
    assert (slow.base_delay, slow.max_delay) == (10.0, 100.0)
    assert slow.jitter == "full" and slow.total_budget_seconds == 600
    assert "bursts p50 20s p90 100s over 10" in why
    rng = random.Random(7)
    delays = [slow.delay(0, rng=rng) for _ in range(2000)]
    assert 0 <= min(delays) < 1 and 9 < max(delays) <= 10  # full jitter over [0, base)


def _fails(ctx: Any, payload: dict[str, Any]) -> None:
    raise TransientJobError("the downstream is down")


def test_a_failed_step_waits_as_long_as_its_downstream_takes_to_recover(
    db: Database, redis_client: redis.Redis, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches a decision that keeps the declared 1 s base while the downstream's outages last
    half a minute (every retry lands inside the outage and spends a budget token), and one
    that stops spending the shared budget once the delays adapt."""
    monkeypatch.setitem(JOB_TYPES, "recovery_probe", JobType(
        name="recovery_probe",
        queue=Queue.LIGHT,
        validate=dict,
        handler=_fails,
        side_effect=False,
        keying=Keying(key_for=lambda p: f"rp:{p['n']}", resource_id=lambda p: "r"),
        running=Running(max_runtime_seconds=60),
        calls=Calls(budget="sick_gw"),
    ))
    budget = RetryBudget(redis_client, capacity=100, namespace=namespace)
    key_bursts = f"{namespace}:retry-bursts:{{sick_gw}}"
    redis_client.lpush(key_bursts, *["30"] * 5)
    services = Services(db=db, store=IdempotencyStore(db), attempts=AttemptRecorder(db),
                        retry_policy=RetryPolicy(base_delay=1, max_delay=60),
                        retry_budget=budget)
    path = failure_path(services, "recovery_probe", StepAttempt("run-1", "s", 0),
                        StepRequest("recovery_probe", {"n": "1"}, None, None))
    decisions = [path.decide(TransientJobError(f"down {i}")) for i in range(101)]
    assert all(d.retry for d in decisions[:100])
    delays = [d.delay or 0.0 for d in decisions[:100]]
    assert max(delays) > 5 and all(0 <= d <= 15 for d in delays)  # base 15 s, full jitter
    assert decisions[100].reason == "retry budget exhausted"  # the shared budget still spent
    watch = RecoveryWatch(budget)
    assert watch.policy(RetryPolicy(), "sick_gw")[0].base_delay == 15
    away = redis.Redis(port=1, socket_connect_timeout=0.2, socket_timeout=0.2)
    down = RecoveryWatch(RetryBudget(away, namespace=namespace))
    assert down.policy(RetryPolicy(), "sick_gw") == (RetryPolicy(), "declared, 0<3 bursts observed")
