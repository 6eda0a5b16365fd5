"""Per-key concurrency limits shared by every process: at most ``limit`` holders of one key.

A slot is a lock with ``limit`` owners: the same shape as :class:`resources.locks.RedisLock`
(owner token, fence, renewal watchdog, ``check()``, a FIFO wait woken on release), built on
:class:`resources.locks.BaseLock` so the watchdog and the wait loop are the locks' own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from resources.errors import LimitNotAcquired, LockNotAcquired
from resources.locks import BaseLock, LockObserver
from resources.storage.redis import REDIS_ERRORS, RedisClient, Script, hash_tag

# Every script touches the keys of one (name, key) pair, which share one hash tag:
# KEYS[1] - holders: zset token -> lease expiry (server ms)
# KEYS[2] - fence counter
# KEYS[3] - waiters by arrival: zset token -> arrival (server us)
# KEYS[4] - waiters by liveness: zset token -> deadline (server ms); a waiter refreshes it
#           each time it asks again, so one that died drops out of the queue
# A waiter's wake-up list is KEYS[1] .. ':signal:' .. token (same hash tag).
_PRELUDE = """
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now_ms = math.floor(now_us / 1000)
local signal = KEYS[1] .. ':signal:'
local function purge()
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms)
  if redis.call('EXISTS', KEYS[3]) == 0 then return false end
  local dead = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now_ms)
  for _, w in ipairs(dead) do
    redis.call('ZREM', KEYS[4], w)
    redis.call('ZREM', KEYS[3], w)
  end
  return redis.call('EXISTS', KEYS[3]) == 1
end
local function wake(n, ttl_ms)
  if n <= 0 then return end
  for _, w in ipairs(redis.call('ZRANGE', KEYS[3], 0, n - 1)) do
    if redis.call('LLEN', signal .. w) == 0 then
      redis.call('LPUSH', signal .. w, '1')
      redis.call('PEXPIRE', signal .. w, ttl_ms)
    end
  end
end
"""

# ARGV[1] - token   ARGV[2] - limit   ARGV[3] - lease ms   ARGV[4] - queue ttl ms (0: do not queue)
# returns {1, fence} when granted; {0, ms until the earliest holder's lease runs out (0: none)}
_ACQUIRE = (
    _PRELUDE
    + """
local limit = tonumber(ARGV[2])
local queued = purge()
local free = limit - redis.call('ZCARD', KEYS[1])
if free > 0 then
  local ahead = 0
  if queued then
    ahead = redis.call('ZRANK', KEYS[3], ARGV[1]) or redis.call('ZCARD', KEYS[3])
  end
  if ahead < free then
    local fence = redis.call('INCR', KEYS[2])
    if fence == 1 then
      -- a fresh, expired or lost counter restarts from the clock, above any earlier fence
      fence = now_us
      redis.call('SET', KEYS[2], string.format('%d', fence), 'PX', 604800000)
    end
    redis.call('ZADD', KEYS[1], now_ms + tonumber(ARGV[3]), ARGV[1])
    redis.call('PEXPIRE', KEYS[1], ARGV[3])
    if queued then
      redis.call('ZREM', KEYS[3], ARGV[1])
      redis.call('ZREM', KEYS[4], ARGV[1])
      redis.call('DEL', signal .. ARGV[1])
    end
    return {1, fence}
  end
end
if ARGV[4] ~= '0' then
  redis.call('ZADD', KEYS[3], 'NX', now_us, ARGV[1])
  redis.call('ZADD', KEYS[4], now_ms + tonumber(ARGV[4]), ARGV[1])
  redis.call('PEXPIRE', KEYS[3], 2 * tonumber(ARGV[4]))
  redis.call('PEXPIRE', KEYS[4], 2 * tonumber(ARGV[4]))
  wake(free, ARGV[4])  -- a slot freed by expiry: the waiters ahead may not know yet
end
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if #first == 0 then return {0, 0} end
return {0, tonumber(first[2]) - now_ms}
"""
)

# ARGV[1] - token   ARGV[2] - limit   ARGV[3] - queue ttl ms
# returns 1 when the token held a live slot (now freed), 0 when its lease had run out
_RELEASE = (
    _PRELUDE
    + """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
