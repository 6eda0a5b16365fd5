"""Locks against real Redis, SQLite and Postgres, with real processes and real signals.

Each test's docstring names the regression it would catch.
"""

from __future__ import annotations

import inspect
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import create_engine, text
from sqlalchemy.exc import OperationalError

from resources.dagster_resources import LockResource
from resources.errors import FencedWriteRejected
from resources.locks import (
    DbLock,
    LockLost,
    LockNotAcquired,
    MemoryLockStats,
    NoLock,
    RedisLock,
    RedisLockStats,
    fence_status,
    fenced_write,
    lock_row,
    lock_rows,
    lock_stats,
    name_pattern,
)
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from resources.storage.redis import redis_client as connect_redis
from sandbox.redis_server import RedisServer
from tests import lock_workers
from tests.lock_workers import BUSINESS_DDL, COUNTER_DDL, write_business

SPAWN = multiprocessing.get_context("forkserver")
SPAWN.set_forkserver_preload(["resources.locks", "tests.lock_workers"])
"""Children fork from a server that imported the lock code once (a spawn per child costs ~1.5 s
of imports; 16 of them on 2 shared cores dominate the test otherwise)."""
WORKERS = Path(lock_workers.__file__)


def migrated(url: str) -> Database:
    db = Database.from_url(url)
    upgrade(db)
    with db.transaction() as conn:
        conn.exec_driver_sql(COUNTER_DDL)
        conn.exec_driver_sql(BUSINESS_DDL)
    return db


