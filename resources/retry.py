"""Error classes, retry delays, a shared retry budget, and the adapter to Dagster's retries.

Why sekali computes its own delays instead of using Dagster's op ``RetryPolicy``: Dagster's
exponential backoff has no cap, and its ``PLUS_MINUS`` jitter only adds +/- the base delay, so a
cohort that failed together stays nearly synchronised at higher attempts and hits the recovering
downstream in waves. Here the delay is capped exponential backoff with full jitter by default
(decorrelated as an option), jitter stays effective at the cap, ``Retry-After`` is honoured, and
attempts and total time are bounded. Ops raise the result through ``RetryRequested``.

Attempt numbering follows Dagster's ``context.retry_number``: ``attempt`` is the number of the
attempt that just failed, counting from 0 (0 = the first run of the step failed). So the delay
before the first retry is ``retry_delay(0)`` and a policy with ``max_attempts=3`` retries after
attempts 0 and 1 and gives up after attempt 2.

Error classes (invariant 5: permanent errors are never retried):

- PERMANENT: sekali errors with ``permanent = True`` (validation, conflicts, rejected by a
  downstream), pydantic validation errors, ``Failure(allow_retries=False)``, SMTP 5xx replies.
- TRANSIENT: timeouts, connection errors, ``OSError``, SQLAlchemy ``OperationalError``, Redis
  connection/timeouts, ``AlreadyInProgress``, ``LockNotAcquired`` and every other sekali error
  with ``permanent = False``.
- UNKNOWN: everything else, including ``KeyError``/``ValueError``/``TypeError`` raised by our own
  code. These are most often bugs: retried a little (``max_unknown_attempts``), then
  dead-lettered so a person looks at them. Bad *input* must be raised as
  :class:`resources.errors.ValidationError` at the boundary, which is permanent.

The retry budget (:class:`RetryBudget`) is a token bucket per downstream shared by every worker:
each retry spends a token, each clean success refunds ``refill_per_success``. When it is empty
sekali gives up on the job with the reason ``"retry budget exhausted"`` (the job is dead-lettered
and replayed later, rate limited) rather than waiting: a waiting run holds a run-worker slot, and
a sick downstream would fill every slot with sleepers. First attempts never spend tokens, so
successes keep arriving (and refilling the bucket) once the downstream is back.
"""

from __future__ import annotations

import enum
import logging
import random
import smtplib
from dataclasses import dataclass
from typing import Protocol

import redis
from dagster import ConfigurableResource, Failure, RetryRequested
from pydantic import PrivateAttr
from sqlalchemy import exc as sa_exc

from resources.errors import SekaliError

log = logging.getLogger(__name__)

JITTERS = ("none", "full", "equal", "decorrelated", "plus_minus")
_MAX_EXPONENT = 64


class ErrorClass(enum.StrEnum):
    PERMANENT = "permanent"
    TRANSIENT = "transient"
    UNKNOWN = "unknown"


_TRANSIENT_TYPES: tuple[type[BaseException], ...] = (
    TimeoutError,
    ConnectionError,
    sa_exc.OperationalError,
    sa_exc.InterfaceError,
    sa_exc.DisconnectionError,
    redis.ConnectionError,
    redis.TimeoutError,
    OSError,
)


def classify(exc: BaseException) -> ErrorClass:
    """Say whether a retry may help. See the module docstring for the table."""
    if isinstance(exc, SekaliError):
        return ErrorClass.PERMANENT if exc.permanent else ErrorClass.TRANSIENT
    if isinstance(exc, Failure):
        return ErrorClass.UNKNOWN if exc.allow_retries else ErrorClass.PERMANENT
    if isinstance(exc, smtplib.SMTPResponseException):
        return ErrorClass.PERMANENT if exc.smtp_code >= 500 else ErrorClass.TRANSIENT
    if isinstance(exc, smtplib.SMTPRecipientsRefused):
        codes = [code for code, _msg in exc.recipients.values()]
        return (
            ErrorClass.PERMANENT if codes and min(codes) >= 500 else ErrorClass.TRANSIENT
        )
    if _is_pydantic_validation_error(exc):
        return ErrorClass.PERMANENT
    if isinstance(exc, _TRANSIENT_TYPES):
        return ErrorClass.TRANSIENT
    return ErrorClass.UNKNOWN


