"""Frozen servers: a worker cut off from Redis or Postgres gives up within a stated bound.

Each test freezes a private server with SIGSTOP (the kernel still accepts connections and
acknowledges packets, nothing answers: a hung process, a paused VM) and runs the call on a
thread. It asserts that the call ended, with a generous multiple of the stated bound as the
test's own patience; that is a liveness check, not a speed measurement. The server is thawed
in ``finally``. Each docstring names the regression it would catch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from resources.cache import StampedeCache
from resources.errors import LeaseLost, LockLost, LockNotAcquired, StoreUnavailable
from resources.idempotency import Claim, IdempotencyStore
from resources.locks import MemoryLockStats, RedisLock
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from resources.storage.redis import redis_client
from resources.storage.settings import DatabaseTimeouts, RedisTimeouts
from sandbox.postgres_server import PostgresServer, PostgresUnavailable
from sandbox.redis_server import RedisServer
from tests.conftest import need_server

PATIENCE = 8.0
"""The test's own timeout, as a multiple of the stated bound: generous, never a speed claim."""

REDIS = RedisTimeouts(socket=0.5, connect=0.5)


def ends_within(seconds: float, fn: Callable[[], Any]) -> BaseException | Any:
    """Run ``fn`` on a thread; fail unless it returned or raised within ``seconds``. Returns its
    result or the exception it raised."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn} still blocked after {seconds:.1f}s (no bound)"
    return box[0]


@contextlib.contextmanager
def frozen_redis(server: RedisServer) -> Iterator[None]:
    assert server.process is not None
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


# -- Redis ------------------------------------------------------------------------------------


def test_lock_acquire_check_and_renewal_end_within_the_bound_on_a_frozen_redis(
    redis_server: RedisServer,
) -> None:
    """Catches a Redis client without socket timeouts (a frozen server blocks acquire and
    check() for the whole freeze), a renewal watchdog that hangs or keeps a lock it could not
    renew, and a lock-stats flush on the caller's thread that waits a second time."""
    client = redis_client(redis_server.url, timeouts=REDIS)
    held = RedisLock(client, "frozen:held", ttl=30, auto_renew=False)  # default stats: on Redis
    stats = MemoryLockStats()
    renewing = RedisLock(client, "frozen:renewing", ttl=1.0, observer=stats)
    waiter = RedisLock(client, "frozen:held", ttl=30, blocking_timeout=0.3)
    held.acquire()
    renewing.acquire()
    with frozen_redis(redis_server):
        lost = ends_within(PATIENCE * REDIS.bound, held.check)
        assert isinstance(lost, LockLost) and "unavailable" in lost.reason
        failed = ends_within(PATIENCE * (REDIS.bound + 0.3), waiter.acquire)
        assert isinstance(failed, (StoreUnavailable, LockNotAcquired)), repr(failed)
        deadline = time.monotonic() + PATIENCE * (renewing.ttl + 2 * REDIS.bound)
        while stats.get(renewing.name, "renew_failed") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stats.get(renewing.name, "renew_failed") >= 2, "the watchdog hung in a renewal"
        with pytest.raises(LockLost, match="renewal failed|ttl ran out"):
            renewing.check(remote=False)  # lost, never silently kept
    assert held.release() is True  # thawed: its key is still there until the TTL runs out


def test_cache_calls_raise_store_unavailable_within_the_bound_on_a_frozen_redis(
    redis_server: RedisServer,
) -> None:
    """Catches a cache whose reads or miss script block for as long as Redis is frozen."""
    cache = StampedeCache(redis_client(redis_server.url, timeouts=REDIS), namespace="frozen")
    try:
        assert cache.get_or_load("k", lambda: {"v": 1}) == {"v": 1}
        with frozen_redis(redis_server):
            for call in (lambda: cache.get("k"), lambda: cache.get_or_load("j", lambda: 2)):
                assert isinstance(ends_within(PATIENCE * REDIS.bound, call), StoreUnavailable)
    finally:
        cache.close()


def test_blocking_waits_stay_shorter_than_the_socket_timeout(
    redis_server: RedisServer,
) -> None:
    """Catches a BLPOP whose server-side timeout exceeds the client's socket timeout: on a
    healthy server the client gives up first and the waiter fails with a timeout instead of
    getting the lock (or the cached value) when the holder is done."""
    client = redis_client(redis_server.url, timeouts=REDIS)
    holder = RedisLock(client, "wait:1", ttl=30, observer=MemoryLockStats()).acquire()
    waiter = RedisLock(
        client, "wait:1", ttl=30, queue_ttl=6.0, blocking_timeout=10, observer=MemoryLockStats()
    )  # would BLPOP for queue_ttl / 3 = 2 s
    releaser = threading.Timer(1.5, holder.release)
    releaser.start()
    try:
        with waiter:
            assert waiter.fence > holder.fence
    finally:
        releaser.join()
    loading_cache = StampedeCache(redis_client(redis_server.url), namespace="wait")
    waiting_cache = StampedeCache(  # BLPOPs up to 2 s a time
        redis_client(redis_server.url, timeouts=REDIS), namespace="wait", safety_tick=2.0
    )
    loading = threading.Event()

    def slow() -> int:
        loading.set()
        time.sleep(1.5)
        return 7

    try:
        loader = threading.Thread(target=loading_cache.get_or_load, args=("k", slow))
        loader.start()
        assert loading.wait(5)
        assert waiting_cache.get_or_load("k", lambda: -1) == 7  # woken by the loader's write
        loader.join()
    finally:
        loading_cache.close()
        waiting_cache.close()


# -- Postgres ---------------------------------------------------------------------------------

PG = DatabaseTimeouts(connect=2, statement=1.0, lock=0.5, margin=0.5)