if purge() then wake(tonumber(ARGV[2]) - redis.call('ZCARD', KEYS[1]), ARGV[3]) end
if score and tonumber(score) > now_ms then return 1 end
return 0
"""
)

# ARGV[1] - token   ARGV[2] - limit   ARGV[3] - queue ttl ms
# returns 1; the waiter leaves the queue and hands its turn to the next one
_LEAVE = (
    _PRELUDE
    + """
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('DEL', signal .. ARGV[1])
if purge() then wake(tonumber(ARGV[2]) - redis.call('ZCARD', KEYS[1]), ARGV[3]) end
return 1
"""
)

# ARGV[1] - token   ARGV[2] - lease ms (0: only read)
# returns 1 when the token holds a live slot (its lease pushed to now + lease), else 0
_EXTEND = (
    _PRELUDE
    + """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) <= now_ms then return 0 end
if ARGV[2] ~= '0' then
  redis.call('ZADD', KEYS[1], 'XX', now_ms + tonumber(ARGV[2]), ARGV[1])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 1
"""
)


class Slot(BaseLock):
    """One held slot of a :class:`ConcurrencyLimiter` key: ``.fence``, ``.token``, ``.check()``.

    ``fence`` grows with every grant of the key (any slot), so a downstream that records the
    highest fence it saw can refuse a holder whose lease ran out. ``check()`` raises
    :class:`resources.errors.LockLost` once the slot may no longer be ours.
    """

    def __init__(self, limiter: ConcurrencyLimiter, key: str) -> None:
        super().__init__(
            f"{limiter.name}/{key}",
            ttl=limiter.lease,
            auto_renew=limiter.auto_renew,
            blocking_timeout=None,
            max_hold=None,
            observer=limiter.observer,
        )
        self.limiter = limiter
        self.key = key
        self._keys = limiter.redis_keys(key)
        self.waited = 0.0

    def _try_acquire(self, token: str, enqueue: bool) -> tuple[int | None, float | None]:
        lim = self.limiter
        granted, value = lim._acquire(
            keys=self._keys,
            args=[token, lim.limit, lim._lease_ms, lim._queue_ttl_ms if enqueue else 0],
        )
        if int(granted) == 1:
            return int(value), None
        poll = lim.queue_ttl / 3
        ms = int(value)
        return None, min(poll, ms / 1000) if ms > 0 else poll

    def _wait(self, token: str, seconds: float) -> None:
        self.limiter.client.blpop([self._keys[0] + ":signal:" + token], timeout=seconds)

    def _leave_queue(self, token: str) -> None:
        lim = self.limiter
        with contextlib.suppress(*REDIS_ERRORS):
            lim._leave(keys=self._keys, args=[token, lim.limit, lim._queue_ttl_ms])

    def _release_remote(self, token: str) -> bool:
        lim = self.limiter
        return bool(lim._release(keys=self._keys, args=[token, lim.limit, lim._queue_ttl_ms]))

    def _extend_remote(self, token: str) -> bool:
        return bool(self.limiter._extend(keys=self._keys, args=[token, self.limiter._lease_ms]))

    def _read_owner(self) -> str | None:
        token = self.token
        if token is None:
            return None
        return token if self.limiter._extend(keys=self._keys, args=[token, 0]) else None


class ConcurrencyLimiter:
    """At most ``limit`` holders per key, across every process and host that shares the Redis.

    ``with limiter.hold("customer:42") as slot:`` waits for one of the key's ``limit`` slots,
    holds it while the block runs (the renewal watchdog pushes its lease every ``lease / 3``),
    and frees it on exit. Guarantees:

    - **Never more than ``limit`` live holders of one key.** The count of live holders and the
      grant are one Lua script, so two callers cannot both take the last slot.
    - **A dead holder's slot comes back** when its lease runs out (``lease`` seconds after its
      last renewal): each script first drops the holders whose lease has passed (server time).
    - **Waiters of one key are served in arrival order** (a queue per key, woken on release;
      a newcomer never takes a slot an earlier waiter is entitled to). A waiter that died drops
      out of the queue after ``queue_ttl``; until then a slot may sit free.
    - **Other keys never wait**: every key has its own Redis keys and its own queue.
    - **Fences grow per key** with every grant, seeded from the server clock like the locks'.

    It is a throttle, not a guard. A holder stopped longer than its lease (SIGSTOP, a frozen
    VM) loses the slot and a waiter takes it, so for a moment ``limit + 1`` may be working::

        t=0   A holds a slot of "customer:42" (limit 1, lease 30 s, fence 7)
        t=2   A is stopped: no renewals
        t=32  A's lease runs out; B's next poll drops it, B holds the slot (fence 8)
        t=40  A resumes: the renewal is refused and slot.check() raises LockLost; if A skips
              check() and calls the downstream anyway, only a fence the downstream checks
              (7 < 8) or the idempotency key stops the duplicate work

    Idempotency stays the floor; the limit spares the downstream and the key's shared state.

    ``auto_renew=False`` leaves renewal to the caller (``slot.extend()``): the slot then lasts
    ``lease`` seconds. ``observer`` (a :class:`resources.locks.LockObserver`) counts grants,
    waits and losses under the slot's name ``<name>/<key>``.

    Keys (one hash tag per name and key, so every script stays in one Cluster slot):
    ``{prefix}{<name>:<key>}`` (holders), ``...:fence``, ``...:queue``, ``...:alive``,
    ``...:signal:<token>``. Every process using one ``name`` must use the same ``limit``.
    The client's ``socket_timeout`` must exceed ``queue_ttl / 3`` (the longest BLPOP).
    """

    def __init__(
        self,
        client: RedisClient,
        name: str,
        *,
        limit: int,
        lease: float = 30.0,
        queue_ttl: float = 3.0,
        auto_renew: bool = True,
        observer: LockObserver | None = None,
        prefix: str = "sekali:flow:limit:",
    ) -> None:
        if not name:
            raise ValueError("a concurrency limiter needs a non-empty name")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be an integer >= 1, got {limit!r}")
        if lease <= 0 or queue_ttl <= 0:
            raise ValueError("lease and queue_ttl must be positive")
        self.client = client
        self.name = name
        self.limit = limit
        self.lease = float(lease)
        self.queue_ttl = float(queue_ttl)
        self.auto_renew = auto_renew
        self.observer = observer
        self.prefix = prefix
        self._lease_ms = max(1, int(self.lease * 1000))
        self._queue_ttl_ms = max(3, int(self.queue_ttl * 1000))
        self._acquire = Script(client, _ACQUIRE, keeps="concurrency slots")
        self._release = Script(client, _RELEASE, keeps="concurrency slots")
        self._leave = Script(client, _LEAVE, keeps="concurrency slots")
        self._extend = Script(client, _EXTEND, keeps="concurrency slots")

    def redis_keys(self, key: str) -> list[str]:
        """The Redis keys of ``key``: holders, fence, queue, alive (one hash tag)."""
        base = f"{self.prefix}{{{hash_tag(f'{self.name}:{key}')}}}"
        return [base, f"{base}:fence", f"{base}:queue", f"{base}:alive"]

    def acquire(self, key: str, *, blocking_timeout: float | None = None) -> Slot:
        """Take a slot of ``key``, or raise :class:`LimitNotAcquired` after ``blocking_timeout``
        seconds (``0``: try once without queueing; ``None``: wait as long as it takes).

        The caller must ``release()`` the slot; :meth:`hold` does it for a ``with`` block.
        """
        if not key:
            raise ValueError("a concurrency key must be a non-empty string")
        slot = Slot(self, key)
        started = slot.monotonic()
        try:
            slot.acquire(blocking_timeout)
        except LockNotAcquired as exc:
            raise LimitNotAcquired(self.name, key, self.limit, exc.waited) from exc
        slot.waited = slot.monotonic() - started
        return slot

    @contextlib.contextmanager
    def hold(self, key: str, *, blocking_timeout: float | None = None) -> Iterator[Slot]:
        """Hold a slot of ``key`` for the ``with`` block; see :meth:`acquire` for the wait."""
        slot = self.acquire(key, blocking_timeout=blocking_timeout)
        try:
            yield slot
        finally:
            slot.release()

    def holders(self, key: str) -> int:
        """Live holders of ``key`` now (by the server's clock). For operators and tests."""
        now_s, now_us = self.client.time()
        now_ms = int(now_s) * 1000 + int(now_us) // 1000
        return int(self.client.zcount(self.redis_keys(key)[0], f"({now_ms}", "+inf"))

    def waiting(self, key: str) -> int:
        """Callers queued for ``key`` (including any that died within ``queue_ttl``)."""
        return int(self.client.zcard(self.redis_keys(key)[2]))

    def __repr__(self) -> str:
        return f"ConcurrencyLimiter({self.name!r}, limit={self.limit}, lease={self.lease})"