def _is_pydantic_validation_error(exc: BaseException) -> bool:
    try:
        import pydantic  # noqa: PLC0415 - dagster already imports it

        return isinstance(exc, pydantic.ValidationError)
    except ImportError:  # pragma: no cover
        return False


def retry_delay(
    attempt: int,
    *,
    base: float = 1.0,
    cap: float = 60.0,
    jitter: str = "full",
    previous: float | None = None,
    rng: random.Random | None = None,
) -> float:
    """Seconds to wait before retrying after attempt ``attempt`` (0-based, as ``retry_number``).

    The exponential part is ``min(cap, base * 2**attempt)``. Jitter:

    - ``none``: exactly that. Every job of a cohort retries at the same instant: use only to
      show why jitter exists.
    - ``full`` (default, the best spread for contention): ``uniform(0, exp)``.
    - ``equal``: ``exp/2 + uniform(0, exp/2)``; never retries almost at once.
    - ``decorrelated``: ``uniform(base, min(cap, 3 * previous))`` with ``previous`` the last
      delay (``base`` when unknown). Unlike the AWS formula ``min(cap, uniform(base, 3*prev))``,
      the upper bound is capped *before* drawing, so delays do not pile up exactly at the cap.
    - ``plus_minus``: Dagster's ``Jitter.PLUS_MINUS`` with ``Backoff.EXPONENTIAL``:
      ``(2**(attempt+1) - 1) * base`` +/- ``base``, here with the cap added (a draw above the
      cap is reflected below it, so the spread stays). Kept for comparison.

    Every result lies in ``[0, cap]``; jitter stays effective at the cap.
    """
    if attempt < 0:
        raise ValueError(f"attempt must be >= 0 (Dagster's retry_number), got {attempt}")
    if base < 0 or cap < 0:
        raise ValueError("base and cap must be >= 0")
    rng = rng or random.Random()
    exponent = min(attempt, _MAX_EXPONENT)
    ceiling = min(cap, base * 2.0**exponent)
    if jitter == "none":
        return ceiling
    if jitter == "full":
        return rng.uniform(0.0, ceiling)
    if jitter == "equal":
        return ceiling / 2 + rng.uniform(0.0, ceiling / 2)
    if jitter == "decorrelated":
        if cap <= base:
            return cap
        prev = base if previous is None else max(previous, base)
        return rng.uniform(base, min(cap, prev * 3))
    if jitter == "plus_minus":
        center = min(cap, (2.0 ** min(attempt + 1, _MAX_EXPONENT) - 1) * base)
        delay = center + rng.uniform(-base, base)
        if delay > cap:
            delay = 2 * cap - delay
        return min(cap, max(0.0, delay))
    raise ValueError(f"jitter must be one of {JITTERS}, got {jitter!r}")


class SpendsRetries(Protocol):
    """Anything that can grant or refuse one retry against a downstream (see RetryBudget)."""

    def try_spend(self, downstream: str) -> bool: ...


