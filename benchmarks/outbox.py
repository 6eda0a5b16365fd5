"""What the outbox publisher's claims cost over a naive relay, on SQLite and Postgres.

The naive relay is the floor every outbox needs: select unpublished rows in id order, publish
each, mark it published. It is only correct with one relay and no crash between publish and
mark. The guarded publisher adds claims (a claim transaction per batch, serialised on Postgres
by an advisory lock, ``FOR UPDATE SKIP LOCKED``), a per-event claim check and per-aggregate
ordering; it may run in several workers at once. Both publish into the same target: the in-app
consumer through the inbox (one transaction per event). Reported: events per second, and the
ratio to the naive relay measured in the same run.

Run: ``python -m benchmarks.outbox [--quick]``.
"""

from __future__ import annotations

import tempfile
import threading
import time
import uuid
from typing import Any

from sqlalchemy import text

from benchmarks.backends import BackendUnavailable, postgres_schema
from benchmarks.suite import module_main
from resources.outbox import write_event
from resources.outbox.publisher import Consumer, InAppPublisher, Inbox, OutboxEvent, OutboxPublisher
from resources.storage.db import Database
from resources.storage.migrations import upgrade

TARGET_RATIO = 0.5
AGGREGATES = 50


def _target(db: Database) -> InAppPublisher:
    return InAppPublisher(Inbox(db), [Consumer("bench", frozenset(), lambda _c, _e: None)])


def _fill(db: Database, n: int) -> None:
    with db.transaction() as conn:
        for i in range(n):
            write_event(
                conn,
                aggregate_type="order",
                aggregate_id=f"o{i % AGGREGATES}",
                event_type="bench",
                payload={"i": i},
                event_id=uuid.uuid4().hex,
            )


def _reset(db: Database) -> None:
    with db.transaction() as conn:
        conn.execute(text("DELETE FROM outbox"))
        conn.execute(text("DELETE FROM inbox"))


def _naive(db: Database) -> int:
    target, done = _target(db), 0
    while True:
        with db.statement() as conn:
            rows = conn.execute(
                text(
                    "SELECT id, event_id, aggregate_type, aggregate_id, event_type, payload,"
                    " created_at, attempts, traceparent FROM outbox WHERE published_at IS NULL"
                    " ORDER BY id"
                    " LIMIT 100"
                )
            ).all()
        if not rows:
            return done
        for row in rows:
            event = OutboxEvent.from_row(row)
            target.publish(event)
            with db.statement() as conn:
                conn.execute(
                    text("UPDATE outbox SET published_at = :t WHERE id = :id"),
                    {"t": time.time(), "id": event.id},
                )
            done += 1


def _guarded(db: Database, workers: int) -> int:
    counts: list[int] = []

    def work() -> None:
        publisher = OutboxPublisher(db, _target(db), batch_size=100)
        done, idle = 0, 0
        while idle < 2:
            stats = publisher.publish_batch()
            done += stats.published
            idle = idle + 1 if stats.claimed == 0 else 0
            if stats.claimed == 0:
                time.sleep(0.01)
        counts.append(done)

    threads = [threading.Thread(target=work) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts)


def _measure(db: Database, n: int, fn: Any) -> float:
    _reset(db)
    _fill(db, n)
    started = time.perf_counter()
    done = fn()
    elapsed = time.perf_counter() - started
    assert done == n, f"published {done} of {n}"
    return n / elapsed


def _backend(url: str, n: int, rounds: int) -> dict[str, Any]:
    db = Database.from_url(url)
    upgrade(db)
    results: dict[str, list[float]] = {"naive": [], "guarded_1": [], "guarded_4": []}
    for _ in range(rounds):  # alternate, keep the median: like with like on a noisy machine
        results["naive"].append(_measure(db, n, lambda: _naive(db)))
        results["guarded_1"].append(_measure(db, n, lambda: _guarded(db, 1)))
        results["guarded_4"].append(_measure(db, n, lambda: _guarded(db, 4)))
    db.dispose()
    med = {k: sorted(v)[len(v) // 2] for k, v in results.items()}
    return {
        "events": n,
        "events_per_second": {k: round(v, 1) for k, v in med.items()},
        "ratio_guarded_1": round(med["guarded_1"] / med["naive"], 3),
        "ratio_guarded_4": round(med["guarded_4"] / med["naive"], 3),
    }


def run(quick: bool = False) -> dict[str, Any]:
    n, rounds = (400, 1) if quick else (2000, 3)
    out: dict[str, Any] = {"backends": {}, "summary": []}
    with tempfile.TemporaryDirectory() as tmp:
        out["backends"]["sqlite"] = _backend(f"sqlite:///{tmp}/outbox.db", n, rounds)
    try:
        with postgres_schema() as url:
            out["backends"]["postgres"] = _backend(url, n, rounds)
    except BackendUnavailable as exc:
        out["skipped"] = {"postgres": str(exc)}
    except Exception as exc:  # noqa: BLE001 - report, do not hide the SQLite numbers
        out["backends"]["postgres"] = {"error": f"{type(exc).__name__}: {exc}"}
    for name, res in out["backends"].items():
        if "error" in res:
            continue
        for workers in (1, 4):
            ratio = res[f"ratio_guarded_{workers}"]
            out["summary"].append(
                {
                    "metric": f"{name} publisher x{workers} events/s",
                    "value": res["events_per_second"][f"guarded_{workers}"],
                    "unit": "events/s",
                    "baseline": res["events_per_second"]["naive"],
                    "ratio": ratio,
                    "target": TARGET_RATIO if workers == 1 else None,
                    "ok": ratio >= TARGET_RATIO if workers == 1 else None,
                }
            )
    return out


def render(result: dict[str, Any]) -> None:
    print(
        f"{'backend':<10} {'events':>6} {'naive/s':>9} {'guarded x1/s':>13} {'ratio':>6} "
        f"{'guarded x4/s':>13} {'ratio':>6}"
    )
    for name, res in result["backends"].items():
        if "error" in res:
            print(f"{name:<10} error: {res['error']}")
            continue
        eps = res["events_per_second"]
        print(
            f"{name:<10} {res['events']:>6} {eps['naive']:>9} {eps['guarded_1']:>13} "
            f"{res['ratio_guarded_1']:>6} {eps['guarded_4']:>13} {res['ratio_guarded_4']:>6}"
        )
    print(f"target: guarded x1 >= {TARGET_RATIO} of the naive relay")


def main() -> None:
    module_main(__doc__, run, render)


if __name__ == "__main__":
    main()
