"""Locks that stay correct when they expire: Redis, database, or none, behind one interface.

A lock narrows a race; it never replaces idempotency (DESIGN.md). Each backend hands out a held
lock with the same shape:

- ``.token``: this holder's owner token; release and extend act only if it still matches.
- ``.fence``: a fencing token that grows with every grant of the name. Pass it to
  :func:`fenced_write` so a holder whose lock expired cannot commit (invariant 3).
- ``.check()``: raises :class:`LockLost` if the lock may no longer be ours. Call it before every
  side effect. It checks the local state first (renewal failed, TTL ran out, ``max_hold`` passed)
  and then asks the store once (one GET on Redis, one SELECT on the database).

Which one to use (docs/locks.md has the long form and timelines):

- :class:`RedisLock`: short critical sections, cache rebuilds, serialising calls to a
  non-critical resource. Waiters queue FIFO and are woken on release, so none starves.
- :class:`DbLock`: the business state lives in the same database. A lease row on SQLite and
  Postgres; :meth:`DbLock.transactional` locks the lease row inside the caller's transaction.
  Never a session-level advisory lock: it leaks under PgBouncer transaction pooling.
- :class:`NoLock`: the job is idempotent and overwrite-safe; a lock would only add contention.

Timeline of the race the fence plus ``check()`` stop::

    t=0.0  A acquires "order:7" (fence 41, TTL 10 s); the watchdog extends it every 3.3 s
    t=2.0  A is stopped (SIGSTOP, GC pause): no renewals
    t=12   the TTL runs out; B acquires "order:7" (fence 42) and writes: fence_registry = 42
    t=20   A resumes: check() raises LockLost (the key holds B's token); if A skips check(),
           its fenced write with fence 41 is rejected and counted, and B's write stands
"""

from __future__ import annotations

import atexit
import contextlib
import heapq
import itertools
import logging
import os
import random
import re
import threading
import time
import uuid
import weakref
from collections import defaultdict
from collections.abc import Callable
from types import TracebackType
from typing import Any, Literal, Protocol

import redis
from dagster import ConfigurableResource
from pydantic import PrivateAttr
from sqlalchemy import BigInteger, Column, Float, Table, Text, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine

from resources.db import Database, metadata, shared_database
from resources.errors import LockLost, LockNotAcquired, SekaliError
from resources.fencing import FenceStatus, fence_registry, fence_status, fenced_write
from resources.patterns import key_pattern

__all__ = [
    "DbLock",
    "FenceStatus",
    "LockLost",
    "LockNotAcquired",
    "LockObserver",
    "LockResource",
    "MemoryLockStats",
    "NoLock",
    "RedisLock",
    "RedisLockStats",
    "fence_registry",
    "fence_status",
    "fenced_write",
    "lock_leases",
    "lock_row",
    "lock_stats",
    "name_pattern",
]

log = logging.getLogger(__name__)

Clock = Callable[[], float]

# -- metrics hooks ---------------------------------------------------------------------------

EVENTS = (
    "acquired",  # count
    "acquire_failed",  # count: the wait ran out
    "wait_seconds",  # sum of time spent waiting for a grant
    "hold_seconds",  # sum of time between grant and release
    "renewed",  # count of successful watchdog extensions
    "renew_failed",  # count of extensions that errored (store unavailable)
    "lost",  # count of LockLost raised by check()
    "fenced_rejected",  # count of fenced writes refused (resources.fencing)
)


class LockObserver(Protocol):
    """Receives lock events. Must be cheap and must never raise: locks call it inline."""

    def record(self, event: str, name: str, value: float = 1.0) -> None: ...


def name_pattern(name: str) -> str:
    """Aggregate per-entity lock names: ``order:123`` -> ``order:*``; ``nightly`` stays."""
    return key_pattern(name)


class NullLockObserver:
    def record(self, event: str, name: str, value: float = 1.0) -> None:
        return None


