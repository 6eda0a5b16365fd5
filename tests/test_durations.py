"""The duration model and adaptive leases (:mod:`engine.durations`) against the real app
database: percentiles from the attempts' own aggregates over a sliding window, the declared
lease until enough samples, and a claim's lease, heartbeat and fence following the choice."""

from __future__ import annotations

import math
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import Keying, Queue, Running
from engine.attempts import AttemptRecorder, Outcome
from engine.context import SEND_BOUND
from engine.contract import JobType
from engine.durations import (
    AdaptivePolicy,
    DurationModel,
    DurationStats,
    LeaseBounds,
    choose_lease,
    upper_quantile,
)
from engine.health.metrics import percentile
from engine.registry import JOB_TYPES
from engine.runtime import execute_request
from engine.services import Services
from resources.errors import LeaseLost
from resources.idempotency import IdempotencyStore
from resources.storage.db import Database


def _type(name: str) -> JobType:
    return JobType(
        name=name,
        queue=Queue.LIGHT,
        validate=dict,
        handler=_note_lease,
        side_effect=False,
        keying=Keying(key_for=lambda p: f"x:{p['n']}", resource_id=lambda p: "r"),
        running=Running(max_runtime_seconds=60),
    )


class Clock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _record(db: Database, clock: Clock, job_type: str, durations: list[float]) -> None:
    """Completed attempts of ``job_type`` with these durations, written as a worker does."""
    recorder = AttemptRecorder(db, clock=clock)
    for seconds in durations:
        record = recorder.new(job_type)
        clock.now += seconds
        recorder.finish(record, Outcome.COMPLETED)
        clock.now += 0.001


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=1e-3, max_value=1e4), min_size=1, max_size=300),
       st.sampled_from([0.5, 0.99, 0.999]))
def test_a_bin_percentile_is_never_below_the_true_one_and_at_most_a_bin_above(
    values: list[float], q: float
) -> None:
    """Catches a lease taken from a percentile that reads low (the bin's lower edge, or an
    off-by-one rank): the lease would be shorter than the work it measures."""
    from engine.attempts import histogram_bin

    bins: dict[int, int] = {}
    for v in values:
        bins[histogram_bin(v)] = bins.get(histogram_bin(v), 0) + 1
    exact = percentile(values, q)
    upper = upper_quantile(bins, q)
    assert exact <= upper <= exact * 1.2 + 1e-12


def test_the_model_reads_the_window_per_job_type_with_its_sample_size(db: Database) -> None:
    """Catches a model that mixes job types, leaves out an attempt that lost its lease (the
    lease would never grow past the durations it cuts off), keeps minutes that slid out of the
    window, or reads every row instead of the aggregates."""
    clock = Clock()
    _record(db, clock, "fast", [0.05] * 990 + [0.4] * 9)
    _record(db, clock, "slow", [2.0] * 50)
    recorder = AttemptRecorder(db, clock=clock)
    lost = recorder.new("fast")
    clock.now += 30
    recorder.finish(lost, Outcome.LEASE_LOST)
    recorder.finish(recorder.new("fast"), Outcome.RETRIED)  # a failure says nothing of it
    model = DurationModel(AttemptRecorder(db), AdaptivePolicy(window_seconds=600), clock=clock)
    stats = model.stats()
    fast, slow = stats["fast"], stats["slow"]
    assert (fast.samples, slow.samples) == (1000, 50)
    assert 0.05 <= fast.p50 <= 0.06 and 0.05 <= fast.p99 <= 0.06
    assert 0.4 <= fast.p999 <= 0.48
    assert 2.0 <= slow.p999 <= 2.4
    _record(db, clock, "slow", [0.5] * 5)
    assert model.stats()["slow"].samples == 50  # read again only after refresh_seconds
    model.policy = AdaptivePolicy(window_seconds=600, refresh_seconds=0, min_samples=1000)
    assert model.stats()["fast"].p999 <= 0.48  # the one of 1,000 past p99.9 is the lost
    assert model.lease_for(_type("fast"), 60).observed
    clock.now += 3600  # the window slides past every minute written
    assert model.stats() == {}  # nothing observed: leases go back to declared


