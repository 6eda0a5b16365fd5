"""The one decision after a failed attempt: classify, decide, record, and say what follows.

Every way a job runs (the per-request op, the fan-out and micro-batch ops, a DLQ replay, the
chaos harness, through :mod:`engine.step`) hands its failures to a :class:`FailurePath`, so a
failure means the same thing everywhere:

1. classify the exception itself (:func:`resources.retry.classify`, and the DLQ's
   :func:`resources.retry.failure_class`), once;
2. decide with the job type's :class:`RetryPolicy` (attempts, time budget, ``Retry-After``, the
   shared retry budget) whether this step retries, unless retries are not this step's to make;
3. the attempt's recorded outcome follows from the decision (:meth:`FailurePath.outcome`, what
   :func:`engine.runtime.execute_request` records);
4. the request's status follows too: ``failed`` (the DLQ takes it) unless a retry follows;
5. the Dagster layer turns the same decision into Dagster's signal
   (:func:`resources.dagster_resources.dagster_signal`).

Contention (a live lease elsewhere, a held lock) is retried without spending the downstream's
retry budget; a permanent error is never retried.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.attempts import Outcome
from engine.dead_letters import DeadLetter, Subject, dead_letter_now, error_text
from engine.requests import RequestStore
from resources.errors import RequestCancelled
from resources.retry import (
    ErrorClass,
    RetryBudget,
    RetryDecision,
    RetryPolicy,
    classify,
    failure_class,
)

log = logging.getLogger(__name__)

NO_RETRY_HERE = "retried by the DLQ, not within this step"

__all__ = ["NO_RETRY_HERE", "FailurePath", "Settled", "error_text"]


@dataclass(frozen=True)
class Settled:
    """What settling a failed request did: its dead letter (given up), or when it is
    claimable again (given back for a retry later), or neither (the step retries it itself, it
    was cancelled, or its row could not be written now)."""

    dead_letter: DeadLetter | None = None
    retry_at: float | None = None


@dataclass
class FailurePath:
    """The decision for the failures of one attempt of one step.

    ``policy`` None means the caller retries on its own: a permanent error gives up, anything
    else is left to be retried. ``retries_here`` False (micro-batch: retrying the step would
    re-run its finished neighbours) gives up at once and leaves the retry to a DLQ replay.
    ``first_started`` returns when the step's first attempt began, for the policy's time
    budget; when it cannot answer (the database is down, often the very failure being decided)
    the decision is made without the time budget: it ends, it never raises. ``follow``
    adapts the policy when a transient failure is decided (the downstream's observed failure
    bursts, :mod:`engine.recovery`): read only then, never on the success path.
    """

    attempt: int = 0
    policy: RetryPolicy | None = None
    budget: RetryBudget | None = None
    downstream: str | None = None
    retries_here: bool = True
    first_started: Callable[[], float | None] = lambda: None
    follow: Callable[[RetryPolicy], RetryPolicy] | None = None
    clock: Callable[[], float] = time.time
    decision: RetryDecision | None = field(default=None, init=False)
    _decided_for: BaseException | None = field(default=None, init=False, repr=False)

    def decide(self, exc: BaseException) -> RetryDecision:
        """Decide once per failure; later calls with the same failure return the same decision."""
        if self.decision is not None and self._decided_for is exc:
            return self.decision
        self.decision = self._decide(exc)
        self._decided_for = exc
        return self.decision

    def _decide(self, exc: BaseException) -> RetryDecision:
        error_class = classify(exc)
        if error_class is ErrorClass.PERMANENT:
            return RetryDecision(False, error_class, self.attempt, reason="permanent")
        if not self.retries_here:
            return RetryDecision(False, error_class, self.attempt, reason=NO_RETRY_HERE)
        if self.policy is None:
            return RetryDecision(True, error_class, self.attempt)
        try:
            first = self.first_started()
        except Exception:  # noqa: BLE001 - the decision survives its own dependency
            # the attempts' store is away (often the very failure being decided): the time
            # budget cannot be asked, the attempts still bound the retries
            log.warning("first attempt's start unknown (store unavailable); deciding without "
                        "the time budget", exc_info=True)
            first = None
        policy = self.follow(self.policy) if self.follow is not None else self.policy
        return policy.decide(
            exc,
            attempt=self.attempt,
            elapsed=0.0 if first is None else max(0.0, self.clock() - first),
            budget=self.budget if self.downstream else None,
            downstream=self.downstream,
        )

    def outcome(self, exc: BaseException) -> Outcome:
        """The attempt's recorded outcome: retried, failed_permanent or dead_lettered."""
        decision = self.decide(exc)
        if decision.retry:
            return Outcome.RETRIED
        if decision.error_class is ErrorClass.PERMANENT:
            return Outcome.FAILED_PERMANENT
        return Outcome.DEAD_LETTERED

    def settle(
        self,
        requests: RequestStore,
        subject: Subject,
        exc: BaseException,
        *,
        run_id: str,
        step: str,
        owner: str | None = None,
        requeue: bool = False,
    ) -> Settled:
        """Settle the request from the decision: a cancelled one (it stopped at a cancel point)
        ``cancelled``, saying what was done; given up: ``failed`` with its DLQ record, in one
        transaction (:func:`engine.dead_letters.dead_letter`); a retry: nothing here (the step
        runs again), or with ``requeue`` back to ``pending``, claimable after the delay.
        ``owner``: a resident worker's run, which moves only what it still holds."""
        if isinstance(exc, RequestCancelled):
            if subject.request_id is not None:
                requests.mark_cancelled(subject.request_id, exc.detail, run_id=run_id)
            return Settled()
        decision = self.decide(exc)
        if decision.retry:
            if not requeue or subject.request_id is None or owner is None:
                return Settled()
            at = self.clock() + (decision.delay or 0.0)
            requests.retry_later(subject.request_id, owner=owner, at=at, error=error_text(exc),
                                 error_class=str(failure_class(exc)))
            return Settled(retry_at=at)
        return Settled(dead_letter=dead_letter_now(
            subject, exc, requests, run_id=run_id, step=step, owner=owner))

    def settle_request(
        self, requests: RequestStore, request_id: int, exc: BaseException, *, run_id: str,
        step: str = "",
    ) -> Settled:
        """:meth:`settle` for a request known by its row id (its row is read for the dead
        letter's subject)."""
        row = requests.get(request_id)  # nosec B113: the request store, not HTTP
        subject = (Subject(row.job_type, row.payload, row.key, row.id, row.correlation_id,
                           row.traceparent)
                   if row is not None else Subject("", None, request_id=request_id))
        return self.settle(requests, subject, exc, run_id=run_id, step=step)
