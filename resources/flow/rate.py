"""A shared token bucket: one rate for every process that calls one downstream."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from resources.errors import RateLimited
from resources.storage.redis import REDIS_ERRORS, RedisClient, Script, hash_tag

# KEYS[1] - the bucket: hash tokens (may be < 0: reserved turns), at_us (when tokens was true),
#           trate and tuntil_us (a lowered rate and when it ends; absent when not throttled)
# A missing bucket is full; its key expires once it would be full again.
_PRELUDE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local rate = tonumber(ARGV[1]) / 1000000
local burst = tonumber(ARGV[2])
local b = redis.call('HMGET', KEYS[1], 'tokens', 'at_us', 'trate', 'tuntil_us')
local tokens = tonumber(b[1]) or burst
local at = math.min(tonumber(b[2]) or now, now)
local trate = (tonumber(b[3]) or 0) / 1000000
local tuntil = tonumber(b[4]) or 0
-- refill from at to now: at the lowered rate until tuntil, then at the set rate
if at < tuntil then
  local upto = math.min(now, tuntil)
  tokens = math.min(burst, tokens + (upto - at) * trate)
  at = upto
end
tokens = math.min(burst, tokens + (now - at) * rate)
-- microseconds until `need` more tokens have accrued
local function time_to(need)
  if need <= 0 then return 0 end
  local spent = 0
  if now < tuntil then
    local span = tuntil - now
    if trate > 0 and need <= span * trate then return math.ceil(need / trate) end
    need = need - span * trate
    spent = span
  end
  return math.ceil(spent + need / rate)
end
local function save()
  if now >= tuntil then
    redis.call('HDEL', KEYS[1], 'trate', 'tuntil_us')
  end
  redis.call('HSET', KEYS[1], 'tokens', string.format('%.6f', tokens), 'at_us',
             string.format('%d', now))
  redis.call('PEXPIRE', KEYS[1], math.ceil(time_to(burst - tokens) / 1000) + 1000)
end
"""

# ARGV[1] - rate per second   ARGV[2] - burst   ARGV[3] - cost
# ARGV[4] - the longest wait in us the caller accepts (-1: any; 0: only a token there now)
# returns {1, wait_us, now_us}: granted, the caller's turn comes wait_us after now_us
#         {0, retry_after_us, now_us}: refused, enough tokens for it accrue by then
_TAKE = (
    _PRELUDE
    + """
local cost = tonumber(ARGV[3])
local max_wait = tonumber(ARGV[4])
local wait = time_to(cost - tokens)
if max_wait >= 0 and wait > max_wait then
  return {0, wait, now}
end
tokens = tokens - cost
save()
return {1, wait, now}
"""
)

# ARGV[1] - rate per second   ARGV[2] - burst   ARGV[3] - lowered rate   ARGV[4] - for how long, us
# returns the server time (us) the lowered rate ends. Saved tokens are dropped (reserved turns
# stay); overlapping throttles keep the lower rate and the later end.
_THROTTLE = (
    _PRELUDE
    + """
local new_rate = tonumber(ARGV[3]) / 1000000
local new_until = now + tonumber(ARGV[4])
if now < tuntil then
  trate = math.min(trate, new_rate)
  tuntil = math.max(tuntil, new_until)
else
  trate = new_rate
  tuntil = new_until
end
tokens = math.min(tokens, 0)
redis.call('HSET', KEYS[1], 'trate', string.format('%.6f', trate * 1000000),
           'tuntil_us', string.format('%d', tuntil))
save()
return tuntil
"""
)

# ARGV[1] - rate per second   ARGV[2] - burst
# returns {tokens now, lowered rate or '', us until it ends (0: not throttled)}; writes nothing
_PEEK = (
    _PRELUDE
    + """
if now >= tuntil then return {string.format('%.6f', tokens), '', 0} end
return {string.format('%.6f', tokens), string.format('%.6f', trate * 1000000), tuntil - now}
"""
)


@dataclass(frozen=True)
class RateGrant:
    """A granted call: how long it waited for its turn, and the server time its turn came."""

    waited: float
    at: float


@dataclass(frozen=True)
class RateState:
    """The bucket now: tokens (negative: turns already reserved), and the lowered rate and the
    seconds it still lasts when a :meth:`RateLimiter.throttle` is in force."""

    tokens: float
    throttled_rate: float | None
    throttled_for: float