@pytest.fixture(scope="module")
def private_pg() -> Iterator[PostgresServer]:
    try:
        server = PostgresServer().start()
    except PostgresUnavailable as exc:
        need_server("a private PostgreSQL cluster (initdb, pg_ctl)", exc)
        raise
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def private_db_url(private_pg: PostgresServer) -> str:
    """A fresh database on the private cluster."""
    name = "t_" + uuid.uuid4().hex[:10]
    engine = create_engine(private_pg.url(), isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text(f"CREATE DATABASE {name}"))
    engine.dispose()
    return private_pg.url(name)


def test_store_calls_on_a_frozen_postgres_raise_within_the_bound_and_the_lease_is_taken_over(
    private_pg: PostgresServer, private_db_url: str
) -> None:
    """Catches a database client without a deadline (a frozen server blocks the heartbeat and
    every store call for the whole freeze) and a lease keeper that keeps its holder going after
    the lease it could not renew ran out.

    t=0    A claims K (lease 2 s), heartbeats every 0.5 s; Postgres freezes
    t<4    A's store call raises StoreUnavailable (bound: connect x 2 + statement + margin)
    t=2+   the lease A last confirmed runs out: A's keeper says LeaseLost, A stops
    thaw   B claims K: a takeover; A's late write is refused
    """
    db = Database.from_url(private_db_url, timeouts=PG)
    upgrade(db)
    store = IdempotencyStore(db, lease_seconds=2.0)
    claim = store.begin("frozen:k", payload={"n": 1})
    assert isinstance(claim, Claim)
    try:
        with store.keep_alive(claim, interval=0.5) as keeper:
            private_pg.freeze()
            try:
                error = ends_within(PATIENCE * PG.bound, lambda: store.heartbeat(claim))
                assert isinstance(error, StoreUnavailable), repr(error)
                time.sleep(max(0.0, claim.lease_expires_at - time.time()))
                stopped = ends_within(PATIENCE * PG.bound, keeper.check)
                assert isinstance(stopped, LeaseLost), repr(stopped)
            finally:
                private_pg.thaw()
            other_db = Database.from_url(private_db_url, timeouts=PG)
            other = IdempotencyStore(other_db, lease_seconds=2)
            taken = other.begin("frozen:k", payload={"n": 1})
            assert isinstance(taken, Claim) and taken.takeover
        with pytest.raises(LeaseLost):
            store.complete(claim, {"stale": True})
        other.complete(taken, {"ok": True})
        other_db.dispose()
    finally:
        db.dispose()


def test_a_batch_keeper_on_a_frozen_postgres_stops_its_jobs_and_revives_nothing(
    private_pg: PostgresServer, private_db_url: str
) -> None:
    """Catches a micro-batch's lease keeper that lets its jobs go on after the leases it could
    not renew ran out (the single-key keeper stops its job), or that renews them once the
    database answers again, after its jobs were told to stop.

    t=0    a batch claims K1, K2 (lease 2 s), one keeper beats both every 0.5 s; Postgres freezes
    t=2+   the leases last confirmed run out: each job's check() raises LeaseLost
    thaw   B claims K1 and K2: takeovers; the batch's late completions are refused
    """
    db = Database.from_url(private_db_url, timeouts=PG)
    upgrade(db)
    store = IdempotencyStore(db, lease_seconds=2.0)
    claims = store.begin_many([("frozen:b1", {"n": 1}), ("frozen:b2", {"n": 2})])
    assert all(isinstance(c, Claim) for c in claims)
    try:
        with store.keep_alive_many(claims, interval=0.5) as keeper:  # type: ignore[arg-type]
            members = [keeper.keeper_for(c) for c in claims]  # type: ignore[arg-type]
            private_pg.freeze()
            try:
                time.sleep(max(0.0, max(c.lease_expires_at for c in claims) - time.time()))
                for member in members:
                    stopped = ends_within(PATIENCE * PG.bound, member.check)
                    assert isinstance(stopped, LeaseLost), repr(stopped)
            finally:
                private_pg.thaw()
            time.sleep(1.0)  # two beat intervals: a keeper still beating would renew now
            other_db = Database.from_url(private_db_url, timeouts=PG)
            other = IdempotencyStore(other_db, lease_seconds=2)
            taken = other.begin_many([("frozen:b1", {"n": 1}), ("frozen:b2", {"n": 2})])
            assert all(isinstance(t, Claim) and t.takeover for t in taken), taken
        lost = store.complete_many([(c, {"stale": True}) for c in claims])  # type: ignore[misc]
        assert all(isinstance(x, LeaseLost) for x in lost)
        other_db.dispose()
    finally:
        db.dispose()


def test_server_side_bounds_apply_to_every_transaction(private_db_url: str) -> None:
    """Catches a connection opened without statement_timeout / lock_timeout: a slow statement or
    a row lock held by a stalled transaction would hold the caller for as long as they last."""
    db = Database.from_url(private_db_url, timeouts=PG)
    try:
        with pytest.raises(StoreUnavailable, match="statement timeout"), db.statement() as conn:
            conn.execute(text("SELECT pg_sleep(5)"))
        with db.transaction() as conn:
            conn.execute(text("CREATE TABLE held (id INT PRIMARY KEY)"))
            conn.execute(text("INSERT INTO held VALUES (1)"))
        with db.transaction() as locker:
            locker.execute(text("SELECT * FROM held WHERE id = 1 FOR UPDATE"))
            with pytest.raises(StoreUnavailable, match="lock timeout"), db.transaction() as c:
                c.execute(text("SELECT * FROM held WHERE id = 1 FOR UPDATE"))
        with db.transaction(statement_timeout=10) as conn:  # a longer bound, asked for
            conn.execute(text("SELECT pg_sleep(1.5)"))
    finally:
        db.dispose()
