"""Worker functions the lock tests run in other processes (spawn context, or ``subprocess``).

Module-level so ``multiprocessing`` with ``spawn`` can import them; each opens its own clients.
Run as a script (``python tests/lock_workers.py stale-holder ...``) for the SIGSTOP test, which
needs a process it can stop and resume.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

from sqlalchemy import text

from resources.errors import FencedWriteRejected, LockLost
from resources.locks import DbLock, MemoryLockStats, RedisLock, fenced_write
from resources.storage.db import Database
from resources.storage.redis import redis_client

COUNTER_DDL = "CREATE TABLE IF NOT EXISTS lock_counter (name TEXT PRIMARY KEY, value INTEGER)"
BUSINESS_DDL = (
    "CREATE TABLE IF NOT EXISTS lock_business"
    " (resource TEXT PRIMARY KEY, value TEXT NOT NULL, fence BIGINT NOT NULL)"
)


def make_lock(backend: str, target: Any, name: str, **kwargs: Any) -> RedisLock | DbLock:
    if backend == "redis":
        return RedisLock(target, name, observer=MemoryLockStats(), **kwargs)
    return DbLock(target, name, **kwargs)


def _read_sleep_write(backend: str, target: Any, counter: str, pause: float) -> None:
    """Deliberately racy increment: only the lock around it keeps updates from being lost."""
    if backend == "redis":
        value = int(target.get(counter) or 0)
        time.sleep(pause)
        target.set(counter, value + 1)
        return
    db: Database = target
    with db.statement() as conn:
        row = conn.execute(text("SELECT value FROM lock_counter WHERE name = :n"), {"n": counter})
        value = int(row.scalar_one())
    time.sleep(pause)
    with db.statement() as conn:
        conn.execute(
            text("UPDATE lock_counter SET value = :v WHERE name = :n"),
            {"v": value + 1, "n": counter},
        )


def _tx_increment(db: Database, name: str, counter: str, pause: float) -> int:
    with db.transaction() as conn:
        fence = DbLock.transactional(conn, name)
        row = conn.execute(text("SELECT value FROM lock_counter WHERE name = :n"), {"n": counter})
        value = int(row.scalar_one())
        time.sleep(pause)
        conn.execute(
            text("UPDATE lock_counter SET value = :v WHERE name = :n"),
            {"v": value + 1, "n": counter},
        )
    return fence


def exclusion_worker(
    backend: str, url: str, name: str, counter: str, threads: int, rounds: int, pause: float
) -> dict[str, Any]:
    """``threads`` threads each do ``rounds`` locked read-sleep-write increments.

    backend: ``redis`` (counter is a Redis key), ``db`` (DbLock lease, counter a row) or ``tx``
    (DbLock.transactional inside the transaction that does the increment).
    """
    target: Any = redis_client(url) if backend == "redis" else Database.from_url(url)
    fences: list[int] = []
    errors: list[str] = []
    guard = threading.Lock()

    def run() -> None:
        try:
            for _ in range(rounds):
                if backend == "tx":
                    fence = _tx_increment(target, name, counter, pause)
                else:
                    lock = make_lock(backend, target, name, ttl=30, blocking_timeout=120)
                    with lock:
                        _read_sleep_write(backend, target, counter, pause)
                        fence = lock.fence
                with guard:
                    fences.append(fence)
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
            with guard:
                errors.append(repr(exc))

    pool = [threading.Thread(target=run) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return {"fences": fences, "errors": errors}


def fairness_worker(
    url: str, name: str, barrier: Any, duration: float, hold: float
) -> dict[str, Any]:
    """Loop acquire / hold / release for ``duration`` seconds after every process is ready."""
    client = redis_client(url)
    lock = RedisLock(client, name, ttl=10, blocking_timeout=60, observer=MemoryLockStats())
    barrier.wait()
    count = 0
    waits: list[float] = []
    deadline = time.monotonic() + duration
    while time.monotonic() < deadline:
        started = time.monotonic()
        lock.acquire()
        waits.append(time.monotonic() - started)
        time.sleep(hold)
        lock.release()
        count += 1
    return {"count": count, "max_wait": max(waits) if waits else None}


def fairness_process(
    url: str, name: str, barrier: Any, duration: float, hold: float, out: Any
) -> None:
    """Process entry point: a barrier cannot travel through a Pool, so results go on ``out``."""
    out.put(fairness_worker(url, name, barrier, duration, hold))


def stale_holder(
    backend: str, lock_url: str, db_url: str, name: str, go_file: str, ttl: float
) -> None:
    """Acquire, report, wait for ``go_file`` (the test stops and resumes us meanwhile), then
    try ``check()`` and a fenced write, reporting each outcome as a JSON line on stdout."""

    def say(**event: Any) -> None:
        sys.stdout.write(json.dumps(event) + "\n")
        sys.stdout.flush()

    db = Database.from_url(db_url)
    target: Any = redis_client(lock_url) if backend == "redis" else db
    # SQLite's lock is in-process: a holder stopped mid-renewal would block everyone, so the
    # SQLite variant holds without renewal. Redis and Postgres renew while running.
    renew = not (backend == "db" and db.dialect == "sqlite")
    lock = make_lock(backend, target, name, ttl=ttl, auto_renew=renew, blocking_timeout=10)
    lock.acquire()
    say(event="acquired", fence=lock.fence, token=lock.token)
    while not Path(go_file).exists():
        time.sleep(0.01)
    try:
        lock.check()
        say(event="check", lost=False)
    except LockLost as exc:
        say(event="check", lost=True, reason=exc.reason)
    try:
        with fenced_write(db, "business:" + name, lock.fence) as conn:
            write_business(conn, "business:" + name, "A", lock.fence)
        say(event="write", rejected=False)
    except FencedWriteRejected as exc:
        say(event="write", rejected=True, highest=exc.highest)
    lock.release()


def write_business(conn: Any, resource: str, value: str, fence: int) -> None:
    conn.execute(
        text(
            "INSERT INTO lock_business (resource, value, fence) VALUES (:r, :v, :f)"
            " ON CONFLICT (resource) DO UPDATE SET value = excluded.value, fence = excluded.fence"
        ),
        {"r": resource, "v": value, "f": fence},
    )


if __name__ == "__main__":
    if sys.argv[1] == "stale-holder":
        stale_holder(
            sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6], float(sys.argv[7])
        )
    else:
        raise SystemExit(f"unknown command {sys.argv[1]!r}")
