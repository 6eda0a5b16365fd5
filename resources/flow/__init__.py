"""Flow control shared by every worker: per-key concurrency limits and per-downstream rates.

- :class:`ConcurrencyLimiter`: ``with limiter.hold(key) as slot:`` admits at most ``limit``
  holders of one key across all processes and hosts; a fenced slot, renewed while held, freed
  by its lease if the holder dies; waiters of one key served in arrival order, other keys never
  wait. A wait that runs out raises :class:`LimitNotAcquired` (transient; no retry budget).
- :class:`RateLimiter`: a token bucket in Redis (one Lua script, the server's clock):
  ``try_acquire()``, ``acquire()`` that waits its turn or raises :class:`RateLimited` with
  ``retry_after``, and ``throttle(rate, seconds)`` for a downstream that answered
  ``Retry-After``.
- :class:`ConcurrencyLimits` and :class:`RateLimits`: the limits of one deployment by name,
  as the job platform and the Dagster resources use them; :class:`RateSetting` parses
  ``SEKALI_RATE_<DOWNSTREAM>`` (``50/s,burst=20``).

Neither replaces idempotency: they spare downstreams and shared state, and docs/flow.md
walks their races.
"""

from resources.errors import LimitNotAcquired, RateLimited
from resources.flow.concurrency import ConcurrencyLimiter, Slot
from resources.flow.limits import ConcurrencyLimits, RateLimits, RateSetting
from resources.flow.rate import RateGrant, RateLimiter, RateState

__all__ = [
    "ConcurrencyLimiter",
    "ConcurrencyLimits",
    "LimitNotAcquired",
    "RateGrant",
    "RateLimited",
    "RateLimiter",
    "RateLimits",
    "RateSetting",
    "RateState",
    "Slot",
]
