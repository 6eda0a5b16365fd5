"""Retry delays that follow how long each downstream takes to recover.

A retry policy's base delay and cap are guesses; what a sick downstream actually does is in
its failure bursts: from the first retried failure to the next clean success, measured by the
shared retry budget's own scripts at no extra round trip (:meth:`RetryBudget.bursts`, the last
50 per downstream, across every worker). :class:`RecoveryWatch` reads them at most every
``refresh_seconds`` per downstream and gives the policy :meth:`RetryPolicy.following` derives:
never below the declared base and cap, full jitter, attempts, time budget and the shared budget
unchanged. Redis away: the declared policy (the decision must not depend on this read).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from resources.retry import RetryBudget, RetryPolicy

log = logging.getLogger(__name__)


class RecoveryWatch:
    """The observed burst lengths per downstream, cached (thread-safe)."""

    def __init__(
        self,
        budget: RetryBudget | None,
        *,
        refresh_seconds: float = 30.0,
        min_bursts: int = 3,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.budget = budget
        self.refresh_seconds = refresh_seconds
        self.min_bursts = min_bursts
        self.clock = clock
        self._read: dict[str, tuple[float, list[float]]] = {}
        self._lock = threading.Lock()

    def bursts(self, downstream: str) -> list[float]:
        if self.budget is None:
            return []
        now = self.clock()
        with self._lock:
            cached = self._read.get(downstream)
            if cached is not None and now - cached[0] < self.refresh_seconds:
                return cached[1]
        try:
            found = self.budget.bursts(downstream)
        except Exception:  # noqa: BLE001 - Redis away: the declared delays, as before
            log.debug("could not read the failure bursts of %s", downstream, exc_info=True)
            found = cached[1] if cached is not None else []
        with self._lock:
            self._read[downstream] = (now, found)
        return found

    def policy(self, declared: RetryPolicy, downstream: str | None) -> tuple[RetryPolicy, str]:
        """The policy for a failure at ``downstream`` now, and why."""
        if downstream is None:
            return declared, "declared, no downstream"
        return declared.following(self.bursts(downstream), min_bursts=self.min_bursts)
