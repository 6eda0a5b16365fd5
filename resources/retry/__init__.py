"""Retries: one classifier, delays with jitter strategies, the decision, and the shared budget.

Permanent errors are never retried; transient ones are retried with capped exponential backoff
and jitter, up to a limit, under a retry budget per downstream shared by every worker.
"""

from resources.retry.budget import RetryBudget
from resources.retry.classify import (
    ErrorClass,
    FailureClass,
    classify,
    failure_class,
    is_contention,
)
from resources.retry.jitter import (
    JITTERS,
    DecorrelatedJitter,
    EqualJitter,
    FullJitter,
    Jitter,
    NoJitter,
    PlusMinusJitter,
    jitter_named,
)
from resources.retry.policy import (
    BUDGET_UNAVAILABLE,
    RetryDecision,
    RetryPolicy,
    SpendsRetries,
    retry_delay,
)

__all__ = [
    "BUDGET_UNAVAILABLE",
    "JITTERS",
    "DecorrelatedJitter",
    "EqualJitter",
    "ErrorClass",
    "FailureClass",
    "FullJitter",
    "Jitter",
    "NoJitter",
    "PlusMinusJitter",
    "RetryBudget",
    "RetryDecision",
    "RetryPolicy",
    "SpendsRetries",
    "classify",
    "failure_class",
    "is_contention",
    "jitter_named",
    "retry_delay",
]