@pytest.fixture(params=["redis", "db"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def new_lock(backend: str, target: Any, name: str, **kwargs: Any) -> RedisLock | DbLock:
    if backend == "redis":
        return RedisLock(target, name, observer=kwargs.pop("observer", MemoryLockStats()), **kwargs)
    return DbLock(target, name, **kwargs)


@pytest.fixture
def target(backend: str, redis_client: redis.Redis, sqlite_url: str) -> Iterator[Any]:
    """What a lock of ``backend`` is built on: a Redis client or a migrated SQLite database."""
    if backend == "redis":
        yield redis_client
        return
    db = migrated(sqlite_url)
    yield db
    db.dispose()


# -- mutual exclusion ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind",
    [
        "redis",
        "db-sqlite",
        pytest.param("db-postgres", marks=pytest.mark.postgres),
        "tx-sqlite",
        pytest.param("tx-postgres", marks=pytest.mark.postgres),
    ],
)
def test_mutual_exclusion_threads_and_processes(
    kind: str, request: pytest.FixtureRequest, redis_url: str, namespace: str
) -> None:
    """8 threads in each of 4 processes do a read-sleep-write increment under the lock.

    Catches: a non-atomic acquire (two holders at once), a release that frees someone else's
    lock, or a transactional lock that does not hold until commit: any of them loses updates.
    """
    backend, _, dialect = kind.partition("-")
    processes, threads, rounds = 4, 8, (4 if backend == "redis" else 3)
    name = f"{namespace}:counter"
    if backend == "redis":
        url = redis_url
        connect_redis(url).set(name, 0)
    else:
        url = request.getfixturevalue("sqlite_url" if dialect == "sqlite" else "postgres_url")
        db = migrated(url)
        with db.transaction() as conn:
            conn.execute(text("INSERT INTO lock_counter (name, value) VALUES (:n, 0)"), {"n": name})
    with SPAWN.Pool(processes) as pool:
        results = pool.starmap(
            lock_workers.exclusion_worker,
            [(backend, url, name, name, threads, rounds, 0.001)] * processes,
        )
    errors = [e for r in results for e in r["errors"]]
    fences = [f for r in results for f in r["fences"]]
    assert errors == []
    total = processes * threads * rounds
    if backend == "redis":
        final = int(connect_redis(url).get(name) or 0)
    else:
        with db.statement() as conn:
            final = conn.execute(
                text("SELECT value FROM lock_counter WHERE name = :n"), {"n": name}
            ).scalar_one()
        db.dispose()
    assert final == total, f"lost {total - final} of {total} updates"
    assert len(set(fences)) == total, "two grants shared a fencing token"


def test_without_a_lock_the_same_workload_loses_updates(
    redis_client: redis.Redis, namespace: str
) -> None:
    """Control for the test above: with NoLock the read-sleep-write does lose updates.

    Catches: a mutual-exclusion test that would pass whatever the lock did.
    """
    counter = f"{namespace}:nolock"
    redis_client.set(counter, 0)

    def run() -> None:
        for _ in range(5):
            with NoLock(counter) as lock:
                lock.check()
                value = int(redis_client.get(counter) or 0)
                time.sleep(0.002)
                redis_client.set(counter, value + 1)

    pool = [threading.Thread(target=run) for _ in range(8)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert int(redis_client.get(counter) or 0) < 40


# -- expiry mid-job: SIGSTOP / SIGCONT ---------------------------------------------------------


@pytest.mark.parametrize(
    "kind", ["redis", "db-sqlite", pytest.param("db-postgres", marks=pytest.mark.postgres)]
)
def test_stopped_holder_loses_lock_and_its_fenced_write_is_rejected(
    kind: str, request: pytest.FixtureRequest, redis_url: str, namespace: str, tmp_path: Path
) -> None:
    """A holder stopped past its TTL resumes to LockLost, and its fenced write is refused.

    Catches: a check() that trusts local state only, a fence that does not grow on takeover,
    a fenced write that lets an older token through, or a rejection that is not counted.
    """
    backend, _, dialect = kind.partition("-")
    db_url = request.getfixturevalue("postgres_url" if dialect == "postgres" else "sqlite_url")
    db = migrated(db_url)
    lock_url = redis_url if backend == "redis" else db_url
    name = f"{namespace}:job"
    resource = "business:" + name
    go_file = tmp_path / "go"
    ttl = 1.0
    holder = subprocess.Popen(
        [
            sys.executable,
            str(WORKERS),
            "stale-holder",
            backend,
            lock_url,
            db_url,
            name,
            str(go_file),
            str(ttl),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        first = json.loads(holder.stdout.readline())
        assert first["event"] == "acquired"
        os.kill(holder.pid, signal.SIGSTOP)
        target = connect_redis(redis_url) if backend == "redis" else db
        second = new_lock(backend, target, name, ttl=30, blocking_timeout=20)
        with second:
            assert second.fence > first["fence"]
            with fenced_write(db, resource, second) as conn:
                write_business(conn, resource, "B", second.fence)
            os.kill(holder.pid, signal.SIGCONT)
            go_file.touch()
            check = json.loads(holder.stdout.readline())
            write = json.loads(holder.stdout.readline())
        assert holder.wait(30) == 0
    finally:
        if holder.poll() is None:
            os.kill(holder.pid, signal.SIGCONT)
            holder.kill()
            holder.wait()
    assert check == {"event": "check", "lost": True, "reason": check["reason"]}
    assert write == {"event": "write", "rejected": True, "highest": second.fence}
    with db.statement() as conn:
        row = conn.execute(
            text("SELECT value, fence FROM lock_business WHERE resource = :r"), {"r": resource}
        ).one()
    assert (row.value, row.fence) == ("B", second.fence)
    status = fence_status(db, resource)
    assert status is not None and status.rejected == 1 and status.highest_fence == second.fence
    db.dispose()


# -- renewal and max_hold ----------------------------------------------------------------------


def test_redis_renewal_holds_a_1s_lock_through_5s_and_max_hold_stops_it(
    redis_client: redis.Redis, namespace: str
) -> None:
    """The watchdog keeps a 1 s TTL lock ours through 5 s of work; max_hold ends renewal.

    Catches: a watchdog that never runs, one that renews a lock it lost, or one that renews
    forever past the hold bound (a hung holder would then keep the lock for good).
    """
    stats = MemoryLockStats()
    name = f"{namespace}:renew"
    lock = RedisLock(redis_client, name, ttl=1.0, observer=stats)
    other = RedisLock(redis_client, name, ttl=1.0, blocking_timeout=0, observer=stats)
    with lock:
        fence = lock.fence
        for _ in range(10):
            time.sleep(0.5)
            lock.check()
            with pytest.raises(LockNotAcquired):
                other.acquire()
        assert redis_client.get(lock.key) == lock.token.encode()  # type: ignore[union-attr]
        assert stats.get(name, "renewed") >= 5
        assert lock.fence == fence

    bounded = RedisLock(redis_client, name, ttl=1.0, max_hold=1.5, observer=stats)
    bounded.acquire()
    time.sleep(1.0)
    bounded.check()
    deadline = time.monotonic() + 10
    while redis_client.exists(bounded.key) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not redis_client.exists(bounded.key), "renewal went on past max_hold"
    with pytest.raises(LockLost, match="max_hold"):
        bounded.check()
    other.acquire(blocking_timeout=5)
    other.release()
    assert bounded.release() is False


def test_db_renewal_and_max_hold(db: Database, namespace: str) -> None:
    """Same as above for the lease row, on SQLite and Postgres: renewal keeps a 1 s lease
    through 3 s of work, and after max_hold the lease expires and another worker takes it."""
    stats = MemoryLockStats()
    name = f"{namespace}:renew"
    lock = DbLock(db, name, ttl=1.0, observer=stats)
    other = DbLock(db, name, ttl=1.0, blocking_timeout=0)
    with lock:
        for _ in range(6):
            time.sleep(0.5)
            lock.check()
            with pytest.raises(LockNotAcquired):
                other.acquire()
        assert stats.get(name, "renewed") >= 3
    bounded = DbLock(db, name, ttl=1.0, max_hold=1.0)
    bounded.acquire()
    other.acquire(blocking_timeout=10)  # granted once the unrenewed lease runs out
    assert other.fence == bounded.fence + 1
    with pytest.raises(LockLost):
        bounded.check()
    other.release()


# -- wrong token, timeout, wake-up -------------------------------------------------------------


def test_release_with_wrong_or_stale_token_changes_nothing(
    backend: str, target: Any, namespace: str
) -> None:
    """Catches a release that deletes without comparing the owner token (the classic bug: a
    slow holder's late release frees the lock of the worker that took it over)."""
    name = f"{namespace}:wrong"
    a = new_lock(backend, target, name, ttl=0.5, auto_renew=False)
    a.acquire()
    assert a.release_token(uuid.uuid4().hex) is False
    a.check()
    time.sleep(0.8)  # a's lease runs out
    b = new_lock(backend, target, name, ttl=30, blocking_timeout=5)
    b.acquire()
    assert a.release() is False  # stale release
    b.check()  # still b's
    with pytest.raises(LockNotAcquired):
        new_lock(backend, target, name, ttl=30, blocking_timeout=0).acquire()
    assert b.release() is True


def test_blocking_acquire_honours_its_timeout(backend: str, target: Any, namespace: str) -> None:
    """Catches a wait that returns early without the lock, or one that never gives up."""
    name = f"{namespace}:timeout"
    holder = new_lock(backend, target, name, ttl=30)
    with holder:
        waiter = new_lock(backend, target, name, ttl=30, blocking_timeout=0.5)
        started = time.monotonic()
        with pytest.raises(LockNotAcquired) as info:
            waiter.acquire()
        elapsed = time.monotonic() - started
        assert elapsed >= 0.5  # (a wait that ignored its timeout would outlive the 30 s TTL
        # and acquire: pytest.raises above fails then; no wall-clock ceiling needed)
        assert info.value.waited >= 0.5 and info.value.name == name
        assert not waiter.held
    waiter.acquire(blocking_timeout=0)
    waiter.release()


def _granted_after_a_wait_longer_than_its_ttl(holder: Any, waiter: Any) -> None:
    holder.acquire()
    releaser = threading.Timer(1.5, holder.release)
    releaser.start()
    try:
        waiter.acquire()  # queued ~1.5 s, longer than its 1 s ttl
        waiter.check()  # its ttl counts from the grant, not from the first attempt
        assert waiter.fence > holder.fence
    finally:
        releaser.join()
        waiter.release()


def test_redis_lock_granted_after_a_long_wait_is_not_lost(
    redis_client: redis.Redis, namespace: str
) -> None:
    """Catches a validity window counted from the first attempt: a waiter queued longer than
    its TTL got a lock whose check() raised LockLost("ttl ran out") straight away."""
    name = f"{namespace}:long-wait"
    holder = RedisLock(redis_client, name, ttl=30, observer=MemoryLockStats())
    waiter = RedisLock(
        redis_client,
        name,
        ttl=1.0,
        blocking_timeout=10,
        auto_renew=False,
        observer=MemoryLockStats(),
    )
    _granted_after_a_wait_longer_than_its_ttl(holder, waiter)


def test_db_lock_granted_after_a_long_wait_is_not_lost(db: Database, namespace: str) -> None:
    """Same as above for the lease row, on SQLite and Postgres."""
    name = f"{namespace}:long-wait"
    holder = DbLock(db, name, ttl=30)
    waiter = DbLock(db, name, ttl=1.0, blocking_timeout=10, auto_renew=False)
    _granted_after_a_wait_longer_than_its_ttl(holder, waiter)


def test_redis_waiter_is_woken_by_release_not_by_polling(
    redis_client: redis.Redis, namespace: str
) -> None:
    """With a 60 s TTL and a 60 s queue poll, only the release signal can wake the waiter
    within its 10 s timeout. Catches a release that does not signal the head waiter."""
    name = f"{namespace}:wake"
    holder = RedisLock(redis_client, name, ttl=60, queue_ttl=60, observer=MemoryLockStats())
    holder.acquire()
    got: list[int] = []

    def wait() -> None:
        lock = RedisLock(
            redis_client,
            name,
            ttl=60,
            queue_ttl=60,
            blocking_timeout=10,
            observer=MemoryLockStats(),
        )
        with lock:
            got.append(lock.fence)

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.5)
    holder.release()
    thread.join(30)
    assert len(got) == 1 and got[0] > holder.fence


# -- Redis restart -----------------------------------------------------------------------------


def test_redis_restart_while_held_raises_lock_lost(redis_server: RedisServer) -> None:
    """Catches silent continuation after Redis lost the key, and a fence that goes back to 1
    after Redis lost its counter (a stale holder's token would then beat the new one's)."""
    client = redis_server.client()
    lock = RedisLock(client, "restart:1", ttl=30, observer=MemoryLockStats())
    lock.acquire()
    lock.check()
    before = lock.fence
    redis_server.restart()
    with pytest.raises(LockLost):
        lock.check()
    with pytest.raises(LockLost):
        lock.check()  # stays lost
    lock.release()
    again = RedisLock(client, "restart:1", ttl=30, blocking_timeout=5, observer=MemoryLockStats())
    with again:
        again.check()
        assert again.fence > before


def test_redis_down_while_held_is_lost_not_ignored(redis_server: RedisServer) -> None:
    """Catches a check() that swallows connection errors and lets the holder go on."""
    client = redis.Redis.from_url(redis_server.url, socket_timeout=2, socket_connect_timeout=2)
    lock = RedisLock(client, "down:1", ttl=30, observer=MemoryLockStats())
    lock.acquire()
    redis_server.stop()
    with pytest.raises(LockLost, match="unavailable"):
        lock.check()
    assert lock.release() is False


# -- fairness ---------------------------------------------------------------------------------


def test_fairness_16_processes_every_one_gets_the_lock(redis_url: str, namespace: str) -> None:
    """16 processes loop acquire / hold 5 ms / release for 3 s: none starves.

    Catches a barging lock where the releaser re-acquires before the woken waiter can.
    """
    processes = 16
    barrier = SPAWN.Barrier(processes)
    name = f"{namespace}:fair"
    out = SPAWN.Queue()
    procs = [
        SPAWN.Process(
            target=lock_workers.fairness_process, args=(redis_url, name, barrier, 3.0, 0.005, out)
        )
        for _ in range(processes)
    ]
    for proc in procs:
        proc.start()
    try:
        results = [out.get(timeout=120) for _ in procs]
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
    counts = sorted(r["count"] for r in results)
    print(f"fairness: min={counts[0]} max={counts[-1]} counts={counts}")
    assert counts[0] >= 1, f"a process starved: {counts}"


# -- fenced writes -----------------------------------------------------------------------------


def test_fenced_write_accepts_current_rejects_older_and_rolls_back(
    db: Database, namespace: str
) -> None:
    """Catches a fence check outside the business transaction (the stale write would commit),
    a strict '<' that refuses a holder's second write, and an uncounted rejection."""
    with db.transaction() as conn:
        conn.exec_driver_sql(BUSINESS_DDL)
    resource = f"{namespace}:acct"
    with fenced_write(db, resource, 5, holder="h5") as conn:
        write_business(conn, resource, "v5", 5)
    with fenced_write(db, resource, 5, holder="h5") as conn:  # same holder, second write
        write_business(conn, resource, "v5b", 5)
    with pytest.raises(FencedWriteRejected) as info, fenced_write(db, resource, 4) as conn:
        write_business(conn, resource, "stale", 4)
    assert info.value.highest == 5 and info.value.fence == 4
    with pytest.raises(RuntimeError), fenced_write(db, resource, 9) as conn:
        write_business(conn, resource, "v9", 9)
        raise RuntimeError("business step failed")
    with fenced_write(db, resource, 6) as conn:  # 9 was rolled back with its transaction
        write_business(conn, resource, "v6", 6)
    with db.statement() as conn:
        value = conn.execute(
            text("SELECT value FROM lock_business WHERE resource = :r"), {"r": resource}
        ).scalar_one()
    assert value == "v6"
    status = fence_status(db, resource)
    assert status is not None and (status.highest_fence, status.rejected) == (6, 1)


def test_transactional_lock_gives_way_to_a_live_lease_and_locks_rows(
    db: Database, namespace: str
) -> None:
    """Catches a transactional lock that ignores a live DbLock lease on the same name."""
    with db.transaction() as conn:
        conn.exec_driver_sql(COUNTER_DDL)
        conn.execute(text("INSERT INTO lock_counter (name, value) VALUES ('c', 1)"))
    name = f"{namespace}:tx"
    with db.transaction() as conn:
        first = DbLock.transactional(conn, name)
        assert lock_row(conn, "lock_counter", "name", "c").value == 1
        assert lock_row(conn, "lock_counter", "name", "missing") is None
    lease = DbLock(db, name, ttl=30)
    with lease:
        assert lease.fence == first + 1
        with pytest.raises(LockNotAcquired), db.transaction() as conn:
            DbLock.transactional(conn, name)
    with db.transaction() as conn:
        assert DbLock.transactional(conn, name) == first + 2
    with pytest.raises(ValueError), db.transaction() as conn:
        lock_row(conn, "lock_counter; DROP TABLE x", "name", "c")


# -- the interface, metrics, resource ----------------------------------------------------------


def test_nolock_has_the_same_interface() -> None:
    """Catches NoLock drifting from the interface jobs are written against."""
    locks = [
        NoLock("x"),
        RedisLock(redis.Redis(), "x", ttl=1),  # nothing dialled until used
        DbLock(create_engine("sqlite://"), "x", ttl=1),
    ]
    for attr in ("acquire", "release", "extend", "check", "held", "fence", "token", "name"):
        assert all(hasattr(lock, attr) for lock in locks), attr
    for method in ("acquire", "release", "extend", "check", "__enter__", "__exit__"):
        params = {
            tuple(inspect.signature(getattr(type(lock), method)).parameters) for lock in locks
        }
        assert len(params) == 1, (method, params)
    with NoLock("x", ttl=1) as lock:
        assert lock.held and lock.fence == 0 and lock.token
        lock.check()
        lock.extend()
    assert not lock.held


def test_metrics_are_shared_across_instances_in_redis(
    redis_client: redis.Redis, namespace: str
) -> None:
    """Two observers (as two processes would have) add into one Redis hash, per name pattern.

    Catches per-entity field explosion (order:1, order:2 ... as separate fields) and lost counts.
    """
    key = f"sekali:stats:locks:{namespace}"
    assert name_pattern("order:123") == "order:*" and name_pattern("nightly") == "nightly"
    first = RedisLockStats(redis_client, key=key, flush_interval=60)
    second = RedisLockStats(redis_client, key=key, flush_interval=60)
    for i, stats in enumerate((first, second)):
        with RedisLock(redis_client, f"{namespace}:order:{i}", ttl=5, observer=stats) as lock:
            lock.check()
        with (
            pytest.raises(LockNotAcquired),
            RedisLock(redis_client, f"{namespace}:order:{i}", ttl=5, observer=stats),
            RedisLock(
                redis_client, f"{namespace}:order:{i}", ttl=5, blocking_timeout=0, observer=stats
            ),
        ):
            pass
    assert lock_stats(redis_client, key=key) == {}  # nothing flushed yet: no hot-path round trip
    first.flush()
    second.flush()
    got = lock_stats(redis_client, key=key)[name_pattern(f"{namespace}:order:0")]
    assert got["acquired"] == 4 and got["acquire_failed"] == 2
    assert got["hold_seconds"] > 0 and "wait_seconds" in got


def test_lock_resource_builds_each_backend_without_connecting_early(
    redis_url: str, sqlite_url: str, namespace: str
) -> None:
    """Catches a resource that connects at construction, or a backend switch that ignores config."""
    unreachable = LockResource(backend="redis", redis_url="redis://127.0.0.1:1/0")
    assert unreachable.ttl_seconds == 30.0  # built fine; nothing dialled yet
    upgrade(Database.from_url(sqlite_url))
    resources: list[tuple[LockResource, type]] = [
        (
            LockResource(backend="redis", redis_url=redis_url, ttl_seconds=5, wait_seconds=1),
            RedisLock,
        ),
        (
            LockResource(backend="db", database_url=sqlite_url, ttl_seconds=5, wait_seconds=1),
            DbLock,
        ),
        (LockResource(backend="none", ttl_seconds=5, wait_seconds=1), NoLock),
    ]
    for resource, kind in resources:
        lock = resource.lock(f"{namespace}:res")
        assert isinstance(lock, kind)
        with lock:
            lock.check()
    connect_redis(redis_url).delete(f"sekali:lock:{{{namespace}:res}}:fence")


def test_redis_dead_or_departed_waiters_do_not_block_the_queue(
    redis_client: redis.Redis, namespace: str
) -> None:
    """A waiter that died while queued drops out after queue_ttl, and one that gave up hands
    the turn on. Catches a FIFO queue whose head, once gone, blocks every later waiter."""
    name = f"{namespace}:queue"
    quick: dict[str, Any] = {"ttl": 30, "queue_ttl": 0.6, "observer": MemoryLockStats()}
    holder = RedisLock(redis_client, name, **quick)
    holder.acquire()
    ghost = RedisLock(redis_client, name, **quick)
    assert ghost._try_acquire("ghost-token", True)[0] is None  # queued, then never returns
    impatient = RedisLock(redis_client, name, blocking_timeout=0.2, **quick)
    with pytest.raises(LockNotAcquired):
        impatient.acquire()  # queued behind the ghost, gives up and leaves
    holder.release()
    late = RedisLock(redis_client, name, blocking_timeout=20, **quick)
    with late:
        late.check()
        assert late.fence > holder.fence
    assert redis_client.zscore(f"sekali:lock:{{{name}}}:queue", "ghost-token") is None


def test_sql_creates_the_lock_tables_the_code_declares(db: Database) -> None:
    """Catches sql/0020_locks.sql drifting from the Table objects the lock code declares."""
    from sqlalchemy import inspect as sa_inspect

    from resources.locks import lock_leases
    from resources.locks.fencing import fence_registry

    inspector = sa_inspect(db.engine)
    for table in (lock_leases, fence_registry):
        found = {c["name"]: c["nullable"] for c in inspector.get_columns(table.name)}
        declared = {c.name: c.nullable for c in table.columns}
        assert set(found) == set(declared), table.name
        assert inspector.get_pk_constraint(table.name)["constrained_columns"] == [
            c.name for c in table.primary_key
        ]
    assert upgrade(db) == []  # applying again is a no-op


@pytest.mark.postgres
def test_lock_rows_locks_every_row_it_returns_in_key_order(postgres_url: str) -> None:
    """Catches ``lock_rows`` reading without locking on Postgres (a second transaction could
    then change stock between the check and the write), or in the caller's order (two carts
    naming the same SKUs in opposite orders would deadlock)."""
    db = migrated(postgres_url)
    with db.transaction() as conn:
        conn.exec_driver_sql(COUNTER_DDL)
        for name in ("c", "a", "b"):
            conn.execute(text("INSERT INTO lock_counter (name, value) VALUES (:n, 1)"),
                         {"n": name})
    other = create_engine(postgres_url)
    try:
        with db.transaction() as conn:
            rows = lock_rows(conn, "lock_counter", "name", ["c", "a", "missing", "a"])
            assert [r.name for r in rows] == ["a", "c"]
            with other.connect() as second:
                for name, locked in (("a", True), ("c", True), ("b", False)):
                    try:
                        second.execute(text("SELECT 1 FROM lock_counter WHERE name = :n"
                                            " FOR UPDATE NOWAIT"), {"n": name})
                        held = False
                    except OperationalError:
                        held = True
                    second.rollback()
                    assert held is locked, name
        with db.statement() as conn:
            assert lock_rows(conn, "lock_counter", "name", []) == []
        with pytest.raises(ValueError), db.transaction() as conn:
            lock_rows(conn, "lock_counter", "name; DROP TABLE x", ["a"])
    finally:
        other.dispose()
        db.dispose()


@pytest.mark.postgres
def test_refresh_statistics_analyzes_each_table_on_postgres(postgres_url: str) -> None:
    """Catches a benchmark's bulk load left without planner statistics on Postgres (its
    figures would then measure a plan no deployed table gets), and an identifier let through."""
    db = migrated(postgres_url)
    try:
        db.sql_dialect.refresh_statistics(db, "dlq_records", "job_requests")
        with db.statement() as conn:
            analyzed = {r.relname for r in conn.execute(text(
                "SELECT relname FROM pg_stat_user_tables WHERE last_analyze IS NOT NULL"
                " AND schemaname = current_schema()"))}
        assert {"dlq_records", "job_requests"} <= analyzed
        with pytest.raises(ValueError):
            db.sql_dialect.refresh_statistics(db, "dlq_records; DROP TABLE x")
    finally:
        db.dispose()