class MemoryLockStats:
    """In-process counters keyed ``(pattern, event)``. For tests and single-process tools."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counters: dict[tuple[str, str], float] = defaultdict(float)

    def record(self, event: str, name: str, value: float = 1.0) -> None:
        with self._lock:
            self.counters[(name_pattern(name), event)] += value

    def get(self, name_or_pattern: str, event: str) -> float:
        pattern = (
            name_or_pattern if name_or_pattern.endswith("*") else name_pattern(name_or_pattern)
        )
        with self._lock:
            return self.counters.get((pattern, event), 0.0)


STATS_KEY = "sekali:stats:locks"


class RedisLockStats:
    """Counters shared by every process, in one Redis hash (``HINCRBYFLOAT``).

    Fields are ``<pattern>:<event>``. Events are summed in memory and flushed in one pipeline
    at most every ``flush_interval`` seconds (and at exit, and on :meth:`flush`), so metrics
    cost no extra round trip on the lock's hot path. A failed flush is logged and dropped:
    metrics never break a lock.
    """

    def __init__(
        self, client: redis.Redis, *, key: str = STATS_KEY, flush_interval: float = 1.0
    ) -> None:
        self.client = client
        self.key = key
        self.flush_interval = flush_interval
        self._pending: dict[str, float] = defaultdict(float)
        self._lock = threading.Lock()
        self._last_flush = time.monotonic()
        _live_stats.add(self)

    def record(self, event: str, name: str, value: float = 1.0) -> None:
        with self._lock:
            self._pending[f"{name_pattern(name)}:{event}"] += value
            due = time.monotonic() - self._last_flush >= self.flush_interval
        if due:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, defaultdict(float)
            self._last_flush = time.monotonic()
        if not pending:
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            for field, value in pending.items():
                pipe.hincrbyfloat(self.key, field, value)
            pipe.execute()
        except redis.RedisError as exc:
            log.warning("lock stats flush failed: %s", exc, extra={"stats_key": self.key})


_live_stats: weakref.WeakSet[RedisLockStats] = weakref.WeakSet()
_stats_by_client: weakref.WeakKeyDictionary[redis.Redis, RedisLockStats] = (
    weakref.WeakKeyDictionary()
)
_stats_guard = threading.Lock()


def _flush_all_stats() -> None:
    for stats in list(_live_stats):
        stats.flush()


atexit.register(_flush_all_stats)


def _default_stats(client: redis.Redis) -> RedisLockStats:
    with _stats_guard:
        stats = _stats_by_client.get(client)
        if stats is None:
            stats = _stats_by_client[client] = RedisLockStats(client)
        return stats


def lock_stats(client: redis.Redis, *, key: str = STATS_KEY) -> dict[str, dict[str, float]]:
    """Read the shared counters: ``{"order:*": {"acquired": 12.0, "wait_seconds": 0.4, ...}}``."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for field, value in client.hgetall(key).items():
        field_s = field.decode() if isinstance(field, bytes) else str(field)
        pattern, _, event = field_s.rpartition(":")
        out[pattern][event] = float(value)
    return dict(out)


# -- the renewal watchdog ----------------------------------------------------------------------


