"""The intake table (resources/requests.py) on SQLite and Postgres, with threads and processes."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import text

from engine.requests import TRANSITIONS, RequestStatus, RequestStore
from resources.errors import IdempotencyConflict
from resources.storage.db import Database

N_KEYS = 60


def _enqueue_all(url: str, worker: int) -> list[tuple[str, int, bool]]:
    """Module-level worker: every process enqueues the same keys, in a shuffled order."""
    import random

    store = RequestStore(Database.from_url(url))
    keys = [f"k{i}" for i in range(N_KEYS)]
    random.Random(worker).shuffle(keys)
    out = []
    for key in keys:
        result = store.enqueue("send_email", key, {"key": key}, queue="light")
        out.append((key, result.id, result.created))
    store.db.dispose()
    return out


def _claim_all(url: str, _worker: int) -> list[int]:
    store = RequestStore(Database.from_url(url))
    got: list[int] = []
    while True:
        page = store.claim_for_launch(7)
        if not page:
            break
        got.extend(r.id for r in page)
    store.db.dispose()
    return got


def test_same_key_same_payload_is_a_duplicate_other_payload_a_conflict(db: Database) -> None:
    """Catches: a replayed enqueue creating a second request, or silently taking a new payload."""
    store = RequestStore(db)
    first = store.enqueue("send_email", "email:a", {"x": 1, "y": 2}, queue="light")
    again = store.enqueue("send_email", "email:a", {"y": 2, "x": 1}, queue="light")
    assert first.created and not again.created
    assert again.id == first.id and again.status is RequestStatus.PENDING
    with pytest.raises(IdempotencyConflict) as info:
        store.enqueue("send_email", "email:a", {"x": 9}, queue="light")
    assert info.value.key == "email:a"
    assert store.counts()["pending"] == 1


def test_enqueue_in_callers_transaction_rolls_back_with_it(db: Database) -> None:
    """Catches: an outbox-style enqueue that survives the caller's rollback (a phantom job)."""
    store = RequestStore(db)
    with pytest.raises(RuntimeError), db.transaction() as conn:
        store.enqueue("send_email", "email:rolled", {"a": 1}, queue="light", conn=conn)
        raise RuntimeError("the business change failed")
    assert store.get_by_key("email:rolled") is None
    with db.transaction() as conn:
        made = store.enqueue("send_email", "email:kept", {"a": 1}, queue="light", conn=conn)
    assert store.get(made.id) is not None


def test_status_moves_only_along_the_transitions(db: Database) -> None:
    """Catches: a completed request reopened, or a pending one skipping to an unknown state."""
    store = RequestStore(db)
    rid = store.enqueue("send_email", "k", {}, queue="light").id
    assert [r.id for r in store.claim_for_launch(10)] == [rid]
    assert store.claim_for_launch(10) == []  # launched, not yet stale
    assert store.mark_running(rid, run_id="run-1")
    assert store.mark_failed(rid, "boom", run_id="run-1")
    assert store.get(rid).last_error == "boom"  # type: ignore[union-attr]
    assert store.requeue(rid)
    assert store.mark_running(rid, run_id="run-2")
    assert store.mark_completed(rid, run_id="run-2")
    assert not store.mark_running(rid) and not store.mark_failed(rid, "x")
    assert not store.requeue(rid)
    final = store.get(rid)
    assert final is not None and final.status is RequestStatus.COMPLETED
    assert final.attempts == 2 and final.run_id == "run-2" and final.last_error is None
    assert TRANSITIONS[RequestStatus.COMPLETED] == frozenset()


def test_stale_launched_requests_are_claimed_again(db: Database) -> None:
    """Catches: a sensor tick that claimed and then died leaving requests launched forever."""
    now = [1000.0]
    store = RequestStore(db, clock=lambda: now[0])
    ids = [store.enqueue("send_email", f"k{i}", {}, queue="light").id for i in range(3)]
    assert [r.id for r in store.claim_for_launch(10, relaunch_after=60)] == ids
    now[0] += 59
    assert store.claim_for_launch(10, relaunch_after=60) == []
    store.mark_running(ids[0])
    now[0] += 2
    assert [r.id for r in store.claim_for_launch(10, relaunch_after=60)] == ids[1:]


def test_rejections_keep_bad_input(db: Database) -> None:
    store = RequestStore(db)
    store.reject("send_email", {"user_id": None}, field="user_id", error="missing")
    store.reject("send_email", "{not json", field="payload", error="not JSON")
    rows = store.rejections("send_email")
    # a masked excerpt (its shape, no value) plus the size and hash of what was sent
    assert [(r["field"], r["payload"]) for r in rows] == [
        ("user_id", '{"user_id":null}'),
        ("payload", "<text 9 characters>"),
    ]
    assert all(r["payload_size"] and r["payload_sha256"] for r in rows)


def test_concurrent_enqueue_threads_and_processes_one_row_per_key(
    db: Database, db_url: str
) -> None:
    """Catches: a check-then-insert enqueue that lets two producers create the same request."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(3) as pool:
        procs = pool.starmap_async(_enqueue_all, [(db_url, w) for w in range(3)])
        with ThreadPoolExecutor(6) as threads:
            thread_results = list(threads.map(lambda w: _enqueue_all(db_url, w), range(10, 16)))
        results = procs.get(timeout=240) + thread_results
    created = [key for res in results for key, _id, made in res if made]
    assert sorted(created) == sorted(f"k{i}" for i in range(N_KEYS))  # each created exactly once
    ids_by_key: dict[str, set[int]] = {}
    for res in results:
        for key, rid, _ in res:
            ids_by_key.setdefault(key, set()).add(rid)
    assert all(len(ids) == 1 for ids in ids_by_key.values())
    with db.statement() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM job_requests")).scalar_one() == N_KEYS


def test_concurrent_claims_never_hand_out_a_request_twice(db: Database, db_url: str) -> None:
    """Catches: two sensor ticks (or daemons) launching the same request in one window."""
    store = RequestStore(db)
    for i in range(150):
        store.enqueue("send_email", f"c{i}", {"i": i}, queue="light")
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(3) as pool:
        procs = pool.starmap_async(_claim_all, [(db_url, w) for w in range(3)])
        with ThreadPoolExecutor(4) as threads:
            thread_results = list(threads.map(lambda w: _claim_all(db_url, w), range(4)))
        results = procs.get(timeout=240) + thread_results
    claimed = [rid for res in results for rid in res]
    assert len(claimed) == 150 and len(set(claimed)) == 150
    assert store.counts()["launched"] == 150


def test_claim_for_launch_never_exceeds_its_limit(db: Database) -> None:
    """Regression: on Postgres an ``IN (SELECT ... LIMIT ... SKIP LOCKED)`` subquery may be
    evaluated per row and claim every pending request; a sensor tick must stay bounded."""
    store = RequestStore(db)
    for i in range(6):
        store.enqueue("send_email", f"k{i}", {"i": i}, queue="light")
    first = store.claim_for_launch(2, job_types=["send_email"])
    assert [r.key for r in first] == ["k0", "k1"]
    assert len(store.claim_for_launch(1)) == 1
    assert store.counts().get("pending") == 3
