"""The workers' supervisor sensor (:mod:`sensors.workers`) against a real Dagster instance and
the real app database: it keeps one worker run per slot, never more than the target, backs off
a slot whose runs fail to start, and gives back what an ended worker run held."""

from __future__ import annotations

import time
from collections.abc import Iterator

import dagster as dg
import pytest

from engine import tags as tag
from engine.requests import RequestStatus, RequestStore
from pipelines.ops.worker import sekali_worker
from resources.idempotency import IdempotencyStore
from resources.storage.db import Database
from sensors.workers import LAUNCH_BACKOFF, held_back, supervise, worker_run_requests

pytestmark = pytest.mark.dagster


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.DagsterInstance.ephemeral() as inst:
        yield inst


@pytest.fixture(autouse=True)
def _targets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEKALI_WORKERS", "light=2,heavy=1")
    monkeypatch.delenv("SEKALI_INTAKE_MODE", raising=False)
    monkeypatch.delenv("SEKALI_INTAKE_MODES", raising=False)


def _tick(instance: dg.DagsterInstance, db: Database, cursor: str | None = None
          ) -> dg.SensorResult:
    context = dg.build_sensor_context(instance=instance, cursor=cursor)
    return supervise(context, RequestStore(db), sekali_worker.name)


def _launch(instance: dg.DagsterInstance, result: dg.SensorResult) -> list[dg.DagsterRun]:
    """What the daemon does with the tick's run requests (created, not started)."""
    return [
        instance.create_run_for_job(
            sekali_worker, run_config=rr.run_config,
            tags={**rr.tags, "dagster/run_key": rr.run_key or ""})
        for rr in result.run_requests or []
    ]


def test_one_run_per_slot_and_never_more_than_the_target(
    db: Database, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches a supervisor that launches a worker every tick (runs pile up in the queue), one
    that leaves a slot empty, one that mixes queues in a worker, and one that keeps a worker
    the target no longer wants."""
    first = _tick(instance, db)
    slots = sorted((rr.tags[tag.WORKER], rr.run_key) for rr in first.run_requests or [])
    assert slots == [("heavy/0", "worker:heavy/0:0"), ("light/0", "worker:light/0:0"),
                     ("light/1", "worker:light/1:0")]
    for rr in first.run_requests or []:
        queue = rr.tags[tag.QUEUE]
        assert rr.run_config == {"ops": {"resident_worker": {"config": {"queue": queue}}}}
        assert rr.tags[tag.WORKER].startswith(queue + "/")
        assert float(rr.tags[tag.MAX_RUNTIME]) > 1800 and rr.tags[tag.MAX_RETRIES] == "0"
    runs = _launch(instance, first)
    second = _tick(instance, db, first.cursor)
    assert not second.run_requests  # every slot filled: nothing more
    monkeypatch.setenv("SEKALI_WORKERS", "light=1,heavy=1")
    third = _tick(instance, db, second.cursor)
    assert not third.run_requests
    surplus = next(r for r in runs if r.tags[tag.WORKER] == "light/1")
    after = instance.get_run_by_id(surplus.run_id)
    assert after is not None and after.status in (dg.DagsterRunStatus.CANCELED,
                                                  dg.DagsterRunStatus.CANCELING)


def test_an_ended_worker_is_replaced_and_what_it_held_is_given_back(
    db: Database, instance: dg.DagsterInstance
) -> None:
    """Catches requests a dead worker held left ``running`` for ever, given back before the
    lease on their keys ran out, and a dead worker's slot left empty."""
    store = RequestStore(db)
    for i in range(3):
        payload = {"template": "welcome", "user_id": f"s{i}", "date": "2026-11-29",
                   "to": f"s{i}@x.test"}
        store.enqueue("send_email", f"email:welcome:s{i}:2026-11-29", payload, queue="light")
    first = _tick(instance, db)
    runs = {r.tags[tag.WORKER]: r for r in _launch(instance, first)}
    dead = runs["light/0"]
    instance.report_run_canceled(dead)  # ... it had started, and died holding work:
    held = store.claim_for_worker(3, owner=dead.run_id, job_types=["send_email"])
    ledger = IdempotencyStore(db, lease_seconds=30)
    ledger.begin(held[0].key, payload=held[0].payload)  # one key leased when it died
    second = _tick(instance, db, first.cursor)
    assert [rr.run_key for rr in second.run_requests or []] == ["worker:light/0:1"]
    back = store.get_many([r.id for r in held])
    assert {r.status for r in back} == {RequestStatus.PENDING}
    leased = next(r for r in back if r.key == held[0].key)
    assert leased.available_at is not None and leased.available_at > time.time() + 20
    assert all(r.available_at is None for r in back if r.key != held[0].key)


def test_a_slot_whose_runs_fail_to_start_is_relaunched_after_a_growing_wait(
    db: Database, instance: dg.DagsterInstance
) -> None:
    """Catches a supervisor that relaunches a worker every tick into a launcher that fails
    every launch (dozens of failed runs a minute, each costing the code server a process), and
    one that never relaunches once the launcher is back."""
    state: dict[str, int] = {}
    now = time.time()
    base, _ = LAUNCH_BACKOFF
    for k in range(3):
        launch, _, state = worker_run_requests(
            instance, sekali_worker.name, state, delivery=_policy(), targets=_targets_of(1),
            now=now)
        assert [rr.tags[tag.WORKER] for rr in launch] == ["light/0"]
        run = instance.create_run_for_job(sekali_worker, run_config=launch[0].run_config,
                                          tags=dict(launch[0].tags))
        instance.report_run_failed(run, "launch failed")  # it never started
        record = instance.get_run_record_by_id(run.run_id)
        assert record is not None and record.end_time is not None
        wait = base * 2 ** k
        assert held_back(instance, sekali_worker.name, "light/0", record.end_time) == (
            pytest.approx(record.end_time + wait))
        early, _, _ = worker_run_requests(
            instance, sekali_worker.name, state, delivery=_policy(), targets=_targets_of(1),
            now=record.end_time + wait - 0.5)
        assert early == []
        now = record.end_time + wait + 0.1
    assert state == {"light/0": 2}


def _policy() -> object:
    from engine.delivery import Delivery, DeliveryPolicy

    return DeliveryPolicy(default=Delivery.RESIDENT, per_type={
        "charge_payment": Delivery.PER_REQUEST, "fulfill_order": Delivery.PER_REQUEST,
        "rebuild_report_cache": Delivery.PER_REQUEST})


def _targets_of(light: int) -> object:
    from engine.worker import WorkerTargets

    return WorkerTargets({"light": light, "heavy": 0})