class _Renewer:
    """One daemon thread per process extends every held lock that asked for renewal.

    A thread per lock would cost a thread start per acquisition; a heap of due times costs a
    push. Entries of released locks are skipped lazily.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, _BaseLock, int]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def schedule(self, lock: _BaseLock, due: float, generation: int) -> None:
        with self._cv:
            earliest = self._heap[0][0] if self._heap else None
            heapq.heappush(self._heap, (due, next(self._seq), lock, generation))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lock-renewer", daemon=True)
                self._thread.start()
            if earliest is None or due < earliest:
                self._cv.notify()  # only a new earliest deadline changes the thread's sleep

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    timeout = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._cv.wait(timeout)
                _, _, lock, generation = heapq.heappop(self._heap)
            try:
                next_due = lock._renew(generation)
            except Exception:  # noqa: BLE001 - the watchdog must outlive any one lock
                log.exception("lock renewal crashed", extra={"lock": lock.name})
                continue
            if next_due is not None:
                self.schedule(lock, next_due, generation)


_renewer: tuple[int, _Renewer] | None = None
_renewer_guard = threading.Lock()


def _get_renewer() -> _Renewer:
    global _renewer
    with _renewer_guard:
        if _renewer is None or _renewer[0] != os.getpid():
            _renewer = (os.getpid(), _Renewer())
        return _renewer[1]


# -- the common shape ---------------------------------------------------------------------------


class _BaseLock:
    """What every backend shares: hold bookkeeping, ``check()``, renewal, context manager.

    A lock object is reusable (acquire, release, acquire) but not re-entrant, and one holder
    uses it at a time. Subclasses implement ``_try_acquire``, ``_wait``, ``_extend_remote``,
    ``_release_remote`` and ``_read_owner``.
    """

    def __init__(
        self,
        name: str,
        *,
        ttl: float,
        auto_renew: bool,
        blocking_timeout: float | None,
        max_hold: float | None,
        observer: LockObserver | None,
        monotonic: Clock = time.monotonic,
    ) -> None:
        if not name:
            raise ValueError("lock name must be a non-empty string")
        if ttl <= 0:
            raise ValueError("ttl must be positive")
        if max_hold is not None and max_hold <= 0:
            raise ValueError("max_hold must be positive (or None for no bound)")
        self.name = name
        self.ttl = float(ttl)
        self.auto_renew = auto_renew
        self.blocking_timeout = blocking_timeout
        self.max_hold = max_hold
        self.observer: LockObserver = observer or NullLockObserver()
        self.monotonic = monotonic
        self.token: str | None = None
        self.fence: int = 0
        self._held = False
        self._generation = 0
        self._acquired_at = 0.0
        self._valid_until = 0.0
        self._lost: str | None = None
        self._state = threading.Lock()

    # backend hooks
    def _try_acquire(self, token: str, enqueue: bool) -> tuple[int | None, float | None]:
        """Return ``(fence, None)`` on a grant, else ``(None, hint)``: seconds worth waiting."""
        raise NotImplementedError

    def _wait(self, token: str, seconds: float) -> None:
        raise NotImplementedError

    def _leave_queue(self, token: str) -> None:
        return None

    def _extend_remote(self, token: str) -> bool:
        raise NotImplementedError

    def _release_remote(self, token: str) -> bool:
        raise NotImplementedError

    def _read_owner(self) -> str | None:
        raise NotImplementedError

    # the interface
    @property
    def held(self) -> bool:
        return self._held

    def acquire(self, blocking_timeout: float | None | Literal["default"] = "default") -> _BaseLock:
        """Acquire or raise :class:`LockNotAcquired`. ``0`` tries once; ``None`` waits forever."""
        if self._held:
            raise RuntimeError(f"lock {self.name!r} is already held by this object")
        timeout = self.blocking_timeout if blocking_timeout == "default" else blocking_timeout
        token = uuid.uuid4().hex
        start = self.monotonic()
        deadline = None if timeout is None else start + max(0.0, float(timeout))
        enqueue = timeout is None or timeout > 0
        while True:
            # the grant's TTL starts no earlier than this attempt was sent, not the first one:
            # a waiter queued longer than the TTL would otherwise get a lock already "expired"
            sent = self.monotonic()
            fence, hint = self._try_acquire(token, enqueue)
            now = self.monotonic()
            if fence is not None:
                break
            remaining = None if deadline is None else deadline - now
            if remaining is not None and remaining <= 0:
                self._leave_queue(token)
                self.observer.record("acquire_failed", self.name)
                raise LockNotAcquired(self.name, now - start)
            wait = hint if hint is not None else 0.1
            if remaining is not None:
                wait = min(wait, remaining)
            self._wait(token, max(wait, 0.001))
        with self._state:
            self.token = token
            self.fence = fence
            self._held = True
            self._lost = None
            self._generation += 1
            self._acquired_at = now
            self._valid_until = sent + self.ttl  # counted from the granting request: conservative
            generation = self._generation
        self.observer.record("acquired", self.name)
        self.observer.record("wait_seconds", self.name, now - start)
        if self.auto_renew:
            _get_renewer().schedule(self, now + self.ttl / 3, generation)
        log.debug("lock acquired", extra={"lock": self.name, "fence": fence})
        return self

    def release(self) -> bool:
        """Release if still ours. Returns False if it had expired or the store did not answer
        (then it expires by itself). Never raises for those: the work is already done."""
        with self._state:
            if not self._held:
                return False
            self._held = False
            token = self.token
        assert token is not None
        self.observer.record("hold_seconds", self.name, self.monotonic() - self._acquired_at)
        try:
            released = self._release_remote(token)
        except (redis.RedisError, sa_exc.SQLAlchemyError, SekaliError) as exc:
            log.warning("lock release failed: %s", exc, extra={"lock": self.name})
            return False
        if not released:
            log.warning("lock had expired before release", extra={"lock": self.name})
        return released

    def extend(self) -> None:
        """Push the expiry ``ttl`` from now. :class:`LockLost` if it is no longer ours."""
        if not self._held or self.token is None:
            raise LockLost(self.name, "not held")
        start = self.monotonic()
        try:
            ok = self._extend_remote(self.token)
        except (redis.RedisError, sa_exc.SQLAlchemyError, SekaliError) as exc:
            raise self._mark_lost(f"store unavailable during extend ({exc})") from exc
        if not ok:
            raise self._mark_lost("another holder has it (extend refused)")
        self._valid_until = start + self.ttl

    def check(self, *, remote: bool = True) -> None:
        """Raise :class:`LockLost` unless the lock is still ours. Call before each side effect.

        Local checks first (no round trip): renewal saw the lock gone, the TTL ran out without
        a renewal, or the hold exceeded ``max_hold``. Then, if ``remote``, one read of the store
        (a GET on Redis, a SELECT on the database); a store that does not answer counts as lost.
        """
        if not self._held:
            raise LockLost(self.name, "not held")
        if self._lost is not None:
            raise self._mark_lost(self._lost)
        now = self.monotonic()
        if self.max_hold is not None and now - self._acquired_at > self.max_hold:
            raise self._mark_lost(f"held longer than max_hold={self.max_hold}s")
        if now >= self._valid_until:
            raise self._mark_lost("ttl ran out without a renewal")
        if not remote:
            return
        try:
            owner = self._read_owner()
        except (redis.RedisError, sa_exc.SQLAlchemyError, SekaliError) as exc:
            raise self._mark_lost(f"store unavailable ({exc})") from exc
        if owner != self.token:
            reason = "the lock is gone" if owner is None else "another holder has it"
            raise self._mark_lost(reason)

    def _mark_lost(self, reason: str) -> LockLost:
        first = self._lost is None
        self._lost = reason
        if first:
            self.observer.record("lost", self.name)
            log.warning("lock lost: %s", reason, extra={"lock": self.name, "fence": self.fence})
        return LockLost(self.name, reason)

    def _renew(self, generation: int) -> float | None:
        """Called by the watchdog. Returns when to run again, or None to stop renewing."""
        if not self._held or generation != self._generation or self._lost is not None:
            return None
        now = self.monotonic()
        if self.max_hold is not None and now - self._acquired_at >= self.max_hold:
            log.warning("max_hold reached: renewal stops", extra={"lock": self.name})
            return None
        token = self.token
        assert token is not None
        try:
            ok = self._extend_remote(token)
        except (redis.RedisError, sa_exc.SQLAlchemyError, SekaliError) as exc:
            self.observer.record("renew_failed", self.name)
            log.warning("lock renewal failed: %s", exc, extra={"lock": self.name})
            if self.monotonic() >= self._valid_until:
                self._lost = f"renewal failed until the ttl ran out ({exc})"
                return None
            return self.monotonic() + min(self.ttl / 10, 0.5)
        if generation != self._generation:
            return None
        if not ok:
            self._lost = "renewal refused: another holder has it"
            return None
        self._valid_until = now + self.ttl
        self.observer.record("renewed", self.name)
        return now + self.ttl / 3

    def __enter__(self) -> _BaseLock:
        return self.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        state = f"held fence={self.fence}" if self._held else "free"
        return f"{type(self).__name__}({self.name!r}, {state})"


# -- Redis ------------------------------------------------------------------------------------

# KEYS: lock, fence, queue (zset by arrival), alive (zset by waiter deadline)
# The queue work (TIME, dropping waiters that stopped refreshing) runs only when someone waits,
# so an uncontended grant is EXISTS, EXISTS, INCR, SET.
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

# ARGV: token, ttl_ms, queue_ttl_ms (0: do not queue). Wake-up lists: KEYS[1]..':signal:'..token
_ACQUIRE = (
    _LUA_PRELUDE
    + """
