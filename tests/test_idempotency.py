"""The idempotency store, one behaviour per test, on SQLite and Postgres (the ``db`` fixture).

Time is an injected clock wherever expiry matters, so no test sleeps to make a lease run out.
The race across processes is in ``test_idempotency_race.py``; the model-based test in
``test_idempotency_stateful.py``.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from resources.errors import PermanentJobError, SekaliError, TransientJobError
from resources.idempotency import (
    AlreadyInProgress,
    Claim,
    Completed,
    IdempotencyConflict,
    IdempotencyStore,
    LeaseLost,
    Status,
    StoredFailure,
)
from resources.storage.db import Database
from resources.storage.migrations import SchemaBehind, upgrade
from tests.idempotency_workers import (
    PHASE_EFFECTS_DDL,
    PHASES,
    claim_from_json,
    phase_victim,
    run_phases,
    wait_for,
)


class FakeClock:
    """A clock the test moves by hand (the store only reads it)."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(db: Database, clock: FakeClock) -> IdempotencyStore:
    return IdempotencyStore(db, lease_seconds=10.0, retention_seconds=100.0, clock=clock)


def claim_of(outcome: Claim | Completed) -> Claim:
    assert isinstance(outcome, Claim), f"expected a claim, got {outcome!r}"
    return outcome