@dataclass(frozen=True)
class RetryDecision:
    """What to do after a failed attempt: retry after ``delay`` seconds, or give up with ``reason``.

    ``reason`` on give-up is one of ``"permanent"``, ``"attempts exhausted"``,
    ``"time budget exhausted"``, ``"retry budget exhausted"``.
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
    jitter: str = "full"
    total_budget_seconds: float = 600.0
    max_unknown_attempts: int = 2

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if self.jitter not in JITTERS:
            raise ValueError(f"jitter must be one of {JITTERS}, got {self.jitter!r}")

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
        if (
            budget is not None
            and downstream is not None
            and not _is_contention(exc)
            and not budget.try_spend(downstream)
        ):
            return give_up("retry budget exhausted")
        return RetryDecision(True, error_class, attempt, delay=delay)


def to_dagster(
    exc: BaseException,
    *,
    attempt: int,
    policy: RetryPolicy,
    elapsed: float = 0.0,
    budget: RetryBudget | None = None,
    downstream: str | None = None,
    previous_delay: float | None = None,
) -> BaseException:
    """Turn a failure inside an op into what Dagster should see. Raise the result ``from exc``.

    Retry -> ``RetryRequested(max_retries=policy.max_attempts - 1, seconds_to_wait=delay)``.
    Give up -> ``Failure(allow_retries=False)`` with metadata ``error_class``, ``reason``,
    ``attempt``, ``error_type``. Note the run-retry daemon ignores ``allow_retries``: jobs that
    use run retries must also set ``dagster/retry_on_asset_or_op_failure: false``.
    """
    decision = policy.decide(
        exc,
        attempt=attempt,
        elapsed=elapsed,
        previous_delay=previous_delay,
        budget=budget,
        downstream=downstream,
    )
    if decision.retry:
        log.info(
            "retrying after attempt %d in %.3fs (%s: %s)",
            attempt,
            decision.delay,
            decision.error_class,
            type(exc).__name__,
            extra={"attempt": attempt, "error_class": str(decision.error_class)},
        )
        return RetryRequested(
            max_retries=policy.max_attempts - 1, seconds_to_wait=decision.delay
        )
    log.warning(
        "giving up after attempt %d: %s (%s: %s)",
        attempt,
        decision.reason,
        decision.error_class,
        exc,
        extra={"attempt": attempt, "error_class": str(decision.error_class)},
    )
    return Failure(
        description=f"{decision.reason} after attempt {attempt} "
        f"({decision.error_class}): {type(exc).__name__}: {exc}",
        allow_retries=False,
        metadata={
            "error_class": str(decision.error_class),
            "reason": decision.reason or "",
            "attempt": attempt,
            "error_type": type(exc).__name__,
        },
    )


# KEYS[1] bucket; ARGV[1] capacity, ARGV[2] ttl ms. Returns 1 and the new level, or 0.
_SPEND = """
local level = tonumber(redis.call('GET', KEYS[1]) or ARGV[1])
if level >= 1 then
    level = level - 1
    redis.call('SET', KEYS[1], tostring(level), 'PX', ARGV[2])
    return {1, tostring(level)}
end
return {0, tostring(level)}
"""

# KEYS[1] bucket; ARGV[1] capacity, ARGV[2] amount, ARGV[3] ttl ms. Returns the new level.
_REFUND = """
local capacity = tonumber(ARGV[1])
local level = tonumber(redis.call('GET', KEYS[1]) or ARGV[1])
level = math.min(capacity, level + tonumber(ARGV[2]))
if level >= capacity then
    redis.call('DEL', KEYS[1])
else
    redis.call('SET', KEYS[1], tostring(level), 'PX', ARGV[3])