local queued = redis.call('EXISTS', KEYS[3]) == 1
if queued then drop_dead_waiters() end
if redis.call('EXISTS', KEYS[1]) == 0 then
  local head = queued and redis.call('ZRANGE', KEYS[3], 0, 0) or {}
  if #head == 0 or head[1] == ARGV[1] then
    local fence = redis.call('INCR', KEYS[2])
    if fence == 1 then
      -- a fresh, expired or lost counter restarts from the clock, above any earlier token
      fence = now_us()
      redis.call('SET', KEYS[2], string.format('%d', fence), 'PX', 604800000)
    end
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

# ARGV: token, signal key prefix, signal list ttl in ms
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

_EXTEND = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""


class RedisLock(_BaseLock):
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

    Fences grow per name. The counter is seeded from the server clock in microseconds and
    expires a week after seeding; it is then reseeded the same way, which stays above every
    earlier token (a counter gains one per grant, the clock a million per second). A Redis that
    lost its data (restart without persistence) reseeds the same way. This assumes the Redis
    server's clock does not step back by more than the grants it has counted.

    The client's ``socket_timeout``, if set, must exceed ``queue_ttl / 3`` (the longest BLPOP).
    """

    def __init__(
        self,
        client: redis.Redis,
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
            observer=observer if observer is not None else _default_stats(client),
        )
        self.client = client
        self.queue_ttl = queue_ttl
        base = f"{prefix}{{{name}}}"
        self.key = base
        self._keys = [base, f"{base}:fence", f"{base}:queue", f"{base}:alive"]
        self._signal_prefix = f"{base}:signal:"
        self._ttl_ms = max(1, int(self.ttl * 1000))
        self._queue_ttl_ms = max(3, int(queue_ttl * 1000))
        self._acquire_script = client.register_script(_ACQUIRE)
        self._release_script = client.register_script(_RELEASE)
        self._leave_script = client.register_script(_LEAVE)
        self._extend_script = client.register_script(_EXTEND)

    def _try_acquire(self, token: str, enqueue: bool) -> tuple[int | None, float | None]:
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
        self.client.blpop([self._signal_prefix + token], timeout=seconds)

    def _leave_queue(self, token: str) -> None:
        with contextlib.suppress(redis.RedisError):
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


# -- database -------------------------------------------------------------------------------

lock_leases = Table(
    "lock_leases",
    metadata,
    Column("name", Text, primary_key=True),
    Column("owner_token", Text),
    Column("expires_at", Float),
    Column("fence", BigInteger, nullable=False),
    Column("acquired_at", Float),
    Column("updated_at", Float, nullable=False),
)

_DB_ACQUIRE = text(
    "INSERT INTO lock_leases AS l (name, owner_token, expires_at, fence, acquired_at, updated_at)"
    " VALUES (:name, :token, :expires, 1, :now, :now)"
    " ON CONFLICT (name) DO UPDATE SET owner_token = excluded.owner_token,"
    " expires_at = excluded.expires_at, fence = l.fence + 1,"
    " acquired_at = excluded.acquired_at, updated_at = excluded.updated_at"
    " WHERE l.owner_token IS NULL OR l.expires_at <= :now"
    " RETURNING fence"
)
_DB_EXTEND = text(
    "UPDATE lock_leases SET expires_at = :expires, updated_at = :now"
    " WHERE name = :name AND owner_token = :token AND expires_at > :now"
)
_DB_RELEASE = text(
    "UPDATE lock_leases SET owner_token = NULL, expires_at = NULL, updated_at = :now"
    " WHERE name = :name AND owner_token = :token"
)
_DB_OWNER = text("SELECT owner_token, expires_at FROM lock_leases WHERE name = :name")

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?$")


class DbLock(_BaseLock):
    """A lease row in the app database: same shape as :class:`RedisLock`, no Redis needed.

    Acquire is one conditional upsert on ``lock_leases`` (insert, or take over a released or
    expired lease; the fence grows by one) on SQLite and Postgres alike. Release clears the
    owner but keeps the row, so the fence never goes back. Waiters poll with capped, jittered
    backoff (2 ms to 100 ms, never past the holder's expiry): the database has no wake-up list.

    Expiry is judged with ``clock`` (wall time, injected for tests): workers' clocks must agree
    to well within the TTL. For a lock that must last exactly as long as a transaction, use
    :meth:`transactional` instead.
    """

    def __init__(
        self,
        engine: Engine | Database,
        name: str,
        *,
        ttl: float,
        auto_renew: bool = True,
        blocking_timeout: float | None = None,
        max_hold: float | None = None,
        observer: LockObserver | None = None,
        clock: Clock = time.time,
    ) -> None:
        super().__init__(
            name,
            ttl=ttl,
            auto_renew=auto_renew,
            blocking_timeout=blocking_timeout,
            max_hold=max_hold,
            observer=observer,
        )
        self.db = engine if isinstance(engine, Database) else Database(engine)
        self.clock = clock
        self._backoff = 0.002

    def _try_acquire(self, token: str, enqueue: bool) -> tuple[int | None, float | None]:
        now = self.clock()
        with self.db.statement() as conn:
            row = conn.execute(
                _DB_ACQUIRE,
                {"name": self.name, "token": token, "expires": now + self.ttl, "now": now},
            ).first()
            if row is not None:
                self._backoff = 0.002
                return int(row[0]), None
            current = conn.execute(_DB_OWNER, {"name": self.name}).first()
        hint = self._backoff * (0.5 + random.random())
        self._backoff = min(self._backoff * 2, 0.1)
        if current is not None and current.expires_at is not None:
            hint = min(hint, max(0.001, float(current.expires_at) - now))
        return None, hint

    def _wait(self, token: str, seconds: float) -> None:
        time.sleep(seconds)

    def _extend_remote(self, token: str) -> bool:
        now = self.clock()
        with self.db.statement() as conn:
            result = conn.execute(
                _DB_EXTEND,
                {"name": self.name, "token": token, "expires": now + self.ttl, "now": now},
            )
            return bool(result.rowcount == 1)

    def _release_remote(self, token: str) -> bool:
        with self.db.statement() as conn:
            result = conn.execute(
                _DB_RELEASE, {"name": self.name, "token": token, "now": self.clock()}
            )
            return bool(result.rowcount == 1)

    def release_token(self, token: str) -> bool:
        """Release with an explicit token; True only if ``token`` held the lease."""
        return self._release_remote(token)

    def _read_owner(self) -> str | None:
        with self.db.statement() as conn:
            row = conn.execute(_DB_OWNER, {"name": self.name}).first()
        if row is None or row.owner_token is None:
            return None
        if row.expires_at is not None and float(row.expires_at) <= self.clock():
            return None
        return str(row.owner_token)

    def __enter__(self) -> DbLock:
        self.acquire()
        return self

    @staticmethod
    def transactional(conn: Connection, name: str, *, clock: Clock = time.time) -> int:
        """Lock ``name`` until the caller's transaction ends; return a fresh fencing token.

        It is the lease upsert run inside your transaction: on Postgres the row lock it takes
        (``FOR UPDATE`` semantics) holds until COMMIT or ROLLBACK, so a second caller waits in
        its own upsert and then proceeds; nothing outlives the transaction, which makes it safe
        under PgBouncer transaction pooling. On SQLite the transaction's ``BEGIN IMMEDIATE``
        already serialises writers; this adds the fence. A live :class:`DbLock` lease on the
        same name wins: then :class:`LockNotAcquired` is raised (waited 0).
        """
        now = clock()
        row = conn.execute(
            _DB_ACQUIRE, {"name": name, "token": None, "expires": None, "now": now}
        ).first()
        if row is None:
            raise LockNotAcquired(name, 0.0)
        return int(row[0])


def lock_row(conn: Connection, table: str, key_column: str, key: Any) -> Any:
    """Lock one business row for the rest of the caller's transaction and return it.

    ``SELECT ... FOR UPDATE`` on Postgres; on SQLite the transaction's ``BEGIN IMMEDIATE``
    already holds the write lock, so this is a plain read. Returns None when the row is absent
    (nothing is locked then: insert it with a unique key instead).
    """
    for ident in (table, key_column):
        if not _IDENTIFIER.match(ident):
            raise ValueError(f"not a plain SQL identifier: {ident!r}")
    suffix = " FOR UPDATE" if conn.dialect.name == "postgresql" else ""
    return conn.execute(
        text(f"SELECT * FROM {table} WHERE {key_column} = :key{suffix}"), {"key": key}
    ).first()


# -- none -------------------------------------------------------------------------------------


class NoLock(_BaseLock):
    """The same interface, locking nothing: for idempotent, overwrite-safe jobs.

    ``fence`` is always 0 and ``check()`` never raises: do not pair it with fenced writes.
    """

    def __init__(self, name: str = "nolock", *, ttl: float = 60.0, **_ignored: Any) -> None:
        super().__init__(
            name, ttl=ttl, auto_renew=False, blocking_timeout=0, max_hold=None, observer=None
        )

    def acquire(self, blocking_timeout: float | None | Literal["default"] = "default") -> NoLock:
        self.token = uuid.uuid4().hex
        self.fence = 0
        self._held = True
        return self

    def release(self) -> bool:
        was = self._held
        self._held = False
        return was

    def extend(self) -> None:
        return None

    def check(self, *, remote: bool = True) -> None:
        return None

    def __enter__(self) -> NoLock:
        return self.acquire()


# -- the Dagster resource --------------------------------------------------------------------


class LockResource(ConfigurableResource):
    """Dagster resource: ``lock(name)`` returns a lock of the configured backend.

    ``backend`` is ``redis`` (``redis_url``, default ``REDIS_URL``), ``db`` (``database_url``,
    default ``DATABASE_URL``; apply ``sql/`` first) or ``none``. ``wait_seconds`` bounds the
    wait (``None``: forever); ``max_hold_seconds`` bounds renewal. No connection opens until
    the first ``lock()``.
    """

    backend: Literal["redis", "db", "none"] = "redis"
    ttl_seconds: float = 30.0
    auto_renew: bool = True
    wait_seconds: float | None = 10.0
    max_hold_seconds: float | None = None
    redis_url: str | None = None
    database_url: str | None = None

    _client: Any = PrivateAttr(default=None)
    _db: Any = PrivateAttr(default=None)

    def lock(self, name: str) -> RedisLock | DbLock | NoLock:
        common: dict[str, Any] = {
            "ttl": self.ttl_seconds,
            "auto_renew": self.auto_renew,
            "blocking_timeout": self.wait_seconds,
            "max_hold": self.max_hold_seconds,
        }
        if self.backend == "none":
            return NoLock(name, ttl=self.ttl_seconds)
        if self.backend == "redis":
            return RedisLock(self._redis(), name, **common)
        return DbLock(self._database(), name, **common)

    def _redis(self) -> redis.Redis:
        if self._client is None:
            from resources.settings import Settings  # noqa: PLC0415 - env read at use only

            url = self.redis_url or Settings.from_env().redis_url
            self._client = redis.Redis.from_url(url)
        return self._client  # type: ignore[no-any-return]

    def _database(self) -> Database:
        if self._db is None:
            from resources.settings import Settings  # noqa: PLC0415 - env read at use only

            self._db = shared_database(self.database_url or Settings.from_env().database_url)
        return self._db  # type: ignore[no-any-return]