def test_public_api_from_url_run_once(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The documented entry point creates the schema (on Postgres only when the operator lets
    processes migrate: ``SEKALI_AUTO_MIGRATE=1``; else it refuses, naming the command) and runs
    ``fn`` once per key. Catches: from_url not applying sql/, a production process changing the
    schema unasked, or run_once calling fn for a completed key."""
    monkeypatch.delenv("SEKALI_AUTO_MIGRATE", raising=False)
    if db_url.startswith("postgresql"):
        with pytest.raises(SchemaBehind, match="sekali db upgrade"):
            IdempotencyStore.from_url(db_url, lease_seconds=5.0)
        monkeypatch.setenv("SEKALI_AUTO_MIGRATE", "1")
    store = IdempotencyStore.from_url(db_url, lease_seconds=5.0)
    calls: list[int] = []

    def fn() -> dict[str, int]:
        calls.append(1)
        return {"n": len(calls)}

    assert store.run_once("k", fn, payload={"a": 1}) == {"n": 1}
    assert store.run_once("k", fn, payload={"a": 1}) == {"n": 1}
    assert calls == [1]
    assert issubclass(IdempotencyConflict, SekaliError)
    assert issubclass(AlreadyInProgress, SekaliError) and issubclass(LeaseLost, SekaliError)
    store.db.dispose()


def test_begin_outcomes_and_in_progress(store: IdempotencyStore, clock: FakeClock) -> None:
    """New claim, AlreadyInProgress under a live lease (with retry_after), replay after complete.
    Catches: two live claims on one key; a replay that re-claims instead of returning the result."""
    first = claim_of(store.begin("k", payload={"x": 1}))
    assert (first.fence, first.attempt, first.takeover) == (1, 1, False)
    clock.advance(4)
    with pytest.raises(AlreadyInProgress) as info:
        store.begin("k", payload={"x": 1})
    assert info.value.retry_after == pytest.approx(6.0)
    assert info.value.key == "k" and not info.value.permanent
    clock.advance(5.5)  # t=9.5: half a second before expiry, still live
    with pytest.raises(AlreadyInProgress):
        store.begin("k", payload={"x": 1})
    clock.advance(-5.5)
    store.complete(first, {"ok": True})
    again = store.begin("k", payload={"x": 1})
    assert isinstance(again, Completed) and again.result == {"ok": True} and again.fence == 1
    record = store.get("k")
    assert record is not None and record.status is Status.COMPLETED
    assert record.owner_token == first.owner_token and record.lease_expires_at is None


def test_payload_conflict_in_progress_and_completed(store: IdempotencyStore) -> None:
    """Same key, other payload: IdempotencyConflict on every path, completed keys included.
    Catches: the hash checked only on the claim path, so a completed key silently replays."""
    claim = claim_of(store.begin("k", payload={"amount": 10}))
    with pytest.raises(IdempotencyConflict) as info:
        store.begin("k", payload={"amount": 11})
    assert info.value.permanent and info.value.key == "k"
    assert info.value.stored_hash != info.value.given_hash
    store.complete(claim, "done")
    with pytest.raises(IdempotencyConflict):
        store.begin("k", payload={"amount": 11})
    with pytest.raises(IdempotencyConflict):
        store.begin("k")  # no payload is a payload too
    # key order does not matter: the hash is of canonical JSON
    store2 = claim_of(store.begin("k2", payload={"a": 1, "b": 2}))
    store.complete(store2, 2)
    assert isinstance(store.begin("k2", payload={"b": 2, "a": 1}), Completed)
    record = store.get("k")
    assert record is not None and record.status is Status.COMPLETED and record.result == "done"


def test_payload_conflict_on_failed_and_expired(store: IdempotencyStore, clock: FakeClock) -> None:
    """A differing payload never takes over an expired lease nor a retryable key."""
    claim = claim_of(store.begin("k", payload=1))
    clock.advance(11)
    with pytest.raises(IdempotencyConflict):
        store.begin("k", payload=2)
    store.fail(claim, "boom", "transient")
    with pytest.raises(IdempotencyConflict):
        store.begin("k", payload=2)
    assert claim_of(store.begin("k", payload=1)).attempt == 2


def test_permanent_failure_not_rerun_until_reset(store: IdempotencyStore) -> None:
    """A permanent failure is stored: duplicates get StoredFailure and fn is not called again;
    after an operator's reset the key runs again. Catches: permanent errors being retried."""
    calls: list[str] = []

    def bad() -> None:
        calls.append("bad")
        raise PermanentJobError("card declined")

    with pytest.raises(PermanentJobError):
        store.run_once("k", bad, payload="p")
    for _ in range(3):
        with pytest.raises(StoredFailure) as info:
            store.run_once("k", bad, payload="p")
    assert info.value.error_class == "PermanentJobError"
    assert info.value.error_message == "card declined"
    assert calls == ["bad"]
    record = store.get("k")
    assert record is not None and record.status is Status.FAILED

    assert store.reset("k") is True
    assert store.reset("k") is False  # only a failed key resets
    assert store.run_once("k", lambda: "fixed", payload="p") == "fixed"
    record = store.get("k")
    assert record is not None and record.status is Status.COMPLETED and record.attempt == 2
    assert store.reset("k") is False  # a completed key is not reset


def test_transient_failure_is_rerun(store: IdempotencyStore) -> None:
    """A transient failure releases the key: the next caller runs fn again, with a larger fence.
    Catches: a transient error stored as final, or a retry that keeps the old fence."""
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise TransientJobError("timeout") if len(calls) == 1 else ConnectionError("reset")
        return "ok"

    with pytest.raises(TransientJobError):
        store.run_once("k", flaky)
    record = store.get("k")
    assert record is not None and record.status is Status.RETRYABLE
    with pytest.raises(ConnectionError):  # not a SekaliError: transient by default
        store.run_once("k", flaky)
    assert store.run_once("k", flaky) == "ok"
    assert store.run_once("k", flaky) == "ok"
    assert len(calls) == 3
    record = store.get("k")
    assert record is not None and (record.attempt, record.fence) == (3, 3)


def test_fail_explicit_kind_overrides_error(store: IdempotencyStore) -> None:
    claim = claim_of(store.begin("k"))
    store.fail(claim, TransientJobError("looks transient"), "permanent")
    with pytest.raises(StoredFailure):
        store.begin("k")
    with pytest.raises(ValueError):
        store.fail(claim, "x", "sometimes")


def test_heartbeat_extends_lease(store: IdempotencyStore, clock: FakeClock) -> None:
    """Without the heartbeat the key would be taken over at t=12; with it, not until t=18.
    Catches: heartbeat not moving lease_expires_at."""
    claim = claim_of(store.begin("k"))
    clock.advance(8)
    expires = store.heartbeat(claim)
    assert expires == pytest.approx(clock.now + 10)
    clock.advance(4)  # t=12: past the first lease, inside the extended one
    with pytest.raises(AlreadyInProgress):
        store.begin("k")
    record = store.get("k")
    assert record is not None and record.lease_expires_at == pytest.approx(expires)
    clock.advance(6.5)  # t=18.5: the extended lease is over
    taker = claim_of(store.begin("k"))
    assert taker.takeover and taker.fence == 2 and taker.attempt == 2


def test_a_batch_members_lease_ends_by_its_bound_however_late_the_beat(
    store: IdempotencyStore, clock: FakeClock
) -> None:
    """A batch member's bound starts with its handler; no beat may carry its lease past that
    start + the bound + a lease, even a beat checked just before the bound and written after
    it (a loaded machine). The store's clock is moved past the bound while the keeper's own
    clock (monotonic) still says the bound runs: the beat is written capped, and its neighbour
    without a bound gets the full lease. Catches a batch renewal without a cap."""
    bounded, free = (claim_of(store.begin(k)) for k in ("bounded", "free"))
    with store.keep_alive_many([bounded, free], interval=3600) as keeper:
        started = clock.now
        keeper.bound("bounded", 5.0)
        clock.advance(7.0)  # the write lands past the bound, its check did not
        keeper.confirm("free")  # no beat: fresh
        keeper.confirmed_at = float("-inf")
        keeper.confirm("free")
        capped, full = store.get("bounded"), store.get("free")
        assert capped is not None and full is not None
        assert capped.lease_expires_at == pytest.approx(started + 5.0 + 10.0)
        assert full.lease_expires_at == pytest.approx(clock.now + 10.0)
        keeper.met("bounded")  # returned in time: renewed as any other from now on
        keeper.confirmed_at = float("-inf")
        keeper.confirm("free")
        renewed = store.get("bounded")
        assert renewed is not None and renewed.lease_expires_at == pytest.approx(clock.now + 10)


def test_stale_owner_writes_rejected(store: IdempotencyStore, clock: FakeClock) -> None:
    """After a takeover, every write by the old owner raises LeaseLost and changes nothing.
    Catches: owner writes not conditional on the owner token."""
    old = claim_of(store.begin("k"))
    store.checkpoint(old, "step1", {"n": 1})
    clock.advance(10)  # lease_expires_at <= now: expired
    new = claim_of(store.begin("k"))
    assert new.takeover and new.fence == old.fence + 1
    assert (new.recovery_point, new.recovery_data) == ("step1", {"n": 1})
    before = store.get("k")
    for write in (
        lambda: store.checkpoint(old, "step2", {"n": 2}),
        lambda: store.heartbeat(old),
        lambda: store.complete(old, "stale"),
        lambda: store.fail(old, "stale", "permanent"),
        lambda: store.fail(old, "stale", "transient"),
    ):
        with pytest.raises(LeaseLost) as info:
            write()
        assert info.value.owner_token == old.owner_token
    assert store.get("k") == before
    store.complete(new, "fresh")
    with pytest.raises(LeaseLost):
        store.complete(old, "stale")
    record = store.get("k")
    assert record is not None and record.result == "fresh"


def test_stale_checkpoint_in_transaction_rolls_back_effect(
    store: IdempotencyStore, clock: FakeClock
) -> None:
    """A stale owner's effect and checkpoint share one transaction: LeaseLost rolls back both."""
    with store.db.transaction() as conn:
        conn.exec_driver_sql(PHASE_EFFECTS_DDL)
    old = claim_of(store.begin("k"))
    clock.advance(11)
    claim_of(store.begin("k"))
    with pytest.raises(LeaseLost), store.db.transaction() as conn:
        conn.execute(text("INSERT INTO phase_effects VALUES ('k', 'charge', :f)"), {"f": old.fence})
        store.checkpoint(old, "charge", None, conn=conn)
    with store.db.statement() as conn:
        assert conn.execute(text("SELECT count(*) FROM phase_effects")).scalar_one() == 0


def test_purge_only_completed_past_retention(store: IdempotencyStore, clock: FakeClock) -> None:
    """purge never deletes in-progress (live or expired), failed or retryable records.
    Catches: a purge whose WHERE forgets the status and deletes a live claim."""
    done = claim_of(store.begin("done"))
    store.complete(done, 1)
    claim_of(store.begin("live"))
    expired = claim_of(store.begin("expired"))
    failed = claim_of(store.begin("failed"))
    store.fail(failed, "no", "permanent")
    retry = claim_of(store.begin("retry"))
    store.fail(retry, "later", "transient")
    assert expired.key == "expired"

    assert store.purge() == 0  # nothing past retention yet
    clock.advance(1000)  # past every lease and the 100 s retention
    assert store.purge(older_than=0) == 1
    assert store.get("done") is None
    for key in ("live", "expired", "failed", "retry"):
        assert store.get(key) is not None, key
    assert store.purge(older_than=0) == 0
    # a purged key is a new intent again
    assert claim_of(store.begin("done")).fence == 1


def test_purge_by_retention_and_older_than(store: IdempotencyStore, clock: FakeClock) -> None:
    a = claim_of(store.begin("a"))
    store.complete(a, 1)
    clock.advance(50)
    b = claim_of(store.begin("b"))
    store.complete(b, 2)
    clock.advance(60)  # a past retention (100 s), b not
    assert store.purge() == 1
    assert store.get("a") is None and store.get("b") is not None
    assert store.purge(older_than=70) == 0
    assert store.purge(older_than=30) == 1


def test_keep_alive_holds_a_short_lease_across_a_long_fn(db: Database) -> None:
    """A 2 s lease kept alive across a 4.5 s fn: a contender never takes the key over.
    Catches: a keeper that does not heartbeat (the contender would claim at ~2 s)."""
    store = IdempotencyStore(db, lease_seconds=2.0)
    contender = IdempotencyStore(db, lease_seconds=2.0)
    stolen: list[Any] = []
    busy = 0
    running = threading.Event()
    done = threading.Event()

    def contend() -> None:
        nonlocal busy
        running.wait(30)
        while not done.is_set():
            try:
                stolen.append(contender.begin("k", payload="p"))
            except AlreadyInProgress:
                busy += 1
            time.sleep(0.1)

    beats: list[int] = []

    def long_fn() -> str:
        running.set()
        time.sleep(4.5)
        return "done"

    t = threading.Thread(target=contend)
    t.start()
    claim = claim_of(store.begin("k", payload="p"))
    with store.keep_alive(claim) as keeper:
        result = long_fn()
        keeper.check()
        beats.append(keeper.beats)
    store.complete(claim, result)
    done.set()
    t.join(30)
    assert stolen == [] or all(isinstance(s, Completed) for s in stolen)
    assert busy >= 10
    assert beats[0] >= 3
    record = store.get("k")
    assert record is not None and record.status is Status.COMPLETED and record.fence == 1

    # run_once uses the same keeper: the short lease survives a longer fn there too
    def slow() -> str:
        time.sleep(3.0)
        return "x"

    assert store.run_once("k2", slow, payload=None) == "x"
    record = store.get("k2")
    assert record is not None and record.fence == 1 and record.result == "x"


def test_keep_alive_reports_lease_lost(store: IdempotencyStore, clock: FakeClock) -> None:
    """Once the lease is taken over, the keeper's next beat fails and check() raises."""
    claim = claim_of(store.begin("k"))
    clock.advance(11)
    claim_of(store.begin("k"))
    with store.keep_alive(claim, interval=0.05) as keeper:
        wait_for(lambda: keeper.lost is not None, 30, "the keeper to notice")
        with pytest.raises(LeaseLost):
            keeper.check()


def _effects(db: Database, key: str) -> list[tuple[str, int]]:
    with db.statement() as conn:
        rows = conn.execute(
            text("SELECT phase, fence FROM phase_effects WHERE key = :k ORDER BY fence, phase"),
            {"k": key},
        ).all()
    return [(r[0], int(r[1])) for r in rows]


@pytest.mark.parametrize(
    ("stop_where", "stop_phase", "committed"),
    [("between", "charge", 2), ("inside", "charge", 1)],
    ids=["between-phases", "inside-phase-transaction"],
)
def test_sigkill_mid_job_takeover_resumes(
    db: Database, db_url: str, tmp_path: Path, stop_where: str, stop_phase: str, committed: int
) -> None:
    """A worker SIGKILLed mid-job: after its lease expires another takes over with a larger
    fence, resumes after the last checkpoint, and no phase's effect happens twice; the dead
    owner's late complete gets LeaseLost. Catches: lost checkpoints, a takeover that restarts
    from scratch, a takeover before expiry, and a stale owner's complete being applied."""
    with db.transaction() as conn:
        conn.exec_driver_sql(PHASE_EFFECTS_DDL)
    key = "order:42"
    ctx = multiprocessing.get_context("spawn")
    victim = ctx.Process(
        target=phase_victim, args=(db_url, key, stop_where, stop_phase, str(tmp_path))
    )
    victim.start()
    try:
        wait_for(lambda: (tmp_path / "ready").exists(), 120, "the victim to reach its hang point")
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(60)
        assert victim.exitcode == -signal.SIGKILL
    finally:
        if victim.is_alive():
            victim.kill()
            victim.join(10)

    dead = claim_from_json((tmp_path / "claim.json").read_text())
    assert _effects(db, key) == [(p, dead.fence) for p in sorted(PHASES[:committed])]

    offset = [0.0]
    store = IdempotencyStore(db, lease_seconds=30.0, clock=lambda: time.time() + offset[0])
    with pytest.raises(AlreadyInProgress):  # the dead owner's lease (30 s) is still live
        run_phases(store, key)
    offset[0] = 31.0  # its lease is over: take over
    seen: list[Claim] = []
    outcome = run_phases(store, key, after_begin=seen.append)
    claim = seen[0]
    assert claim.takeover and claim.fence == dead.fence + 1 and claim.attempt == 2
    assert claim.recovery_point == PHASES[committed - 1]
    assert claim.recovery_data == {"done": PHASES[committed - 1], "fence": dead.fence}
    assert outcome is claim

    effects = _effects(db, key)
    assert sorted(p for p, _ in effects) == sorted(PHASES)  # each phase exactly once
    assert {p for p, f in effects if f == dead.fence} == set(PHASES[:committed])
    assert {p for p, f in effects if f == claim.fence} == set(PHASES[committed:])

    with pytest.raises(LeaseLost):
        store.complete(dead, {"late": True})
    record = store.get(key)
    assert record is not None and record.status is Status.COMPLETED
    assert record.result == {"phases": list(PHASES), "fence": claim.fence}
    replay = run_phases(store, key)
    assert isinstance(replay, Completed) and replay.fence == claim.fence
    assert len(_effects(db, key)) == len(PHASES)


def test_postgres_replay_takes_no_row_lock(postgres_url: str) -> None:
    """On Postgres a replay (and an AlreadyInProgress answer) only reads: it returns while another
    transaction holds the row locked. Catches: the upsert attempted on every begin, which locks
    the row (a transaction id and a WAL flush per replay; hot-key replays queued one by one)."""
    db = Database.from_url(postgres_url)
    upgrade(db)
    store = IdempotencyStore(db, lease_seconds=60.0)
    store.complete(claim_of(store.begin("done", payload=1)), "r")
    claim_of(store.begin("busy", payload=1))
    answers: dict[str, Any] = {}

    def replay() -> None:
        answers["done"] = store.begin("done", payload=1)
        try:
            store.begin("busy", payload=1)
        except AlreadyInProgress as exc:
            answers["busy"] = exc

    try:
        with db.engine.connect() as locker:
            locker.execute(
                text("SELECT key FROM idempotency_records WHERE key IN ('done', 'busy') FOR UPDATE")
            )
            t = threading.Thread(target=replay, daemon=True)
            t.start()
            t.join(30)
            finished_under_lock = not t.is_alive()
            locker.rollback()
        t.join(30)
        assert finished_under_lock
        assert isinstance(answers["done"], Completed) and answers["done"].result == "r"
        assert isinstance(answers["busy"], AlreadyInProgress)
    finally:
        db.dispose()


def test_batch_keeper_stops_its_holder_once_the_confirmed_lease_ran_out(
    store: IdempotencyStore, clock: FakeClock
) -> None:
    """Catches a batch lease keeper that lets its jobs go on after the lease it last confirmed
    ran out (no heartbeat got through: a store that does not answer), where the single-key
    keeper stops them: another worker may take the key over from then on, so each member's
    check() and confirm() must raise LeaseLost before the next side effect."""
    claims = [claim_of(o) for o in store.begin_many([("b1", None), ("b2", None)])]
    with store.keep_alive_many(claims, interval=3600) as keeper:  # no beat gets through
        members = [keeper.keeper_for(c) for c in claims]
        clock.advance(9)
        for member in members:
            member.check()  # still within the lease the claim confirmed
        clock.advance(2)
        for member in members:
            with pytest.raises(LeaseLost, match="ran out"):
                member.check()
            with pytest.raises(LeaseLost):
                member.confirm()
        assert set(keeper.lost) == {"b1", "b2"}