def test_the_declared_lease_until_enough_samples_then_p999_times_factor_clamped() -> None:
    """Catches a lease derived from a handful of samples, one above the ceiling a job type
    declares, one below its floor, and a 'why' that does not say which rule chose it."""
    policy = AdaptivePolicy(min_samples=100, factor=3)
    few = DurationStats("t", 99, 0.05, 0.1, 0.2)
    chosen = choose_lease(few, LeaseBounds(), default=60, max_runtime=120, policy=policy)
    assert (chosen.seconds, chosen.observed, chosen.why) == (60, False, "declared, 99<100 samples")
    declared = choose_lease(None, LeaseBounds(declared=30), default=60, max_runtime=120,
                            policy=policy)
    assert declared.seconds == 30
    enough = DurationStats("t", 1000, 0.05, 0.1, 0.2)
    chosen = choose_lease(enough, LeaseBounds(floor=0.5), default=60, max_runtime=120,
                          policy=policy)
    assert chosen.observed and chosen.seconds == pytest.approx(0.6)
    assert chosen.why == "p99.9 0.2s x 3 = 0.6s clamped to [0.5, 120]"
    assert chosen.heartbeat_seconds == pytest.approx(0.2)
    young = choose_lease(DurationStats("t", 250, 0.05, 0.1, 0.2), LeaseBounds(floor=0.5),
                         default=60, max_runtime=120, policy=policy)
    assert young.seconds == pytest.approx(1.2)  # p99.9 of 250 is their max: x sqrt(1000/250)
    assert "widened for 250<1000 samples" in young.why
    floor = choose_lease(enough, LeaseBounds(floor=2), default=60, max_runtime=120, policy=policy)
    assert floor.seconds == 2
    tail = DurationStats("t", 500, 0.05, 10, 100)
    assert choose_lease(tail, LeaseBounds(), default=60, max_runtime=120, policy=policy
                        ).seconds == 120  # the type's max runtime is the default ceiling
    assert choose_lease(tail, LeaseBounds(ceiling=90), default=60, max_runtime=120,
                        policy=policy).seconds == 90
    off = choose_lease(tail, LeaseBounds(), default=60, max_runtime=120,
                       policy=AdaptivePolicy(enabled=False))
    assert off.seconds == 60 and "off" in off.why
    with pytest.raises(ValueError, match="ceiling"):
        LeaseBounds(floor=5, ceiling=1)


def test_a_claim_keeps_its_own_lease_and_the_fence_refuses_the_holder_it_outlived(
    db: Database,
) -> None:
    """Catches a heartbeat that renews by the store's lease instead of the claim's (a short
    claim renewed to a long lease, or a long one cut short), and a holder whose short adaptive
    lease ran out still able to complete after another worker took the key over."""
    clock = Clock()
    store = IdempotencyStore(db, lease_seconds=60, clock=clock)
    claim = store.begin("adaptive:1", payload={"n": 1}, lease_seconds=2.5)
    assert claim.lease_seconds == 2.5 and claim.lease_expires_at == clock.now + 2.5
    clock.now += 1
    assert store.heartbeat(claim) == clock.now + 2.5
    long = store.begin("adaptive:2", payload={"n": 2}, lease_seconds=600)
    clock.now += 100
    assert store.heartbeat(long) == clock.now + 600
    taker = store.begin("adaptive:1", payload={"n": 1}, lease_seconds=2.5)
    assert taker.takeover and taker.fence > claim.fence
    with pytest.raises(LeaseLost):
        store.complete(claim, {"late": True})
    store.complete(taker, {"ok": True})
    assert store.fresh_for([claim, long]) == pytest.approx(0.25)


def _probe(db: Database, monkeypatch: pytest.MonkeyPatch, name: str, handler: Any, *,
           running: Running, store_lease: float, side_effect: bool = True) -> Services:
    """Job type ``name`` (one key per ``n``) swapped in, 200 attempts of 10 ms recorded for it,
    and services whose model has the samples (100) to follow them."""
    monkeypatch.setitem(JOB_TYPES, name, JobType(
        name=name, queue=Queue.LIGHT, validate=dict, handler=handler, side_effect=side_effect,
        keying=Keying(key_for=lambda p: f"{name}:{p['n']}", resource_id=lambda p: "r"),
        running=running,
    ))
    _record(db, Clock(), name, [0.01] * 200)
    model = DurationModel(AttemptRecorder(db), AdaptivePolicy(min_samples=100))
    return Services(db=db, store=IdempotencyStore(db, lease_seconds=store_lease),
                    attempts=AttemptRecorder(db), durations=model)


SEEN: list[float] = []


def _note_lease(ctx: Any, payload: dict[str, Any]) -> dict[str, Any]:
    SEEN.append(ctx.claim.lease_seconds)
    return {"n": payload["n"]}


