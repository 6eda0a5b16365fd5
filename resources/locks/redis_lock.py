"""The Redis lock: owner token, FIFO wake-ups, Lua compare-and-delete/extend, and a fence."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

from resources.errors import StoreUnavailable
from resources.locks.base import BaseLock
from resources.locks.stats import LockObserver, default_stats
from resources.storage.redis import (
    REDIS_ERRORS,
    UNREACHABLE,
    RedisClient,
    Script,
    client_timeouts,
    hash_tag,
)

log = logging.getLogger(__name__)
Clock = Callable[[], float]

# -- Redis ------------------------------------------------------------------------------------

# KEYS: lock, fence, queue (zset by arrival), alive (zset by waiter deadline)
# Dropping waiters that stopped refreshing runs only when someone waits, so an uncontended grant
# is EXISTS, EXISTS, INCR, TIME, SET (fence), SET (lock).
_LUA_PRELUDE = """
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local function drop_dead_waiters()
  local dead = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', math.floor(now_us() / 1000))
  for _, w in ipairs(dead) do
    redis.call('ZREM', KEYS[4], w)
    redis.call('ZREM', KEYS[3], w)
  end
end
local function wake_head(prefix, ttl_ms)
  local head = redis.call('ZRANGE', KEYS[3], 0, 0)
  if #head > 0 then
    redis.call('LPUSH', prefix .. head[1], '1')
    redis.call('PEXPIRE', prefix .. head[1], ttl_ms)
  end
end
"""

# KEYS[1] - lock name    KEYS[2] - fence counter    KEYS[3] - queue    KEYS[4] - alive
# ARGV[1] - owner token  ARGV[2] - ttl in ms        ARGV[3] - queue ttl in ms (0: do not queue)
# returns {1, fence} when granted, {0, PTTL of the lock} otherwise (the caller is queued)
# Wake-up lists: KEYS[1]..':signal:'..token
_ACQUIRE = (
    _LUA_PRELUDE
    + """
local queued = redis.call('EXISTS', KEYS[3]) == 1
if queued then drop_dead_waiters() end
if redis.call('EXISTS', KEYS[1]) == 0 then
  local head = queued and redis.call('ZRANGE', KEYS[3], 0, 0) or {}
  if #head == 0 or head[1] == ARGV[1] then
    -- max(counter + 1, server clock in us), written back: a counter that lost recent grants
    -- (an older snapshot, a lagging replica, an expired key) still issues a larger token
    local fence = math.max(redis.call('INCR', KEYS[2]), now_us())
    redis.call('SET', KEYS[2], string.format('%d', fence), 'PX', 604800000)
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
    if #head > 0 then
      redis.call('ZREM', KEYS[3], ARGV[1])
      redis.call('ZREM', KEYS[4], ARGV[1])
      redis.call('DEL', KEYS[1] .. ':signal:' .. ARGV[1])
    end
    return {1, fence}
  end
end
if ARGV[3] ~= '0' then
  local us = now_us()
  redis.call('ZADD', KEYS[3], 'NX', us, ARGV[1])
  redis.call('ZADD', KEYS[4], math.floor(us / 1000) + tonumber(ARGV[3]), ARGV[1])
  redis.call('PEXPIRE', KEYS[3], 2 * tonumber(ARGV[3]))
  redis.call('PEXPIRE', KEYS[4], 2 * tonumber(ARGV[3]))
end
return {0, redis.call('PTTL', KEYS[1])}
"""
)

# KEYS[1] - lock name    KEYS[2] - fence counter    KEYS[3] - queue    KEYS[4] - alive
# ARGV[1] - owner token  ARGV[2] - signal key prefix  ARGV[3] - signal list ttl in ms
# returns 1 when the lock was ours (deleted, the queue's head woken), 0 otherwise
_RELEASE = (
    _LUA_PRELUDE
    + """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  if redis.call('EXISTS', KEYS[3]) == 1 then
    drop_dead_waiters()
    wake_head(ARGV[2], ARGV[3])
  end
  return 1
