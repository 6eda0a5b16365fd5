"""A model-based test: random interleavings of every store operation against a plain model.

Several owners (every claim ever handed out stays usable, so stale owners keep writing) run
begin / heartbeat / checkpoint / complete / fail(transient|permanent) / reset / purge, and the
batched begin_many / complete_many / heartbeat_many (which must answer every key exactly as the
single calls would), while the injected clock jumps past lease and retention expiries. After
every step each key's stored record must equal the model's, field by field. It runs on SQLite
and Postgres; the database is one per test (the ``db`` fixture) and each example uses its own
keys.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from resources.errors import SekaliError
from resources.idempotency import (
    AlreadyInProgress,
    Claim,
    Completed,
    IdempotencyConflict,
    IdempotencyStore,
    LeaseLost,
    Status,
    StoredFailure,
    payload_hash,
)
from resources.storage.db import Database

LEASE = 10.0
RETENTION = 30.0
_examples = itertools.count()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class ModelRecord:
    payload: Any
    status: Status
    owner: str
    lease: float | None
    fence: int
    attempt: int
    updated_at: float
    point: str | None = None
    data: Any = None
    result: Any = None
    error_class: str | None = None
    retention: float | None = None


def make_machine(db: Database) -> type[RuleBasedStateMachine]:
    class IdempotencyMachine(RuleBasedStateMachine):
        claims = Bundle("claims")

        def __init__(self) -> None:
            super().__init__()
            self.clock = Clock()
            self.store = IdempotencyStore(
                db, lease_seconds=LEASE, retention_seconds=RETENTION, clock=self.clock
            )
            prefix = f"ex{next(_examples)}"
            self.keys = [f"{prefix}:a", f"{prefix}:b"]
            self.model: dict[str, ModelRecord] = {}
            self.latest: dict[str, Claim] = {}

        # -- helpers -----------------------------------------------------------------------

        def owns(self, claim: Claim) -> bool:
            rec = self.model.get(claim.key)
            return (
                rec is not None
                and rec.owner == claim.owner_token
                and rec.status is Status.IN_PROGRESS
            )

        # -- rules -------------------------------------------------------------------------

        def expect_begin(self, key: str, payload: Any, out: Any) -> Claim | None:
            """Check one key's begin outcome (a result, or the error it raised or returned)
            against the model and apply it; returns the claim when one was made."""
            now = self.clock.now
            rec = self.model.get(key)
            if rec is not None and rec.payload != payload:
                assert isinstance(out, IdempotencyConflict), out
                return None
            if rec is not None and rec.status is Status.COMPLETED:
                assert isinstance(out, Completed), out
                assert (out.result, out.fence, out.attempt) == (rec.result, rec.fence, rec.attempt)
                return None
            if rec is not None and rec.status is Status.FAILED:
                assert isinstance(out, StoredFailure), out
                return None
            live = rec is not None and rec.status is Status.IN_PROGRESS and rec.lease > now  # type: ignore[operator]
            if live:
                assert rec is not None and rec.lease is not None
                assert isinstance(out, AlreadyInProgress), out
                assert out.retry_after == pytest.approx(rec.lease - now)
                return None
            assert isinstance(out, Claim), out
            if rec is None:
                assert (out.fence, out.attempt, out.takeover) == (1, 1, False)
                assert (out.recovery_point, out.recovery_data) == (None, None)
                self.model[key] = ModelRecord(
                    payload, Status.IN_PROGRESS, out.owner_token, now + LEASE, 1, 1, now
                )
            else:
                takeover = rec.status is Status.IN_PROGRESS
                assert out.takeover is takeover
                assert (out.fence, out.attempt) == (rec.fence + 1, rec.attempt + 1)
                assert (out.recovery_point, out.recovery_data) == (rec.point, rec.data)
                assert out.owner_token != rec.owner
                rec.status, rec.owner, rec.lease = Status.IN_PROGRESS, out.owner_token, now + LEASE
                rec.fence += 1
                rec.attempt += 1
                rec.updated_at = now
            assert out.lease_expires_at == now + LEASE
            self.latest[key] = out
            return out

        @rule(
            target=claims,
            k=st.integers(0, 1),
            payload=st.sampled_from(["p"] * 6 + [{"other": 1}]),
        )
        def begin(self, k: int, payload: Any) -> Any:
            key = self.keys[k]
            try:
                out: Any = self.store.begin(key, payload=payload)
            except SekaliError as exc:
                out = exc
            claim = self.expect_begin(key, payload, out)
            return multiple() if claim is None else claim

        @rule(
            target=claims,
            order=st.sampled_from([(0,), (1,), (0, 1), (1, 0)]),
            payloads=st.tuples(*[st.sampled_from(["p"] * 6 + [{"other": 1}])] * 2),
        )
        def begin_batch(self, order: tuple[int, ...], payloads: tuple[Any, Any]) -> Any:
            """begin_many answers every key exactly as begin would, in the caller's order."""
            items = [(self.keys[k], payloads[k]) for k in order]
            outs = self.store.begin_many(items)
            assert len(outs) == len(items)
            made = [
                self.expect_begin(key, p, out)
                for (key, p), out in zip(items, outs, strict=True)
            ]
            return multiple(*[claim for claim in made if claim is not None])

        @rule(
            batch=st.lists(claims, min_size=1, max_size=3, unique_by=lambda c: c.key),
            result=st.sampled_from([None, 7, {"r": [1, 2]}]),
        )
        def complete_batch(self, batch: list[Claim], result: Any) -> None:
            """complete_many stores what complete would and refuses stale owners one by one."""
            owned = [self.owns(claim) for claim in batch]
            outs = self.store.complete_many([(claim, result) for claim in batch])
            for claim, mine, out in zip(batch, owned, outs, strict=True):
                if not mine:
                    assert isinstance(out, LeaseLost) and out.key == claim.key
                    continue
                assert out is None
                rec = self.model[claim.key]
                rec.status, rec.result, rec.lease, rec.error_class = (
                    Status.COMPLETED, result, None, None,
                )
                rec.retention, rec.updated_at = self.clock.now + RETENTION, self.clock.now

        @rule(batch=st.lists(claims, min_size=1, max_size=3, unique_by=lambda c: c.key))
        def heartbeat_batch(self, batch: list[Claim]) -> None:
            owned = {claim.key for claim in batch if self.owns(claim)}
            expires, lost = self.store.heartbeat_many(batch)
            assert expires == self.clock.now + LEASE
            assert lost == {claim.key for claim in batch} - owned
            for key in owned:
                rec = self.model[key]
                rec.lease, rec.updated_at = self.clock.now + LEASE, self.clock.now

        @precondition(lambda self: bool(self.latest))
        @rule(
            k=st.integers(0, 1),
            action=st.sampled_from(["heartbeat", "checkpoint", "checkpoint", "complete", "fail"]),
        )
        def latest_owner_acts(self, k: int, action: str) -> None:
            """Stale claims dominate the bundle; this makes the current owner act often too."""
            claim = self.latest.get(self.keys[k]) or next(iter(self.latest.values()))
            if action == "heartbeat":
                self.heartbeat(claim)
            elif action == "checkpoint":
                self.checkpoint(claim, "p3", {"k": k})
            elif action == "complete":
                self.complete(claim, {"done": k})
            else:
                self.fail(claim, "transient" if k else "permanent")

        @rule(claim=claims)
        def heartbeat(self, claim: Claim) -> None:
            if not self.owns(claim):
                with pytest.raises(LeaseLost):
                    self.store.heartbeat(claim)
                return
            assert self.store.heartbeat(claim) == self.clock.now + LEASE
            rec = self.model[claim.key]
            rec.lease, rec.updated_at = self.clock.now + LEASE, self.clock.now

        @rule(
            claim=claims,
            point=st.sampled_from(["p1", "p2"]),
            data=st.sampled_from([None, {"n": 1}, [1, "x"]]),
        )
        def checkpoint(self, claim: Claim, point: str, data: Any) -> None:
            if not self.owns(claim):
                with pytest.raises(LeaseLost):
                    self.store.checkpoint(claim, point, data)
                return
            self.store.checkpoint(claim, point, data)
            rec = self.model[claim.key]
            rec.point, rec.data = point, data
            rec.lease, rec.updated_at = self.clock.now + LEASE, self.clock.now

        @rule(claim=claims, result=st.sampled_from([None, 7, "ok", {"r": [1, 2]}]))
        def complete(self, claim: Claim, result: Any) -> None:
            if not self.owns(claim):
                with pytest.raises(LeaseLost):
                    self.store.complete(claim, result)
                return
            self.store.complete(claim, result)
            rec = self.model[claim.key]
            rec.status, rec.result, rec.lease, rec.error_class = (
                Status.COMPLETED,
                result,
                None,
                None,
            )
            rec.retention, rec.updated_at = self.clock.now + RETENTION, self.clock.now

        @rule(claim=claims, kind=st.sampled_from(["transient", "permanent"]))
        def fail(self, claim: Claim, kind: str) -> None:
            error = ValueError("boom")
            if not self.owns(claim):
                with pytest.raises(LeaseLost):
                    self.store.fail(claim, error, kind)
                return
            self.store.fail(claim, error, kind)
            rec = self.model[claim.key]
            rec.status = Status.FAILED if kind == "permanent" else Status.RETRYABLE
            rec.lease, rec.error_class, rec.updated_at = None, "ValueError", self.clock.now

        @precondition(lambda self: bool(self.model))
        @rule(k=st.integers(0, 1))
        def reset(self, k: int) -> None:
            key = self.keys[k]
            rec = self.model.get(key)
            expected = rec is not None and rec.status is Status.FAILED
            assert self.store.reset(key) is expected
            if expected:
                assert rec is not None
                rec.status, rec.updated_at = Status.RETRYABLE, self.clock.now

        @precondition(lambda self: any(r.status is Status.COMPLETED for r in self.model.values()))
        @rule(older_than=st.sampled_from([None, None, 0.0, 15.0]))
        def purge(self, older_than: float | None) -> None:
            now = self.clock.now
            doomed = [
                key
                for key, rec in self.model.items()
                if rec.status is Status.COMPLETED
                and (
                    (rec.retention is not None and rec.retention <= now)
                    or (older_than is not None and rec.updated_at <= now - older_than)
                )
            ]
            deleted = self.store.purge(older_than)
            # other tests' keys are in other schemas/files; earlier examples' keys are ours too
            assert deleted >= len(doomed)
            for key in doomed:
                del self.model[key]

        @rule(seconds=st.sampled_from([1.0, 9.0, 9.0, 10.0, 11.0, 31.0]))
        def advance(self, seconds: float) -> None:
            self.clock.now += seconds

        # -- the invariant -----------------------------------------------------------------

        @invariant()
        def store_matches_model(self) -> None:
            for key in self.keys:
                stored = self.store.get(key)
                rec = self.model.get(key)
                if rec is None:
                    assert stored is None, key
                    continue
                assert stored is not None, key
                assert stored.status is rec.status
                assert stored.payload_hash == payload_hash(rec.payload)
                assert stored.owner_token == rec.owner
                assert stored.lease_expires_at == rec.lease
                assert (stored.fence, stored.attempt) == (rec.fence, rec.attempt)
                assert (stored.recovery_point, stored.recovery_data) == (rec.point, rec.data)
                assert stored.result == rec.result
                assert stored.error_class == rec.error_class
                assert stored.retention_expires_at == rec.retention
                assert stored.updated_at == rec.updated_at

    return IdempotencyMachine


def test_store_follows_the_model(db: Database) -> None:
    """Catches any transition the status table does not allow, a stale owner's write that
    lands, a takeover before expiry or a lost recovery point, on both backends."""
    run_state_machine_as_test(
        make_machine(db),
        settings=settings(
            max_examples=100,
            stateful_step_count=40,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
