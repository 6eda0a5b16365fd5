"""How many resident workers each queue needs, from Little's law over what is observed.

Per queue, every supervisor tick (:mod:`sensors.workers`)::

    offered = sum over its job types of arrivals/s x duration     (busy workers, Little's law)
            + backlog x duration / drain_seconds                  (the queue drained in time)
    needed  = clamp(ceil(offered / utilisation x headroom), floor, ceiling)

Arrivals are the requests created in the last ``arrival_window_seconds``
(:meth:`engine.requests.RequestStore.arrivals`); the duration is the job type's at the chosen
statistic (``mean`` by default: Little's law is about means; ``p50``/``p99``/``p999`` to size
for the tail) from :class:`engine.durations.DurationModel`; a worker runs one request at a
time. ``floor`` and ``ceiling`` come from ``SEKALI_WORKERS`` (``light=1..8``; a plain count is
fixed: no sizing for that queue).

Hysteresis (:func:`next_target`): up at once to what is needed (a burst must not wait), down
only once the need stayed below the running count for ``scale_down_after`` seconds, so a queue
between bursts does not flap (each worker run costs a process start).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from engine.durations import DurationModel, DurationStats
from engine.requests import RequestStore
from engine.worker import WorkerTargets

STATISTICS = ("mean", "p50", "p99", "p999")


@dataclass(frozen=True)
class CapacityPolicy:
    """Env (:meth:`from_env`): ``SEKALI_WORKER_UTILISATION``, ``SEKALI_WORKER_HEADROOM``,
    ``SEKALI_ARRIVAL_WINDOW``, ``SEKALI_WORKER_STATISTIC``, ``SEKALI_DRAIN_SECONDS``,
    ``SEKALI_SCALE_DOWN_AFTER``."""

    utilisation: float = 0.7
    """The busy share a worker is planned for: queues grow fast as it nears 1."""
    headroom: float = 1.2
    arrival_window_seconds: float = 60.0
    statistic: str = "mean"
    drain_seconds: float = 60.0
    scale_down_after: float = 30.0
    unknown_duration: float = 1.0
    """The duration assumed for a job type with no completed attempt in the window yet."""

    def __post_init__(self) -> None:
        if not 0 < self.utilisation <= 1:
            raise ValueError("SEKALI_WORKER_UTILISATION must be in (0, 1]")
        if self.headroom < 1:
            raise ValueError("SEKALI_WORKER_HEADROOM must be >= 1")
        if self.statistic not in STATISTICS:
            raise ValueError(f"SEKALI_WORKER_STATISTIC must be one of {', '.join(STATISTICS)}")
        if min(self.arrival_window_seconds, self.drain_seconds) <= 0:
            raise ValueError("SEKALI_ARRIVAL_WINDOW and SEKALI_DRAIN_SECONDS must be > 0")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> CapacityPolicy:
        env = os.environ if env is None else env
        return cls(
            utilisation=float(env.get("SEKALI_WORKER_UTILISATION", cls.utilisation)),
            headroom=float(env.get("SEKALI_WORKER_HEADROOM", cls.headroom)),
            arrival_window_seconds=float(env.get("SEKALI_ARRIVAL_WINDOW",
                                                 cls.arrival_window_seconds)),
            statistic=env.get("SEKALI_WORKER_STATISTIC", cls.statistic).strip(),
            drain_seconds=float(env.get("SEKALI_DRAIN_SECONDS", cls.drain_seconds)),
            scale_down_after=float(env.get("SEKALI_SCALE_DOWN_AFTER", cls.scale_down_after)),
        )


@dataclass(frozen=True)
class QueueLoad:
    """One queue's load as measured, and the workers it needs (between its bounds)."""

    queue: str
    arrivals_per_second: float
    duration_seconds: float
    """The arrivals' duration at the policy's statistic (weighted by each type's arrivals)."""
    backlog: int
    offered: float
    """Workers kept busy: arrivals x duration, plus the backlog's drain."""
    needed: int
    unbounded: int
    floor: int
    ceiling: int

    def capacity_per_second(self, workers: int) -> float:
        """Requests per second ``workers`` finish at this duration."""
        return workers / self.duration_seconds if self.duration_seconds > 0 else math.inf

    def draining(self, workers: int) -> bool:
        """Whether ``workers`` finish more than arrives (so a backlog shrinks)."""
        return self.capacity_per_second(workers) > self.arrivals_per_second

    def describe(self, workers: int) -> str:
        capacity = self.capacity_per_second(workers)
        state = ("draining" if self.draining(workers) else "GROWING") if self.backlog else (
            "keeping up" if self.draining(workers) else "falling behind")
        return (f"{self.queue}: {self.arrivals_per_second:.2f}/s x {self.duration_seconds:.3g}s"
                f" + backlog {self.backlog} -> {self.offered:.2f} busy; needs {self.needed}"
                f" worker(s) (unbounded {self.unbounded}, bounds [{self.floor}, {self.ceiling}])"
                f", runs {workers}: capacity {capacity:.2f}/s, {state}")

    def as_dict(self, workers: int) -> dict[str, Any]:
        return {**asdict(self), "workers": workers,
                "capacity_per_second": self.capacity_per_second(workers),
                "draining": self.draining(workers), "summary": self.describe(workers)}


