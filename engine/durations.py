"""The observed duration of each job type, and the lease a claim takes from it.

Operators guess leases; this module measures instead. Per job type it keeps the distribution of
attempts' durations over a sliding window (``SEKALI_DURATION_WINDOW``, 15 minutes), of the
completed attempts and of those that lost their lease (their work needed at least that long:
leaving them out would hide exactly the durations a lease too short cuts off, and the lease
would never grow past them):
the per-minute histogram bins :mod:`engine.attempts` already writes with every attempt
(``job_attempt_rollups``, bins 20% wide from 100 microseconds to a day), summed over the
window's whole minutes. Memory and reading cost are bounded whatever the traffic: at most one
count per bin and job type (114 bins), read in one grouped query over ``window / 60`` buckets,
again at most every ``refresh_seconds``.

A percentile is the **upper edge** of the bin that holds its nearest rank: never below the
true value, at most 20% above it. That is the right side to err on for a lease.

The lease of a claim (:meth:`DurationModel.lease_for`)::

    samples < min_samples  ->  the declared lease (the type's LeaseBounds.declared, else the
                               store's lease_seconds)
    otherwise              ->  clamp(p99.9 x factor x widen, floor, ceiling)
    widen                  =   sqrt(1000 / samples) below 1,000 samples, else 1

Below 1,000 samples the nearest-rank p99.9 is the longest duration seen, and the next attempt
passes it with probability about 1 / samples whatever the distribution; on a heavy tail (a
downstream that just turned slow) it passes it by more than the factor often enough to cost
takeovers while the window fills. The widening pays for that with a longer lease (a dead
holder's work waits longer), only until the window holds the samples p99.9 needs.

``floor`` and ``ceiling`` come from the job type's :class:`LeaseBounds` (by default 1 s and the
type's ``max_runtime_seconds``). Why each bound is safe is in ``docs/locks.md`` ("Adaptive
leases"): a lease too short costs a takeover the fence refuses and the send bound outlives;
it never costs a second effect.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from engine.attempts import HISTOGRAM_EDGES, AttemptRecorder, bin_bounds, nearest_rank

Clock = Callable[[], float]

QUANTILES = (0.5, 0.99, 0.999)
P999_SAMPLES = 1000
"""Samples below which p99.9 (nearest rank) is only the longest seen: the lease widens."""


@dataclass(frozen=True)
class LeaseBounds:
    """What a job type may declare about its lease (``JobType(lease=LeaseBounds(...))``).

    ``declared``: the lease until enough durations are observed (None: the store's).
    ``floor`` / ``ceiling``: the adaptive lease stays between them (ceiling None: the type's
    ``max_runtime_seconds``, past which its run is ended anyway)."""

    declared: float | None = None
    floor: float = 1.0
    ceiling: float | None = None

    def __post_init__(self) -> None:
        if self.floor <= 0:
            raise ValueError("LeaseBounds.floor must be > 0 seconds")
        if self.ceiling is not None and self.ceiling < self.floor:
            raise ValueError("LeaseBounds.ceiling must be >= floor")
        if self.declared is not None and self.declared <= 0:
            raise ValueError("LeaseBounds.declared must be > 0 seconds")

    def ceiling_for(self, max_runtime: float) -> float:
        """The longest lease a claim may take: the declared ceiling, else ``max_runtime``
        (past which the run is ended anyway), never below the floor."""
        return max(self.floor, self.ceiling if self.ceiling is not None else max_runtime)


@dataclass(frozen=True)
class AdaptivePolicy:
    """How leases follow the durations. Env (:meth:`from_env`): ``SEKALI_ADAPTIVE`` (``0``:
    every claim takes the declared lease), ``SEKALI_DURATION_WINDOW`` (seconds),
    ``SEKALI_LEASE_FACTOR``, ``SEKALI_LEASE_MIN_SAMPLES``, ``SEKALI_DURATION_REFRESH``."""

    enabled: bool = True
    window_seconds: float = 900.0
    factor: float = 3.0
    """p99.9 times this: headroom for a tail the window has not shown yet, and for the
    heartbeats (every third of the lease) a busy machine delays."""
    min_samples: int = 100
    """Below this many completed attempts in the window, p99.9 is a guess: keep the declared."""
    refresh_seconds: float = 10.0

    def __post_init__(self) -> None:
        if self.window_seconds < 60:
            raise ValueError("SEKALI_DURATION_WINDOW must be at least 60 seconds")
        if self.factor < 1:
            raise ValueError("SEKALI_LEASE_FACTOR must be >= 1")
        if self.min_samples < 1:
            raise ValueError("SEKALI_LEASE_MIN_SAMPLES must be >= 1")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> AdaptivePolicy:
        env = os.environ if env is None else env
        try:
            return cls(
                enabled=env.get("SEKALI_ADAPTIVE", "1").strip() not in ("0", "off", "false"),
                window_seconds=float(env.get("SEKALI_DURATION_WINDOW", cls.window_seconds)),
                factor=float(env.get("SEKALI_LEASE_FACTOR", cls.factor)),
                min_samples=int(env.get("SEKALI_LEASE_MIN_SAMPLES", cls.min_samples)),
                refresh_seconds=float(env.get("SEKALI_DURATION_REFRESH", cls.refresh_seconds)),
            )
        except ValueError as exc:
            raise ValueError(f"adaptive leases: {exc}") from exc


@dataclass(frozen=True)
class DurationStats:
    """One job type's completed durations in the window: ``samples``, the upper bin edges
    holding p50, p99 and p99.9, and the mean (bin middles) that Little's law sizes workers
    with (NaN without samples)."""

    job_type: str
    samples: int
    p50: float
    p99: float
    p999: float
    mean: float = math.nan

    @classmethod
    def of(cls, job_type: str, bins: Mapping[int, int]) -> DurationStats:
        n = sum(bins.values())
        p50, p99, p999 = (upper_quantile(bins, q, n) for q in QUANTILES)
        mean = sum(c * _middle(b) for b, c in bins.items()) / n if n else math.nan
        return cls(job_type, n, p50, p99, p999, mean)

    def at(self, quantile: str) -> float:
        """``mean``, ``p50``, ``p99`` or ``p999``: the duration workers are sized with."""
        return float(getattr(self, quantile))


def _middle(b: int) -> float:
    lo, hi = bin_bounds(b)
    if math.isinf(lo):
        return hi / 2
    return lo if math.isinf(hi) else (lo + hi) / 2


@dataclass(frozen=True)
class LeaseChoice:
    """The lease a claim of a job type takes now, and why (shown by ``sekali doctor``)."""

    seconds: float
    why: str
    observed: bool
    """True when it follows the durations; False when the declared lease is in force."""
    declared: float = 0.0
    """The declared lease (the type's, else the store's): what an operator sized the settle
    window against, so what a send's window after its stamp follows (:data:`engine.context.
    SEND_BOUND`); 0 for unknown (the lease itself then)."""

    @property
    def heartbeat_seconds(self) -> float:
        """The holder renews every third of the lease (:meth:`IdempotencyStore.keep_alive`)."""
        return self.seconds / 3


def upper_quantile(bins: Mapping[int, int], q: float, n: int | None = None) -> float:
    """The upper edge of the histogram bin that holds the ``q`` quantile's nearest rank (the
    last edge for the open top bin); NaN without data."""
    n = sum(bins.values()) if n is None else n
    if n <= 0:
        return math.nan
    rank, below = nearest_rank(q, n), 0
    for b in sorted(bins):
        below += bins[b]
        if below >= rank:
            return HISTOGRAM_EDGES[min(b, len(HISTOGRAM_EDGES) - 1)]
    return HISTOGRAM_EDGES[-1]


def choose_lease(
    stats: DurationStats | None,
    bounds: LeaseBounds,
    *,
    default: float,
    max_runtime: float,
    policy: AdaptivePolicy,
) -> LeaseChoice:
    """The one decision (pure): see the module docstring."""
    declared = bounds.declared or default
    samples = stats.samples if stats is not None else 0
    if not policy.enabled:
        return LeaseChoice(declared, "declared, adaptive leases off (SEKALI_ADAPTIVE=0)", False,
                           declared)
    if stats is None or samples < policy.min_samples or math.isnan(stats.p999):
        return LeaseChoice(declared, f"declared, {samples}<{policy.min_samples} samples", False,
                           declared)
    floor = bounds.floor
    ceiling = bounds.ceiling_for(max_runtime)
    widen = math.sqrt(P999_SAMPLES / samples) if samples < P999_SAMPLES else 1.0
    factor = policy.factor * widen
    raw = stats.p999 * factor
    seconds = min(max(raw, floor), ceiling)
    return LeaseChoice(
        round(seconds, 3),
        f"p99.9 {stats.p999:.3g}s x {factor:.3g} = {raw:.3g}s clamped to [{floor:g}, "
        f"{ceiling:g}]" + (f" (factor {policy.factor:g} widened for {samples}<"
                           f"{P999_SAMPLES} samples)" if widen > 1 else ""),
        True,
        declared,
    )


class LeasedRun(Protocol):
    """What the model reads of how a job type runs (:class:`engine.contract.Running`)."""

    @property
    def lease(self) -> LeaseBounds | None: ...

    @property
    def max_runtime_seconds(self) -> float: ...


class LeasedType(Protocol):
    """What the model reads of a job type (:class:`engine.contract.JobType` has these)."""

    @property
    def name(self) -> str: ...

    @property
    def running(self) -> LeasedRun: ...


class DurationModel:
    """The window's :class:`DurationStats` per job type, read at most every
    ``policy.refresh_seconds`` (thread-safe; one per process is enough). A read that fails
    keeps the last numbers (or none: the declared leases) and is tried again at the next
    refresh, so the database being away never changes a lease to something unmeasured."""

    def __init__(
        self,
        attempts: AttemptRecorder,
        policy: AdaptivePolicy | None = None,
        *,
        clock: Clock = time.time,
    ) -> None:
        self.attempts = attempts
        self.policy = policy or AdaptivePolicy.from_env()
        self.clock = clock
        self._stats: dict[str, DurationStats] = {}
        self._read_at = -math.inf
        self._lock = threading.Lock()

    def stats(self) -> dict[str, DurationStats]:
        now = self.clock()
        with self._lock:
            if now - self._read_at >= self.policy.refresh_seconds:
                self._read_at = now
                try:
                    bins = self.attempts.duration_bins(now - self.policy.window_seconds)
                except Exception:  # noqa: BLE001 - keep the last numbers; the lease falls back
                    return dict(self._stats)
                self._stats = {jt: DurationStats.of(jt, b) for jt, b in bins.items()}
            return dict(self._stats)

    def lease_for(self, job_type: LeasedType, default: float) -> LeaseChoice:
        """The lease a claim of ``job_type`` takes now (``default``: the store's lease)."""
        running = getattr(job_type, "running", None)  # a stand-in may declare none
        return choose_lease(
            self.stats().get(job_type.name) if self.policy.enabled else None,
            getattr(running, "lease", None) or LeaseBounds(),
            default=default,
            max_runtime=float(getattr(running, "max_runtime_seconds", 3600.0)),
            policy=self.policy,
        )


def lease_table(
    model: DurationModel, job_types: Mapping[str, LeasedType], default: float
) -> dict[str, dict[str, float | int | str | bool]]:
    """Per job type (registered, or only observed): the window's samples and p50/p99/p99.9,
    the lease in force, its heartbeat and why: what ``sekali doctor``, the metrics and the
    durations asset show."""
    stats = model.stats()
    out: dict[str, dict[str, float | int | str | bool]] = {}
    for name in sorted(set(job_types) | set(stats)):
        s = stats.get(name) or DurationStats(name, 0, math.nan, math.nan, math.nan)
        row: dict[str, float | int | str | bool] = {
            "samples": s.samples, "p50": s.p50, "p99": s.p99, "p999": s.p999,
            "window_seconds": model.policy.window_seconds,
        }
        jt = job_types.get(name)
        if jt is not None:
            choice = model.lease_for(jt, default)
            row.update(lease_seconds=choice.seconds, heartbeat_seconds=choice.heartbeat_seconds,
                       lease_why=choice.why, lease_observed=choice.observed)
        out[name] = row
    return out
