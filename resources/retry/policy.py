"""Retry delays and the decision after a failed attempt.

Why sekali computes its own delays instead of using Dagster's op ``RetryPolicy``: Dagster's
exponential backoff has no cap, and its ``PLUS_MINUS`` jitter only adds +/- the base delay, so a
cohort that failed together stays nearly synchronised at higher attempts and hits the recovering
downstream in waves. Here the delay is capped exponential backoff with full jitter by default
(strategies in :mod:`resources.retry.jitter`), jitter stays effective at the cap,
``Retry-After`` is honoured, and attempts and total time are bounded.

Attempt numbering follows Dagster's ``context.retry_number``: ``attempt`` is the number of the
attempt that just failed, counting from 0 (0 = the first run of the step failed). So the delay
before the first retry is ``retry_delay(0)`` and a policy with ``max_attempts=3`` retries after
attempts 0 and 1 and gives up after attempt 2.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from resources.retry.classify import ErrorClass, classify, is_contention
from resources.retry.jitter import Jitter, jitter_named

log = logging.getLogger(__name__)

BUDGET_UNAVAILABLE = "retry budget unavailable"
"""The start of :attr:`RetryDecision.reason` when the budget could not be asked (see
:meth:`RetryPolicy.decide`)."""


def retry_delay(
    attempt: int,
    *,
    base: float = 1.0,
    cap: float = 60.0,
    jitter: str | Jitter = "full",
    previous: float | None = None,
    rng: random.Random | None = None,
) -> float:
    """Seconds to wait before retrying after attempt ``attempt`` (0-based, as ``retry_number``).

    The exponential ceiling is ``min(cap, base * 2**attempt)``; ``jitter`` (a strategy from
    :mod:`resources.retry.jitter`, or its name) draws below it. Every result lies in
    ``[0, cap]``; jitter stays effective at the cap.
    """
    if attempt < 0:
        raise ValueError(f"attempt must be >= 0 (Dagster's retry_number), got {attempt}")
    if base < 0 or cap < 0:
        raise ValueError("base and cap must be >= 0")
    strategy = jitter_named(jitter)
    return strategy(attempt, base, cap, previous, rng or random.Random())


class SpendsRetries(Protocol):
    """Anything that can grant or refuse one retry against a downstream (see RetryBudget)."""

    def try_spend(self, downstream: str) -> bool: ...


@dataclass(frozen=True)
class RetryDecision:
    """What to do after a failed attempt: retry after ``delay`` seconds, or give up with ``reason``.

    ``reason`` on give-up is one of ``"permanent"``, ``"attempts exhausted"``,
    ``"time budget exhausted"``, ``"retry budget exhausted"``. On a retry it is None, or says
    why the retry spent no budget token (:data:`BUDGET_UNAVAILABLE`: the budget's store did not
    answer).
    """

    retry: bool
    error_class: ErrorClass
    attempt: int
    delay: float | None = None
    reason: str | None = None

    @property
    def give_up(self) -> bool:
        return not self.retry


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry one job type.

    ``max_attempts`` counts every run of the step including the first (so Dagster's
    ``max_retries`` is ``max_attempts - 1``). ``max_unknown_attempts`` bounds errors of class
    UNKNOWN, which are more likely bugs than outages. ``total_budget_seconds`` bounds the time
    from the first attempt to the start of the last retry.
    """

    max_attempts: int = 5
    base_delay: float = 1.0
    max_delay: float = 60.0
    jitter: str | Jitter = "full"
    total_budget_seconds: float = 600.0
    max_unknown_attempts: int = 2

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        jitter_named(self.jitter)

    def following(
        self, bursts: Sequence[float], *, min_bursts: int = 3
    ) -> tuple[RetryPolicy, str]:
        """This policy with its base and cap following how long the downstream's failure bursts
        last (``bursts``: their lengths in seconds, :meth:`RetryBudget.bursts`), never below
        the declared ones: ``base = max(base, p50 / 2)`` (with full jitter the first retries
        then land around the typical recovery, not inside it), ``cap = max(cap, p90)`` (a long
        burst's cohort spreads over its whole length). Jitter, attempts and the time budget
        stay as declared. Returns the policy and why (the declared one with fewer than
        ``min_bursts`` bursts observed)."""
        if len(bursts) < min_bursts:
            return self, f"declared, {len(bursts)}<{min_bursts} bursts observed"
        ordered = sorted(bursts)
        p50 = ordered[math.ceil(0.5 * len(ordered)) - 1]
        p90 = ordered[math.ceil(0.9 * len(ordered)) - 1]
        base = max(self.base_delay, p50 / 2)
        cap = max(self.max_delay, p90, base)
        why = (f"bursts p50 {p50:.3g}s p90 {p90:.3g}s over {len(bursts)}: base "
               f"{base:.3g}s (declared {self.base_delay:g}s), cap {cap:.3g}s "
               f"(declared {self.max_delay:g}s)")
        return replace(self, base_delay=base, max_delay=cap), why

    def delay(
        self, attempt: int, *, previous: float | None = None, rng: random.Random | None = None
    ) -> float:
        return retry_delay(
            attempt,
            base=self.base_delay,
            cap=self.max_delay,
            jitter=self.jitter,
            previous=previous,
            rng=rng,
        )

    def decide(
        self,
        exc: BaseException,
        *,
        attempt: int,
        elapsed: float,
        previous_delay: float | None = None,
        retry_after: float | None = None,
        budget: SpendsRetries | None = None,
        downstream: str | None = None,
        rng: random.Random | None = None,
    ) -> RetryDecision:
        """Decide after attempt ``attempt`` (0-based) failed with ``exc``, ``elapsed`` s after the
        first attempt began.

        The delay is ``max(computed, Retry-After)`` (``retry_after`` here, else the error's own
        ``retry_after``), cut to the time budget left. With ``budget`` and ``downstream`` a retry
        spends one token; an empty bucket gives up with ``"retry budget exhausted"``.

        The decision survives its own dependency: when the budget cannot answer (its Redis is
        down, full, read-only or refused), the attempt is retried without spending (not
        budgeted), with ``reason`` saying so, and logged. Retrying is the right default: the
        budget exists to stop a storm against a sick downstream, and the attempts and time
        budget still bound this request's retries; giving up instead would dead-letter every
        transient failure for as long as Redis is away, downstream healthy or not.
        """
        error_class = classify(exc)

        def give_up(reason: str) -> RetryDecision:
            return RetryDecision(False, error_class, attempt, reason=reason)

        if error_class is ErrorClass.PERMANENT:
            return give_up("permanent")
        limit = self.max_attempts
        if error_class is ErrorClass.UNKNOWN:
            limit = min(limit, self.max_unknown_attempts)
        if attempt + 1 >= limit:
            return give_up("attempts exhausted")
        remaining = self.total_budget_seconds - elapsed
        if remaining <= 0:
            return give_up("time budget exhausted")
        delay = self.delay(attempt, previous=previous_delay, rng=rng)
        if retry_after is None:
            retry_after = getattr(exc, "retry_after", None)
        if retry_after is not None:
            delay = max(delay, float(retry_after))
        delay = min(delay, remaining)
        note = None
        if budget is not None and downstream is not None and not is_contention(exc):
            try:
                granted = budget.try_spend(downstream)
            except Exception as unavailable:  # noqa: BLE001 - whatever the budget's store does,
                granted = True  # the decision ends (the fallback in the docstring)
                note = (f"{BUDGET_UNAVAILABLE} ({type(unavailable).__name__}: {unavailable}):"
                        " retried without spending")
                log.warning("%s: %s after attempt %d (%s)", downstream, note, attempt,
                            type(exc).__name__, extra={"downstream": downstream})
            if not granted:
                return give_up("retry budget exhausted")
        return RetryDecision(True, error_class, attempt, delay=delay, reason=note)


# KEYS[1] bucket; ARGV[1] capacity, ARGV[2] ttl ms. Returns 1 and the new level, or 0.