def needed_workers(
    arrivals_per_second: float, duration: float, backlog: int, policy: CapacityPolicy,
    floor: int, ceiling: int,
) -> tuple[float, int, int]:
    """``(offered, unbounded, needed)``: the one sizing decision (pure)."""
    offered = arrivals_per_second * duration + backlog * duration / policy.drain_seconds
    unbounded = math.ceil(offered / policy.utilisation * policy.headroom - 1e-9)
    return offered, unbounded, min(max(unbounded, floor), max(floor, ceiling))


def measure(
    requests: RequestStore,
    model: DurationModel,
    queues: Mapping[str, Sequence[str]],
    bounds: Mapping[str, tuple[int, int]],
    policy: CapacityPolicy,
    now: float,
) -> dict[str, QueueLoad]:
    """The load of each queue in ``queues`` (``{queue: its job types}``) with its
    ``bounds`` (``{queue: (floor, ceiling)}``)."""
    arrived = requests.arrivals(now - policy.arrival_window_seconds)
    waiting: dict[str, int] = {}
    for row in requests.queue_stats():
        if row["status"] == "pending":
            waiting[row["job_type"]] = waiting.get(row["job_type"], 0) + int(row["n"])
    stats = model.stats()
    out: dict[str, QueueLoad] = {}
    for queue, types in queues.items():
        rate = sum(arrived.get(t, 0) for t in types) / policy.arrival_window_seconds
        backlog = sum(waiting.get(t, 0) for t in types)
        weights = {t: arrived.get(t, 0) + waiting.get(t, 0) for t in types}
        total = sum(weights.values())
        duration = (sum(_duration(stats.get(t), policy) * w for t, w in weights.items()) / total
                    if total else policy.unknown_duration)
        floor, ceiling = bounds[queue]
        offered, unbounded, needed = needed_workers(rate, duration, backlog, policy, floor,
                                                    ceiling)
        out[queue] = QueueLoad(queue, rate, duration, backlog, offered, needed, unbounded,
                               floor, ceiling)
    return out


def _duration(stats: DurationStats | None, policy: CapacityPolicy) -> float:
    if stats is None or not stats.samples:
        return policy.unknown_duration
    value = stats.at(policy.statistic)
    return policy.unknown_duration if math.isnan(value) else value


@dataclass(frozen=True)
class Scale:
    """A queue's worker target and since when the need stayed below it (the hysteresis
    state the supervisor keeps in its cursor)."""

    target: int
    below_since: float | None = None

    def as_json(self) -> dict[str, Any]:
        return {"target": self.target, "below_since": self.below_since}

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> Scale | None:
        if not data:
            return None
        return cls(int(data["target"]), data.get("below_since"))


def next_target(current: Scale | None, needed: int, now: float, policy: CapacityPolicy) -> Scale:
    """Up at once; down to ``needed`` once it stayed below the target ``scale_down_after``."""
    if current is None or needed >= current.target:
        return Scale(needed)
    since = current.below_since if current.below_since is not None else now
    if now - since >= policy.scale_down_after:
        return Scale(needed)
    return Scale(current.target, since)


def plan(
    requests: RequestStore,
    model: DurationModel,
    queues: Mapping[str, Sequence[str]],
    targets: WorkerTargets,
    scales: Mapping[str, Scale],
    policy: CapacityPolicy,
    now: float,
) -> tuple[dict[str, int], dict[str, Scale], dict[str, QueueLoad]]:
    """One supervisor tick's sizing: ``(worker count per queue, the new hysteresis state,
    the loads measured)``. A queue with a fixed count keeps it; a sized one follows
    :func:`next_target` over :func:`measure`."""
    sized = {q: types for q, types in queues.items() if targets.sized(q)}
    counts = {q: targets.of(q) for q in queues if q not in sized}
    loads = measure(requests, model, sized, {q: targets.bounds(q) for q in sized}, policy, now)
    new: dict[str, Scale] = {}
    for queue, load in loads.items():
        floor, ceiling = targets.bounds(queue)
        current = scales.get(queue)
        if current is not None:  # the bounds may have changed since
            current = Scale(min(max(current.target, floor), ceiling), current.below_since)
        new[queue] = next_target(current, load.needed, now, policy)
        counts[queue] = new[queue].target
    return counts, new, loads
