"""Headline figures that do not swing with the machine: the median of interleaved repetitions.

Two runs of the same ``sekali bench`` on one quiet machine once gave the SQLite micro-batch
ratio 2.08 and 1.27: its floor alone moved by a third between runs. A ratio measured once
judges the moment, not the code. So every headline ratio is measured ``REPETITIONS`` times,
floor and subject alternating (floor, subject, floor, subject, ...: a slow spell of the machine
lands on both sides of one repetition, not on one side of the whole figure), the headline is the
median of the per-repetition ratios, and the report keeps its min-max spread beside it
(``headline_spread``). Targets are judged on the median.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

REPETITIONS = 3
"""Repetitions behind every headline ratio (at least three: a median of two is a mean)."""


@dataclass(frozen=True)
class Spread:
    """A figure measured several times: its median, its extremes and every run, in run order."""

    median: float
    low: float
    high: float
    runs: tuple[float, ...]

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise ValueError("a spread needs at least one value")
        return cls(statistics.median(values), min(values), max(values), tuple(values))

    def as_dict(self, digits: int = 3) -> dict[str, Any]:
        return {
            "median": round(self.median, digits),
            "min": round(self.low, digits),
            "max": round(self.high, digits),
            "runs": [round(v, digits) for v in self.runs],
        }


@dataclass(frozen=True)
class Interleaved:
    """Floor and subject measured alternately: each side's runs and the ratio per repetition."""

    floor: tuple[float, ...]
    subject: tuple[float, ...]

    @property
    def ratio(self) -> Spread:
        """subject / floor per repetition (rates or times alike: the caller knows which way
        is better)."""
        return Spread.of([s / f for f, s in zip(self.floor, self.subject, strict=True)])

    def as_dict(self, digits: int = 3) -> dict[str, Any]:
        return {
            "floor_runs": [round(v, digits) for v in self.floor],
            "subject_runs": [round(v, digits) for v in self.subject],
            "ratio": self.ratio.as_dict(digits),
        }


def interleaved(
    floor: Callable[[int], float],
    subject: Callable[[int], float],
    repetitions: int = REPETITIONS,
) -> Interleaved:
    """``floor(n)`` then ``subject(n)`` for n = 0 .. repetitions - 1 (each returns a rate or a
    time, both sides alike)."""
    floors: list[float] = []
    subjects: list[float] = []
    for n in range(repetitions):
        floors.append(floor(n))
        subjects.append(subject(n))
    return Interleaved(tuple(floors), tuple(subjects))


def headline_of(spreads: dict[str, Spread | None], digits: int = 3) -> dict[str, Any]:
    """A suite's ``headline`` (medians) and ``headline_spread`` from named spreads; a name whose
    figure could not be measured is null in the first and left out of the second."""
    return {
        "headline": {k: None if s is None else round(s.median, digits) for k, s in spreads.items()},
        "headline_spread": {k: s.as_dict(digits) for k, s in spreads.items() if s is not None},
    }
