"""The retry storm as a discrete-event simulation in virtual time: 1,000 jobs fail at once, the
downstream is out, then serves a bounded rate. Deterministic per seed; shared by the benchmark
(:mod:`benchmarks.retry_storm`, which measures every jitter mode) and the demo's retry scene.

It runs the real :class:`resources.retry.RetryPolicy` decisions; only time and the downstream are
simulated, and the shared budget is the same token-bucket rule as
:class:`resources.retry.RetryBudget` kept in memory.
"""

from __future__ import annotations

import bisect
import heapq
import random
from dataclasses import dataclass
from typing import Any

from resources.errors import TransientJobError
from resources.retry import RetryPolicy


@dataclass
class Scenario:
    jobs: int = 1000
    outage: float = 30.0
    capacity: int = 100
    base: float = 1.0
    cap: float = 60.0
    max_attempts: int = 10
    total_budget: float = 600.0
    budget_capacity: float = 100.0
    refill_per_success: float = 0.1
    replay_rate: float = 20.0
    replay_delay: float = 10.0
    max_replays: int = 5


class _Bucket:
    """The same token-bucket rule as resources.retry.RetryBudget, in memory for virtual time."""

    def __init__(self, capacity: float, refill: float) -> None:
        self.capacity, self.refill, self.level = capacity, refill, capacity

    def try_spend(self, _downstream: str) -> bool:
        if self.level >= 1:
            self.level -= 1
            return True
        return False

    def refund(self) -> None:
        self.level = min(self.capacity, self.level + self.refill)


def simulate(scenario: Scenario, jitter: str, use_budget: bool, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    policy = RetryPolicy(max_attempts=scenario.max_attempts, base_delay=scenario.base,
                         max_delay=scenario.cap, jitter=jitter,
                         total_budget_seconds=scenario.total_budget)
    bucket = _Bucket(scenario.budget_capacity, scenario.refill_per_success)
    failure = TransientJobError("503")
    # (time, job, attempt, previous_delay, run_started_at)
    events: list[tuple[float, int, int, float | None, float]] = [
        (0.0, j, 0, None, 0.0) for j in range(scenario.jobs)
    ]
    heapq.heapify(events)
    served: dict[int, int] = {}
    arrivals: list[float] = []
    retries: list[float] = []
    replays: dict[int, int] = {}
    next_replay = 0.0
    completed = dead = refused_after = 0
    reasons: dict[str, int] = {}
    last = 0.0
    while events:
        t, job, attempt, previous, started = heapq.heappop(events)
        arrivals.append(t)
        if attempt > 0:
            retries.append(t)
        window = int(t)
        ok = t >= scenario.outage and served.get(window, 0) < scenario.capacity
        if ok:
            served[window] = served.get(window, 0) + 1
            completed += 1
            bucket.refund()
            last = max(last, t)
            continue
        if t >= scenario.outage:
            refused_after += 1
        decision = policy.decide(failure, attempt=attempt, elapsed=t - started,
                                 previous_delay=previous,
                                 budget=bucket if use_budget else None,
                                 downstream="gateway" if use_budget else None, rng=rng)
        if decision.retry and decision.delay is not None:
            heapq.heappush(events, (t + decision.delay, job, attempt + 1, decision.delay, started))
        elif (decision.reason == "retry budget exhausted"
              and replays.get(job, 0) < scenario.max_replays):
            # dead-lettered now, replayed later as a new run by the rate-limited DLQ replay
            replays[job] = replays.get(job, 0) + 1
            next_replay = max(next_replay, t + scenario.replay_delay)
            heapq.heappush(events, (next_replay, job, 0, None, next_replay))
            next_replay += 1.0 / scenario.replay_rate
        else:
            dead += 1
            reasons[decision.reason or "?"] = reasons.get(decision.reason or "?", 0) + 1
            last = max(last, t)
    after = [t for t in arrivals if t >= scenario.outage]
    return {
        "peak_retries_1s": peak(retries, 1.0),
        "peak_calls_after_recovery_1s": peak(after, 1.0),
        "refused_after_recovery": refused_after,
        "total_calls": len(arrivals),
        "time_to_drain_s": round(last, 2),
        "completed": completed,
        "dead_lettered": dead,
        "dlq_replays": sum(replays.values()),
        "dead_letter_reasons": reasons,
        "arrivals": arrivals,
    }


def peak(times: list[float], width: float) -> int:
    """Most events in any half-open window [t, t + width)."""
    times = sorted(times)
    best = 0
    for i, t in enumerate(times):
        best = max(best, bisect.bisect_left(times, t + width, lo=i) - i)
    return best