def test_a_request_claims_under_the_lease_its_job_types_durations_call_for(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches the runtime claiming with the store's constant lease while the model has
    enough samples, and one that ignores the bounds a job type declares."""
    services = _probe(db, monkeypatch, "lease_probe", _note_lease, store_lease=60,
                      side_effect=False,
                      running=Running(max_runtime_seconds=60,
                                      lease=LeaseBounds(floor=1.5, ceiling=30)))
    store, model = services.store, services.durations
    choice = services.lease_for(JOB_TYPES["lease_probe"])
    assert choice.observed and choice.seconds == 1.5, choice  # 3 x 0.0105 under the floor
    SEEN.clear()
    execute_request("lease_probe", {"n": "1"}, services=services)
    cold = Services(db=db, store=store, attempts=AttemptRecorder(db),
                    durations=DurationModel(AttemptRecorder(db), AdaptivePolicy(min_samples=500)))
    execute_request("lease_probe", {"n": "2"}, services=cold)
    assert SEEN == [1.5, 60]
    assert not math.isnan(model.stats()["lease_probe"].p999)


WINDOWS: list[tuple[float, float]] = []


def _stamp_and_confirm(ctx: Any, payload: dict[str, Any]) -> dict[str, Any]:
    ctx.stamp_send()
    written_down = time.monotonic()  # the send is written down (sent_at) by now
    WINDOWS.append((ctx.claim.lease_seconds, ctx.confirm_lease() - written_down))
    return {"n": payload["n"]}


def test_a_send_stamped_under_a_grown_lease_leaves_within_the_declared_leases_window(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches a send bound that grows with the adaptive lease after a stamp: the settle window
    (a charge's lookup waits it from ``sent_at``) is sized against the declared lease, so a
    lease grown to 50 s would let a send written down at 0 leave at 20 s, past what a 2 s
    lease's window (0.8 s) left the provider to process it before the lookup looks."""
    services = _probe(db, monkeypatch, "stamp_probe", _stamp_and_confirm, store_lease=2,
                      running=Running(max_runtime_seconds=100,
                                      lease=LeaseBounds(floor=50, ceiling=100)))
    WINDOWS.clear()
    execute_request("stamp_probe", {"n": "1"}, services=services)
    [(lease, window)] = WINDOWS
    assert lease == 50  # the lease grew: heartbeats and takeovers follow it
    assert 0 < window <= SEND_BOUND * 2, window  # the send window stayed the declared lease's


def test_doctor_and_metrics_show_each_types_percentiles_lease_in_force_and_why(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches a doctor that reports only the declared lease (operators cannot see what the
    platform chose, nor why), a check that stays green when a declared ceiling clamps the
    lease under the observed p99.9, and metrics that leave the lease in force out."""
    from engine.health.diagnosis import DiagnosisSetup, check_adaptive_timing
    from engine.health.metrics import MetricsCollector

    monkeypatch.setenv("SEKALI_LEASE_MIN_SAMPLES", "100")
    clock = Clock()
    _record(db, clock, "lease_probe", [0.2] * 150)
    _record(db, clock, "capped_probe", [3.0] * 120)
    _record(db, clock, "rare_probe", [0.2] * 5)
    types = {
        name: JobType(
            name=name,
            queue=Queue.LIGHT,
            validate=dict,
            handler=_note_lease,
            side_effect=False,
            keying=Keying(key_for=lambda p: f"x:{p['n']}", resource_id=lambda p: "r"),
            running=Running(max_runtime_seconds=60, lease=bounds),
        )
        for name, bounds in (("lease_probe", None), ("capped_probe", LeaseBounds(ceiling=2)),
                             ("rare_probe", None))
    }
    setup = DiagnosisSetup(db=db, job_types=types, lease_seconds=45, clock=clock)
    finding = check_adaptive_timing(setup)
    rows = finding.evidence["job_types"]
    assert rows["lease_probe"]["samples"] == 150
    assert rows["lease_probe"]["lease_observed"] is True
    assert rows["lease_probe"]["lease_why"].startswith("p99.9 ")
    assert 1.0 < rows["lease_probe"]["lease_seconds"] <= 0.24 * 3 * (1000 / 150) ** 0.5
    assert rows["rare_probe"]["lease_seconds"] == 45
    assert rows["rare_probe"]["lease_why"] == "declared, 5<100 samples"
    assert rows["capped_probe"]["lease_seconds"] == 2
    assert not finding.passed and "capped_probe" in finding.found
    snap = MetricsCollector(db, clock=clock, leases=(types, 45.0)).collect()
    assert snap.get("sekali_duration_window_samples", job_type="lease_probe") == 150
    assert snap.get("sekali_lease_in_force_seconds", job_type="rare_probe",
                    source="declared") == 45
    assert snap.get("sekali_lease_in_force_seconds", job_type="capped_probe",
                    source="observed") == 2
    p999 = snap.get("sekali_duration_window_seconds", job_type="capped_probe", quantile="0.999")
    assert p999 is not None and 3.0 <= p999 <= 3.6