end
return tostring(level)
"""


class RetryBudget:
    """A token bucket per downstream in Redis, shared by every worker of every process.

    Guarantee: the number of successful ``try_spend`` calls between refunds never exceeds the
    tokens in the bucket (each spend and refund is one Lua script, atomic in Redis). A missing
    bucket is full, so a fresh or flushed Redis starts generous rather than blocking work. With
    ``refill_per_success = 0.1`` retries are held to about 10% of successful calls in a steady
    state (the gRPC retry-throttling rule). Keys: ``{namespace}:retry-budget:{<downstream>}``
    (hash tag: Redis Cluster safe). An idle bucket's key expires after ``idle_ttl_seconds``
    (back to full).
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        capacity: float = 100.0,
        refill_per_success: float = 0.1,
        namespace: str = "sekali",
        idle_ttl_seconds: float = 24 * 3600,
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1 token")
        self.client = client
        self.capacity = float(capacity)
        self.refill_per_success = float(refill_per_success)
        self.namespace = namespace
        self._ttl_ms = int(idle_ttl_seconds * 1000)
        self._spend = client.register_script(_SPEND)
        self._refund = client.register_script(_REFUND)

    def key(self, downstream: str) -> str:
        return f"{self.namespace}:retry-budget:{{{downstream}}}"

    def try_spend(self, downstream: str) -> bool:
        """Take one token for one retry; False when the bucket is empty (do not retry)."""
        ok, _level = self._spend(keys=[self.key(downstream)], args=[self.capacity, self._ttl_ms])
        return bool(int(ok))

    def refund(self, downstream: str) -> float:
        """Record a clean success: add ``refill_per_success`` up to capacity. Returns the level."""
        level = self._refund(
            keys=[self.key(downstream)],
            args=[self.capacity, self.refill_per_success, self._ttl_ms],
        )
        return float(level)

    def level(self, downstream: str) -> float:
        raw = self.client.get(self.key(downstream))
        return self.capacity if raw is None else float(raw)

    def reset(self, downstream: str) -> None:
        """Fill the bucket again (operator action after an incident)."""
        self.client.delete(self.key(downstream))


class RetryResource(ConfigurableResource):
    """Dagster resource: the retry policy and the shared retry budget.

    ``redis_url`` defaults to ``REDIS_URL`` (read at setup); the Redis client connects lazily.
    Set ``budget_enabled: false`` to retry without a budget.
    """

    max_attempts: int = 5
    base_delay: float = 1.0
    max_delay: float = 60.0
    jitter: str = "full"
    total_budget_seconds: float = 600.0
    max_unknown_attempts: int = 2
    redis_url: str | None = None
    budget_enabled: bool = True
    budget_capacity: float = 100.0
    budget_refill_per_success: float = 0.1
    budget_namespace: str = "sekali"

    _budget: RetryBudget | None = PrivateAttr(default=None)

    def get_policy(self) -> RetryPolicy:
        return RetryPolicy(
            max_attempts=self.max_attempts,
            base_delay=self.base_delay,
            max_delay=self.max_delay,
            jitter=self.jitter,
            total_budget_seconds=self.total_budget_seconds,
            max_unknown_attempts=self.max_unknown_attempts,
        )

    def get_budget(self) -> RetryBudget | None:
        if not self.budget_enabled:
            return None
        if self._budget is None:
            from resources.settings import Settings  # noqa: PLC0415 - env read at use only

            url = self.redis_url or Settings.from_env().redis_url
            self._budget = RetryBudget(
                redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5),
                capacity=self.budget_capacity,
                refill_per_success=self.budget_refill_per_success,
                namespace=self.budget_namespace,
            )
        return self._budget

    def record_success(self, downstream: str) -> None:
        """Call after each clean success against ``downstream``: refunds the shared budget."""
        budget = self.get_budget()
        if budget is not None:
            budget.refund(downstream)

    def to_dagster(
        self,
        exc: BaseException,
        *,
        attempt: int,
        elapsed: float = 0.0,
        downstream: str | None = None,
    ) -> BaseException:
        """:func:`to_dagster` with this resource's policy and budget."""
        return to_dagster(
            exc,
            attempt=attempt,
            policy=self.get_policy(),
            elapsed=elapsed,
            budget=self.get_budget() if downstream else None,
            downstream=downstream,
        )


__all__ = [
    "ErrorClass",
    "RetryBudget",
    "RetryDecision",
    "RetryPolicy",
    "RetryResource",
    "SpendsRetries",
    "classify",
    "retry_delay",
    "to_dagster",
]


def _is_contention(exc: BaseException) -> bool:
    """Waiting for another worker (a live lease, a held lock) says nothing about the downstream's
    health, so it spends no token of the downstream's retry budget."""
    from resources.errors import AlreadyInProgress, LockNotAcquired  # noqa: PLC0415

    return isinstance(exc, AlreadyInProgress | LockNotAcquired)