end
return 0
"""
)

# KEYS[1] - lock name    KEYS[2] - fence counter    KEYS[3] - queue    KEYS[4] - alive
# ARGV[1] - waiter token ARGV[2] - signal key prefix  ARGV[3] - signal list ttl in ms
# returns 1; the waiter leaves the queue, and the next one is woken if the lock is free
_LEAVE = (
    _LUA_PRELUDE
    + """
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('DEL', ARGV[2] .. ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 0 then
  drop_dead_waiters()
  wake_head(ARGV[2], ARGV[3])
end
return 1
"""
)

# KEYS[1] - lock name
# ARGV[1] - owner token  ARGV[2] - new ttl in ms
# returns 1 when the lock was ours and extended, 0 when it is gone or another owner's
_EXTEND = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""


class RedisLock(BaseLock):
    """A Redis lock with an owner token, a fencing token, renewal and a fair wait.

    Keys share the hash tag ``{name}``, so every script touches one Cluster slot:
    ``sekali:lock:{name}`` (owner token, PX ttl), ``...:fence`` (counter), ``...:queue`` and
    ``...:alive`` (waiters by arrival and by liveness deadline) and ``...:signal:<token>`` (a
    waiter's wake-up list, derived inside the scripts; same slot).

    Acquire is one script: if the key is free and no earlier live waiter is queued, INCR the
    fence, SET the token with PX, return the fence; otherwise queue the caller (FIFO) and return
    the PTTL. A waiter BLPOPs its own wake-up list for at most min(PTTL, queue_ttl/3, what is
    left of its wait): release pushes to the head waiter's list, and a holder that died is
    noticed when its TTL runs out. A waiter that stops refreshing (it died) drops out of the
    queue after ``queue_ttl``; until then the lock may sit free.

    Fences grow per name, even when Redis loses recent writes. Each grant's fence is
    ``max(counter + 1, server clock in microseconds)``, written back to the counter (which
    expires a week after the last grant). A counter that lost grants (a restart without
    persistence or from an older RDB snapshot, a failover to a replica that had not caught up,
    an expired key) still issues a token above every earlier one, because each earlier token
    was at most the clock of its grant plus the grants issued in the same microsecond::

        t=0.0  grant: fence 1_000_000 (clock); SAVE           counter = 1_000_000
        t=1.0  A acquires: fence 2_000_000, then stalls         (this write is lost below)
        t=2.0  Redis restarts from the t=0 snapshot             counter = 1_000_000 again
        t=2.5  B acquires: max(1_000_001, 3_500_000) = 3_500_000 > A's 2_000_000
        t=3.0  A wakes; its fenced write carries 2_000_000 < 3_500_000: refused

    This assumes the clock of the server that grants (the primary, or the replica promoted in
    its place) never runs behind a clock that granted earlier by more than the time the lost
    writes cover; NTP-synced hosts and a failover that takes longer than their skew keep it.
    Fenced writes refuse an equal token from another holder too (:func:`fenced_write`).

    Bounds (with a client from :func:`resources.storage.redis.redis_client`, whose commands
    end within ``RedisTimeouts.bound``, 7 s by default): a waiter's BLPOP asks the server for at
    most half the client's socket timeout; ``acquire`` returns or raises within its
    ``blocking_timeout`` plus one bound; ``check()`` within one bound (a Redis that does not
    answer means the lock is lost); a renewal that cannot reach Redis leaves the lock lost once
    its TTL has run out (see :class:`BaseLock`). An acquire whose reply was lost may still have
    been granted on the server: that grant is nobody's and expires after ``ttl``.
    """

    def __init__(
        self,
        client: RedisClient,
        name: str,
        *,
        ttl: float,
        auto_renew: bool = True,
        blocking_timeout: float | None = None,
        max_hold: float | None = None,
        observer: LockObserver | None = None,
        queue_ttl: float = 3.0,
        prefix: str = "sekali:lock:",
    ) -> None:
        super().__init__(
            name,
            ttl=ttl,
            auto_renew=auto_renew,
            blocking_timeout=blocking_timeout,
            max_hold=max_hold,
            observer=observer if observer is not None else default_stats(client),
        )
        self.client = client
        self.queue_ttl = queue_ttl
        self._timeouts = client_timeouts(client)
        base = f"{prefix}{{{hash_tag(name)}}}"
        self.key = base
        self._keys = [base, f"{base}:fence", f"{base}:queue", f"{base}:alive"]
        self._signal_prefix = f"{base}:signal:"
        self._ttl_ms = max(1, int(self.ttl * 1000))
        self._queue_ttl_ms = max(3, int(queue_ttl * 1000))
        self._acquire_script = Script(client, _ACQUIRE, keeps="locks")
        self._release_script = Script(client, _RELEASE, keeps="locks")
        self._leave_script = Script(client, _LEAVE, keeps="locks")
        self._extend_script = Script(client, _EXTEND, keeps="locks")

    def _try_acquire(self, token: str, enqueue: bool) -> tuple[int | None, float | None]:
        with self._unavailable_as_error():
            granted, value = self._acquire_script(
                keys=self._keys,
                args=[token, self._ttl_ms, self._queue_ttl_ms if enqueue else 0],
            )
        if granted == 1:
            return int(value), None
        poll = self.queue_ttl / 3
        pttl = int(value)
        return None, min(poll, pttl / 1000) if pttl > 0 else poll

    def _wait(self, token: str, seconds: float) -> None:
        # the server-side wait stays under half the socket timeout, so its reply always comes
        # before the client gives up on a healthy server
        wait = self._timeouts.blocking_wait(seconds)
        with self._unavailable_as_error():
            self.client.blpop([self._signal_prefix + token], timeout=wait)

    @contextlib.contextmanager
    def _unavailable_as_error(self) -> Iterator[None]:
        """A Redis that does not answer while acquiring: :class:`StoreUnavailable` (transient).
        If the lost reply was a grant, nobody holds it and it expires after ``ttl``."""
        try:
            yield
        except UNREACHABLE as exc:
            raise StoreUnavailable(
                f"Redis did not answer while acquiring lock {self.name!r}: {exc}; retry later"
            ) from exc

    def _leave_queue(self, token: str) -> None:
        with contextlib.suppress(*REDIS_ERRORS):
            self._leave_script(
                keys=self._keys, args=[token, self._signal_prefix, self._queue_ttl_ms]
            )

    def _release_remote(self, token: str) -> bool:
        return bool(
            self._release_script(
                keys=self._keys, args=[token, self._signal_prefix, self._queue_ttl_ms]
            )
        )

    def release_token(self, token: str) -> bool:
        """Compare-and-delete with an explicit token; True only if ``token`` held the lock.

        For operators and tests: a wrong token changes nothing.
        """
        return self._release_remote(token)

    def _extend_remote(self, token: str) -> bool:
        return bool(self._extend_script(keys=[self.key], args=[token, self._ttl_ms]))

    def _read_owner(self) -> str | None:
        value = self.client.get(self.key)
        if value is None:
            return None
        return value.decode() if isinstance(value, bytes) else str(value)

    def __enter__(self) -> RedisLock:
        self.acquire()
        return self