class RateLimiter:
    """A token bucket in Redis shared by every process: ``rate`` tokens a second, ``burst`` at most.

    Guarantee: over any window of ``t`` seconds the calls granted (by the server's clock) take
    at most ``burst + rate * t`` tokens, whatever the number of processes, hosts or threads.
    Each grant is one Lua script that refills by the Redis server's ``TIME``, so skewed client
    clocks change nothing.

    - :meth:`try_acquire` takes tokens only if they are there now, never queues: for work that
      can be skipped or done later.
    - :meth:`acquire` waits its turn: when the bucket is short, the script reserves the caller's
      turn (the level goes below zero) and says how long to sleep, so callers are served in the
      order they asked and nobody polls. If the turn is further away than ``blocking_timeout``,
      nothing is reserved and :class:`RateLimited` carries ``retry_after`` (when it would come).
    - :meth:`throttle` lowers the rate for a while, for a downstream that answered
      ``Retry-After``: saved tokens are dropped and the bucket refills at the lower rate (``0``:
      not at all) until the time is up.

    A caller that dies after reserving its turn wastes that turn: the rate can be under-used,
    never exceeded. Race timeline of the reservation (rate 10/s, burst 1, bucket empty)::

        t=0.00  A asks: level 0 -> -1, A sleeps 0.1 s     (its turn: t=0.10)
        t=0.01  B asks: level -0.9 -> -1.9, B sleeps 0.19 (its turn: t=0.20)
        t=0.02  C asks with blocking_timeout=0.1: its turn would be t=0.30, so nothing is
                reserved and C gets RateLimited(retry_after=0.28)

    Key: ``{prefix}{<name>}`` (a hash; hash tag: Redis Cluster safe). Every process using one
    ``name`` must use the same ``rate`` and ``burst``.
    """

    def __init__(
        self,
        client: RedisClient,
        name: str,
        *,
        rate: float,
        burst: float,
        prefix: str = "sekali:flow:rate:",
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not name:
            raise ValueError("a rate limiter needs a non-empty name")
        if rate <= 0:
            raise ValueError(f"rate must be > 0 tokens a second, got {rate!r}")
        if burst < 1:
            raise ValueError(f"burst must be >= 1 token, got {burst!r}")
        self.client = client
        self.name = name
        self.rate = float(rate)
        self.burst = float(burst)
        self.key = f"{prefix}{{{hash_tag(name)}}}"
        self.sleep = sleep
        self._take = Script(client, _TAKE, keeps="rate buckets")
        self._throttle = Script(client, _THROTTLE, keeps="rate buckets")
        self._peek = Script(client, _PEEK, keeps="rate buckets")

    def _check_cost(self, cost: float) -> None:
        if cost <= 0 or cost > self.burst:
            raise ValueError(f"cost must be > 0 and <= burst ({self.burst:g}), got {cost!r}")

    def _call_take(self, cost: float, max_wait_us: int) -> tuple[bool, int, int]:
        granted, us, now = self._take(
            keys=[self.key], args=[self.rate, self.burst, cost, max_wait_us]
        )
        return int(granted) == 1, int(us), int(now)

    def try_acquire(self, cost: float = 1) -> bool:
        """Take ``cost`` tokens if the bucket holds them now; False (and nothing taken) if not."""
        self._check_cost(cost)
        granted, _, _ = self._call_take(cost, 0)
        return granted

    def acquire(self, cost: float = 1, *, blocking_timeout: float | None = None) -> RateGrant:
        """Take ``cost`` tokens, sleeping until this caller's turn if the bucket is short.

        Raises :class:`RateLimited` (``retry_after`` set) at once, without waiting, when the
        turn is further away than ``blocking_timeout`` seconds (``None``: any wait is fine;
        ``0``: only tokens there now).
        """
        self._check_cost(cost)
        max_wait = -1 if blocking_timeout is None else int(max(0.0, blocking_timeout) * 1e6)
        granted, us, now = self._call_take(cost, max_wait)
        if not granted:
            raise RateLimited(self.name, retry_after=us / 1e6, cost=cost)
        if us > 0:
            self.sleep(us / 1e6)
        return RateGrant(waited=us / 1e6, at=(now + us) / 1e6)

    def throttle(self, rate: float, seconds: float) -> float:
        """Lower the rate to ``rate`` tokens a second (``0``: none) for ``seconds``.

        For a downstream that answered ``Retry-After: seconds``. Tokens saved in the bucket are
        dropped, so no burst hits a downstream that asked for less; turns already reserved
        keep their place. Returns the server time (seconds) the lowered rate ends.
        """
        if rate < 0 or seconds < 0:
            raise ValueError("throttle rate and seconds must be >= 0")
        until = self._throttle(
            keys=[self.key],
            args=[self.rate, self.burst, min(rate, self.rate), int(seconds * 1e6)],
        )
        return int(until) / 1e6

    def state(self) -> RateState:
        """The bucket as the server sees it now. Reads only."""
        tokens, trate, left_us = self._peek(keys=[self.key], args=[self.rate, self.burst])
        lowered = float(trate) if trate not in (b"", "") else None
        return RateState(float(tokens), lowered, int(left_us) / 1e6)

    def reset(self) -> None:
        """Fill the bucket again and end any throttle (operator action)."""
        self.client.delete(self.key)

    @contextlib.contextmanager
    def paced(
        self,
        cost: float = 1,
        *,
        blocking_timeout: float | None = None,
        throttle_rate: float = 0.0,
    ) -> Iterator[RateGrant]:
        """One paced call: :meth:`acquire`, then the block; if the block raises an error that
        carries ``retry_after`` (the downstream's ``Retry-After``), :meth:`throttle` to
        ``throttle_rate`` for that long and re-raise."""
        grant = self.acquire(cost, blocking_timeout=blocking_timeout)
        try:
            yield grant
        except Exception as exc:
            retry_after = getattr(exc, "retry_after", None)
            if isinstance(retry_after, int | float) and retry_after > 0:
                with contextlib.suppress(*REDIS_ERRORS):
                    self.throttle(throttle_rate, float(retry_after))
            raise

    def __repr__(self) -> str:
        return f"RateLimiter({self.name!r}, rate={self.rate:g}/s, burst={self.burst:g})"
