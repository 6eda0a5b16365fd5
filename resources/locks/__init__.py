"""Locks that stay correct when they expire: Redis, database, or none, behind one interface.

A lock narrows a race; it never replaces idempotency (docs/design.md). Each backend hands out a held
lock with the same shape:

- ``.token``: this holder's owner token; release and extend act only if it still matches.
- ``.fence``: a fencing token that grows with every grant of the name. Write with
  ``Fence.of_lock(lock)`` through :func:`fenced` so a holder whose lock expired cannot commit
  (invariant 3): the same check an idempotency claim's fence goes through
  (:mod:`resources.locks.fencing`). A job type that declares ``Running.exclusive`` gets the
  lock taken around its handler and ``ctx.write_fence`` set to it.
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


from resources.errors import LockLost, LockNotAcquired
from resources.locks.base import DEFAULT_TTL_SECONDS, BaseLock, LockFactory
from resources.locks.db_lock import DbLock, lock_leases, lock_row, lock_rows
from resources.locks.fencing import (
    Fence,
    FenceStatus,
    fence_registry,
    fence_status,
    fenced,
    fenced_update,
    fenced_write,
)
from resources.locks.none import NoLock
from resources.locks.redis_lock import RedisLock
from resources.locks.stats import (
    EVENTS,
    STATS_KEY,
    LockObserver,
    MemoryLockStats,
    NullLockObserver,
    RedisLockStats,
    lock_stats,
    name_pattern,
)

__all__ = [
    "DEFAULT_TTL_SECONDS",
    "EVENTS",
    "STATS_KEY",
    "BaseLock",
    "DbLock",
    "Fence",
    "FenceStatus",
    "LockFactory",
    "LockLost",
    "LockNotAcquired",
    "LockObserver",
    "MemoryLockStats",
    "NoLock",
    "NullLockObserver",
    "RedisLock",
    "RedisLockStats",
    "fence_registry",
    "fence_status",
    "fenced",
    "fenced_update",
    "fenced_write",
    "lock_leases",
    "lock_row",
    "lock_rows",
    "lock_stats",
    "name_pattern",
]
