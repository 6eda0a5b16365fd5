"""Jitter strategies: how a retry delay is drawn below its exponential ceiling.

Each strategy is a small callable object ``(attempt, base, cap, previous, rng) -> seconds``
whose result lies in ``[0, cap]``. ``attempt`` counts from 0 as Dagster's ``retry_number``;
``previous`` is the last delay drawn (only :class:`DecorrelatedJitter` reads it).
"""

from __future__ import annotations

import random
from typing import Protocol

MAX_EXPONENT = 64


def ceiling(attempt: int, base: float, cap: float) -> float:
    """The exponential part: ``min(cap, base * 2**attempt)``."""
    return min(cap, base * 2.0 ** min(attempt, MAX_EXPONENT))


class Jitter(Protocol):
    name: str

    def __call__(
        self, attempt: int, base: float, cap: float, previous: float | None, rng: random.Random
    ) -> float: ...


class NoJitter:
    """Exactly the exponential ceiling. Every job of a cohort retries at the same instant: use it
    only to show why jitter exists."""

    name = "none"

    def __call__(
        self, attempt: int, base: float, cap: float, previous: float | None, rng: random.Random
    ) -> float:
        return ceiling(attempt, base, cap)


class FullJitter:
    """``uniform(0, ceiling)``: the best spread for contention and the default. A cohort that
    failed together comes back spread over the whole window."""

    name = "full"

    def __call__(
        self, attempt: int, base: float, cap: float, previous: float | None, rng: random.Random
    ) -> float:
        return rng.uniform(0.0, ceiling(attempt, base, cap))


class EqualJitter:
    """``ceiling/2 + uniform(0, ceiling/2)``: never retries almost at once, at the cost of a
    narrower spread. Use it when an immediate retry is known to be useless."""

    name = "equal"

    def __call__(
        self, attempt: int, base: float, cap: float, previous: float | None, rng: random.Random
    ) -> float:
        top = ceiling(attempt, base, cap)
        return top / 2 + rng.uniform(0.0, top / 2)


class DecorrelatedJitter:
    """``uniform(base, min(cap, 3 * previous))``, ``previous`` the last delay (``base`` when
    unknown). Unlike the AWS formula ``min(cap, uniform(base, 3*prev))`` the upper bound is capped
    *before* drawing, so delays do not pile up exactly at the cap. Good for long outages."""

    name = "decorrelated"

    def __call__(
        self, attempt: int, base: float, cap: float, previous: float | None, rng: random.Random
    ) -> float:
        if cap <= base:
            return cap
        prev = base if previous is None else max(previous, base)
        return rng.uniform(base, min(cap, prev * 3))


class PlusMinusJitter:
    """Dagster's ``Jitter.PLUS_MINUS`` with ``Backoff.EXPONENTIAL``: ``(2**(attempt+1) - 1) *
    base`` +/- ``base``, here with the cap added (a draw above the cap is reflected below it, so
    the spread stays). Kept for comparison: the cohort stays nearly synchronised."""

    name = "plus_minus"

    def __call__(
        self, attempt: int, base: float, cap: float, previous: float | None, rng: random.Random
    ) -> float:
        center = min(cap, (2.0 ** min(attempt + 1, MAX_EXPONENT) - 1) * base)
        delay = center + rng.uniform(-base, base)
        if delay > cap:
            delay = 2 * cap - delay
        return min(cap, max(0.0, delay))


STRATEGIES: dict[str, Jitter] = {
    j.name: j for j in (NoJitter(), FullJitter(), EqualJitter(), DecorrelatedJitter(),
                        PlusMinusJitter())
}
JITTERS = tuple(STRATEGIES)


def jitter_named(jitter: str | Jitter) -> Jitter:
    """The strategy for a name from configuration (``"full"``), or the object itself."""
    if not isinstance(jitter, str):
        return jitter
    try:
        return STRATEGIES[jitter]
    except KeyError:
        raise ValueError(f"jitter must be one of {JITTERS}, got {jitter!r}") from None
