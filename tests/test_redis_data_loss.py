"""Redis losing recent writes: restarted from an older RDB snapshot (the same thing a failover to
a replica that had not caught up does). Fences and cache versions must never go backwards, and a
stale holder must never win with a re-issued token.

Each test runs a throw-away redis-server, SAVEs a snapshot, grants more, then restarts it from
the snapshot. Each docstring names the regression it would catch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import text

from resources.cache import StampedeCache
from resources.errors import FencedWriteRejected
from resources.locks import MemoryLockStats, RedisLock, fence_status, fenced_write
from resources.storage.db import Database
from resources.storage.redis import redis_client
from sandbox.redis_server import RedisServer
from tests.lock_workers import BUSINESS_DDL, write_business


def _lock(server: RedisServer, name: str) -> RedisLock:
    return RedisLock(
        redis_client(server.url), name, ttl=30, auto_renew=False, blocking_timeout=5,
        observer=MemoryLockStats(),
    )


def test_fences_grow_across_a_restart_from_an_older_snapshot_and_the_stale_holder_loses(
    redis_server: RedisServer, db: Database, tmp_path: Path
) -> None:
    """Catches a fence counter that is reseeded only when INCR returns 1: restored from the
    snapshot it re-issues the stalled holder's fence to the next holder, whose equal token then
    lets the stalled holder's late write through (or refuses the new holder's writes).

    t0 grant + release (counter seeded), SAVE        t1 A acquires fence fa and stalls
    t2 Redis restarts from the t0 snapshot           t3 B acquires: fb must be > fa
    t4 B writes (fenced)                             t5 A wakes and writes: refused
    """
    with db.transaction() as conn:
        conn.exec_driver_sql(BUSINESS_DDL)
    resource = "acct:1"
    with _lock(redis_server, "acct:1") as first:
        seeded = first.fence
    snapshot = redis_server.snapshot(tmp_path / "older.rdb")
    a = _lock(redis_server, "acct:1").acquire()
    assert a.fence > seeded
    redis_server.restart_from(snapshot)
    b = _lock(redis_server, "acct:1").acquire()
    assert b.fence > a.fence, "a fence went backwards (or repeated) after Redis lost writes"
    with fenced_write(db, resource, b) as conn:
        write_business(conn, resource, "B", b.fence)
    with pytest.raises(FencedWriteRejected), fenced_write(db, resource, a) as conn:
        write_business(conn, resource, "A-stale", a.fence)
    with db.statement() as conn:
        value = conn.execute(
            text("SELECT value FROM lock_business WHERE resource = :r"), {"r": resource}
        ).scalar_one()
    assert value == "B"


def test_an_equal_fence_from_another_holder_is_refused(db: Database) -> None:
    """Catches ``highest_fence <= fence`` alone: two holders that were handed the same token
    (a counter restored from an older snapshot) could both write. The holder recorded with the
    fence may write again with it; anyone else with that fence is refused, and counted."""
    with db.transaction() as conn:
        conn.exec_driver_sql(BUSINESS_DDL)
    resource = "acct:2"
    with fenced_write(db, resource, 7, holder="A") as conn:
        write_business(conn, resource, "A1", 7)
    with fenced_write(db, resource, 7, holder="A") as conn:  # the same holder, again
        write_business(conn, resource, "A2", 7)
    with pytest.raises(FencedWriteRejected), fenced_write(db, resource, 7, holder="B") as conn:
        write_business(conn, resource, "B", 7)
    with pytest.raises(FencedWriteRejected), fenced_write(db, resource, 7) as conn:
        write_business(conn, resource, "anonymous", 7)  # no holder: cannot be the same one
    with fenced_write(db, resource, 8, holder="B") as conn:
        write_business(conn, resource, "B8", 8)
    status = fence_status(db, resource)
    assert status is not None and (status.highest_fence, status.rejected) == (8, 2)


def test_cache_invalidation_versions_grow_across_a_restart_from_an_older_snapshot(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """Catches an invalidation version that is reseeded only when INCR returns 1: restored from
    the snapshot it counts again through versions already handed out, so a rebuild holding one
    of them could pass the write script's version check."""
    cache = StampedeCache(redis_client(redis_server.url), namespace="loss")
    try:
        first = cache.invalidate("k")
        snapshot = redis_server.snapshot(tmp_path / "older.rdb")
        issued = [cache.invalidate("k") for _ in range(3)]
        assert issued == sorted(issued) and issued[0] > first
        redis_server.restart_from(snapshot)
        assert cache.invalidate("k") > issued[-1]
    finally:
        cache.close()
