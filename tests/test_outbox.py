"""The outbox publisher and the inbox against SQLite and Postgres, with real processes.

Each test writes events with the real writer (``write_event``) in business transactions, then
publishes them with :class:`OutboxPublisher` into an in-app consumer whose inbox handler records
what it applied (``t_consumed``) and a per-aggregate sequence; every delivery attempt is also
recorded (``t_deliveries``) outside the inbox, so redeliveries are visible and countable.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.engine import Connection

from pipelines.domain.consumers import cache_invalidation_consumer
from resources.outbox import write_event
from resources.outbox.publisher import (
    Consumer,
    InAppPublisher,
    Inbox,
    OutboxEvent,
    OutboxPublisher,
    unpublished_older_than,
)
from resources.storage.db import Database
from resources.storage.migrations import upgrade

ROOT = Path(__file__).resolve().parent.parent
AGGREGATES = 8


def make_tables(db: Database) -> None:
    with db.transaction() as conn:
        conn.execute(
            text(
                "CREATE TABLE IF NOT EXISTS t_consumed (event_id TEXT NOT NULL, aggregate_id TEXT"
                " NOT NULL, seq INTEGER NOT NULL, outbox_id BIGINT NOT NULL, pid INTEGER NOT NULL)"
            )
        )
        conn.execute(
            text(
                "CREATE TABLE IF NOT EXISTS t_deliveries (event_id TEXT NOT NULL, pid INTEGER"
                " NOT NULL)"
            )
        )


def write_events(db: Database, n: int) -> None:
    for i in range(n):
        with db.transaction() as conn:
            write_event(
                conn,
                aggregate_type="order",
                aggregate_id=f"o{i % AGGREGATES}",
                event_type="order.step",
                payload={"i": i},
                event_id=f"ev-{i:05d}",
            )


def _consume(conn: Connection, event: OutboxEvent) -> None:
    seq = conn.execute(
        text("SELECT COALESCE(MAX(seq), 0) + 1 FROM t_consumed WHERE aggregate_id = :a"),
        {"a": event.aggregate_id},
    ).scalar()
    conn.execute(
        text("INSERT INTO t_consumed VALUES (:e, :a, :s, :o, :p)"),
        {"e": event.event_id, "a": event.aggregate_id, "s": seq, "o": event.id, "p": os.getpid()},
    )


class RecordingPublisher:
    """Records every delivery, then hands the event to the consumer through the inbox.
    ``die_after`` SIGKILLs this process right after the N-th inbox commit, before the publisher
    can mark the event published: the worst moment for at-least-once."""

    def __init__(self, db: Database, *, die_after: int | None = None, delay: float = 0.0) -> None:
        self.db = db
        self.target = InAppPublisher(Inbox(db), [Consumer("test", frozenset(), _consume)])
        self.die_after = die_after
        self.delay = delay
        self.count = 0

    def publish(self, event: OutboxEvent) -> None:
        with self.db.statement() as conn:
            conn.execute(
                text("INSERT INTO t_deliveries VALUES (:e, :p)"),
                {"e": event.event_id, "p": os.getpid()},
            )
        self.target.publish(event)
        self.count += 1
        if self.delay:
            time.sleep(self.delay)
        if self.die_after is not None and self.count >= self.die_after:
            os.kill(os.getpid(), signal.SIGKILL)


def worker_main() -> None:
    """``python -c 'from tests.test_outbox import worker_main; worker_main()' SPEC``."""
    spec = json.loads(sys.argv[1])
    db = Database.from_url(spec["url"])
    publisher = OutboxPublisher(
        db,
        RecordingPublisher(db, die_after=spec.get("die_after"), delay=spec.get("delay", 0.0)),
        batch_size=spec.get("batch_size", 20),
        claim_seconds=spec.get("claim_seconds", 30.0),
    )
    idle = 0
    while idle < 3:
        stats = publisher.publish_batch()
        idle = idle + 1 if stats.claimed == 0 else 0
        if stats.claimed == 0:
            time.sleep(0.05)


def spawn(url: str, **spec: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from tests.test_outbox import worker_main; worker_main()",
            json.dumps({"url": url, **spec}),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stderr=subprocess.PIPE,
    )


def consumed(db: Database) -> list[Any]:
    with db.statement() as conn:
        return conn.execute(
            text(
                "SELECT event_id, aggregate_id, seq, outbox_id FROM t_consumed"
                " ORDER BY aggregate_id, seq"
            )
        ).all()


def deliveries(db: Database) -> list[str]:
    with db.statement() as conn:
        return [r.event_id for r in conn.execute(text("SELECT event_id FROM t_deliveries"))]


def assert_exactly_once_in_order(db: Database, n: int) -> None:
    rows = consumed(db)
    ids = [r.event_id for r in rows]
    assert len(ids) == n and len(set(ids)) == n, "an event was lost or applied twice"
    per_aggregate: dict[str, list[Any]] = defaultdict(list)
    for r in rows:
        per_aggregate[r.aggregate_id].append(r)
    for aggregate, items in per_aggregate.items():
        assert [r.seq for r in items] == list(range(1, len(items) + 1)), aggregate
        assert [r.outbox_id for r in items] == sorted(r.outbox_id for r in items), (
            f"events of {aggregate} applied out of order"
        )
    with db.statement() as conn:
        assert (
            conn.execute(text("SELECT COUNT(*) FROM outbox WHERE published_at IS NULL")).scalar()
            == 0
        )


def test_publisher_killed_mid_batch_loses_nothing_and_the_inbox_drops_duplicates(
    db: Database, db_url: str
) -> None:
    """Catches: marking published before publishing (a lost event after the kill), claims that
    never expire (events stuck forever), an inbox that lets the redelivery apply twice."""
    make_tables(db)
    write_events(db, 60)
    child = spawn(db_url, die_after=25, batch_size=20, claim_seconds=30.0)
    assert child.wait(timeout=120) == -signal.SIGKILL, (
        child.stderr.read().decode()[-2000:] if child.stderr else ""
    )
    assert len(consumed(db)) == 25
    # The dead publisher still holds claims: nobody may take them before they expire...
    waiting = OutboxPublisher(db, RecordingPublisher(db), batch_size=100)
    assert waiting.publish_batch().claimed == 0
    # ... then a publisher whose clock is past the claim expiry takes over and finishes.
    later = OutboxPublisher(
        db, RecordingPublisher(db), batch_size=100, clock=lambda: time.time() + 31
    )
    later.publish_pending(max_batches=10)
    assert_exactly_once_in_order(db, 60)
    delivered = deliveries(db)
    assert len(delivered) > 60, "the killed publisher's last event must have been redelivered"
    assert delivered.count("ev-00024") == 2
    assert len(delivered) == 61
    assert unpublished_older_than(db, 0) == []


def test_concurrent_publishers_in_processes_and_threads_keep_order_per_aggregate(
    db: Database, db_url: str
) -> None:
    """Catches: two publishers interleaving one aggregate's events (order broken), a claim that
    lets two publishers deliver the same row at once, lost rows under contention."""
    make_tables(db)
    write_events(db, 160)
    children = [spawn(db_url, batch_size=7, delay=0.01) for _ in range(3)]
    errors: list[BaseException] = []

    def thread_worker() -> None:
        try:
            publisher = OutboxPublisher(db, RecordingPublisher(db, delay=0.01), batch_size=5)
            idle = 0
            while idle < 3:
                stats = publisher.publish_batch()
                idle = idle + 1 if stats.claimed == 0 else 0
                if stats.claimed == 0:
                    time.sleep(0.05)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=thread_worker) for _ in range(4)]
    deadline = time.monotonic() + 60
    while not deliveries(db) and time.monotonic() < deadline:
        time.sleep(0.05)  # a child is publishing: now the threads join the race
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    for child in children:
        assert child.wait(timeout=180) == 0, (
            child.stderr.read().decode()[-2000:] if child.stderr else ""
        )
    assert not errors, errors
    assert_exactly_once_in_order(db, 160)
    with db.statement() as conn:
        pids = conn.execute(text("SELECT COUNT(DISTINCT pid) FROM t_consumed")).scalar()
    assert pids >= 2  # the work really was shared between processes


def test_a_failing_target_defers_the_aggregate_and_keeps_order(db: Database) -> None:
    """Catches: a publisher that skips a failed event and publishes its successors (order
    broken), or one that marks a failed event published (lost)."""
    make_tables(db)
    write_events(db, 16)  # o0: ev-0, ev-8; o1: ev-1, ev-9; ...
    inner = RecordingPublisher(db)
    failures = {"ev-00000": 1}

    class Flaky:
        def publish(self, event: OutboxEvent) -> None:
            if failures.get(event.event_id):
                failures[event.event_id] -= 1
                raise ConnectionError("broker down")
            inner.publish(event)

    publisher = OutboxPublisher(db, Flaky(), batch_size=100)
    first = publisher.publish_batch()
    assert (first.failed, first.deferred, first.published) == (1, 1, 14)
    assert {r.event_id for r in consumed(db)}.isdisjoint({"ev-00000", "ev-00008"})
    publisher.publish_pending()
    assert_exactly_once_in_order(db, 16)


def test_order_fulfilled_invalidates_the_report_cache_once_through_the_inbox(
    db: Database, redis_url: str, namespace: str
) -> None:
    """Catches: cache invalidation outside the outbox path (stale reports after commit), or
    every redelivery invalidating again (the inbox must drop it)."""
    from resources.cache import NO_VALUE, StampedeCache

    cache = StampedeCache.from_url(redis_url, namespace=namespace)
    loads = []
    cache.get_or_load("report:order:o-9", lambda: loads.append(1) or {"v": len(loads)}, ttl=300)
    with db.transaction() as conn:
        write_event(
            conn,
            aggregate_type="order",
            aggregate_id="o-9",
            event_type="order_fulfilled",
            payload={"order_id": "o-9"},
            event_id="fulfil:o-9:fulfilled",
        )
    inbox = Inbox(db)
    target = InAppPublisher(inbox, [cache_invalidation_consumer(cache)])
    publisher = OutboxPublisher(db, target)
    assert publisher.publish_batch().published == 1
    assert inbox.seen("cache-invalidation", "fulfil:o-9:fulfilled")
    assert cache.get("report:order:o-9") is NO_VALUE and len(loads) == 1
    value = cache.get_or_load(
        "report:order:o-9", lambda: loads.append(1) or {"v": len(loads)}, ttl=300
    )
    assert value == {"v": 2} and len(loads) == 2  # invalidated: the next read rebuilt it
    # A redelivery (the publisher died before marking) is dropped by the inbox.
    event = OutboxEvent(1, "fulfil:o-9:fulfilled", "order", "o-9", "order_fulfilled", {}, 0.0, 1)
    target.publish(event)
    assert target.dropped == 1
    assert cache.get_or_load("report:order:o-9", lambda: {"v": 99}, ttl=300) == {"v": 2}
    cache.close()


@pytest.fixture
def pg_db(postgres_url: str) -> Iterator[Database]:
    database = Database.from_url(postgres_url)
    upgrade(database)
    try:
        yield database
    finally:
        database.dispose()


@pytest.mark.postgres
def test_a_claim_never_takes_the_next_event_while_an_extension_of_the_earlier_is_in_flight(
    pg_db: Database,
) -> None:
    """Catches the Postgres ordering race: A's claim on e1, e2 has expired and A extends e1
    (``_still_mine``) to publish it; a claim by B at that moment read e1 as expired (its
    snapshot predates the extension; SKIP LOCKED skipped e1's row) and took e2, so B could
    publish e2 before A published e1. The test holds A's extension in flight with a row lock of
    its own on e1, then lets B claim and A finish: B must not hold e2 while A holds e1."""
    # Postgres only: on SQLite every writer is serialised, so the race cannot happen there.
    db = pg_db
    make_tables(db)
    with db.transaction() as conn:  # one aggregate: e1, e2
        for i in range(2):
            write_event(
                conn,
                aggregate_type="order",
                aggregate_id="o-race",
                event_type="order.step",
                payload={"i": i},
                event_id=f"race-{i}",
            )
    now = time.time()
    a = OutboxPublisher(db, RecordingPublisher(db), claim_seconds=30, clock=lambda: now - 60)
    b = OutboxPublisher(db, RecordingPublisher(db), claim_seconds=30, clock=lambda: now)
    e1, e2 = a.claim()  # claimed at now-60: expired by now
    results: dict[str, Any] = {}
    a.clock = lambda: now  # A extends e1 at now
    with db.engine.connect() as hold:
        hold_tx = hold.begin()
        hold.execute(text("SELECT id FROM outbox WHERE id = :id FOR UPDATE"), {"id": e1.id})
        me = int(hold.execute(text("SELECT pg_backend_pid()")).scalar_one())
        a_thread = threading.Thread(target=lambda: results.update(a=a._still_mine(e1)))
        a_thread.start()
        a_pid = _wait_for_blocked_by(db, me)  # A's extension is in flight, waiting on e1
        b_thread = threading.Thread(target=lambda: results.update(b=b.claim()))
        b_thread.start()
        deadline = time.monotonic() + 10
        while b_thread.is_alive() and not _blocked_by(db, a_pid):  # B claimed, or waits for A
            assert time.monotonic() < deadline, "B neither claimed nor waited"
            time.sleep(0.01)
        hold_tx.commit()
    a_thread.join(10)
    b_thread.join(10)
    assert results["a"] is True  # A still owns e1 and goes on to publish it
    assert e2.id not in [e.id for e in results["b"]], "B took e2 while A publishes e1"


def _blocked_by(db: Database, pid: int) -> list[int]:
    with db.statement() as conn:
        return [
            int(r[0])
            for r in conn.execute(
                text("SELECT pid FROM pg_stat_activity WHERE :p = ANY(pg_blocking_pids(pid))"),
                {"p": pid},
            )
        ]


def _wait_for_blocked_by(db: Database, pid: int) -> int:
    deadline = time.monotonic() + 10
    while not (blocked := _blocked_by(db, pid)):
        assert time.monotonic() < deadline, "nothing waited"
        time.sleep(0.01)
    return blocked[0]
