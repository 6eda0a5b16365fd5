"""Worker counts from Little's law (:mod:`engine.capacity`) and the supervisor that follows
them (:mod:`sensors.workers`), against the real app database and a real Dagster instance."""

from __future__ import annotations

import time
from collections.abc import Iterator

import dagster as dg
import pytest

from engine import tags as tag
from engine.attempts import AttemptRecorder, Outcome
from engine.capacity import CapacityPolicy, Scale, needed_workers, next_target
from engine.health.diagnosis import DiagnosisSetup, check_worker_capacity
from engine.registry import JOB_TYPES
from engine.requests import RequestStore
from engine.worker import WorkerTargets
from pipelines.ops.worker import sekali_worker
from resources.storage.db import Database
from sensors.workers import supervise


def test_needed_workers_is_littles_law_over_utilisation_with_the_backlog_drained() -> None:
    """Catches sizing from the arrival rate alone (a 4 s job needs 80x the workers of a 50 ms
    one), a backlog that is never planned for, and a count outside the declared bounds."""
    policy = CapacityPolicy(utilisation=0.5, headroom=1.0, drain_seconds=60)
    assert needed_workers(10, 0.05, 0, policy, 1, 50) == (0.5, 1, 1)
    assert needed_workers(10, 4.0, 0, policy, 1, 100) == (40.0, 80, 80)
    assert needed_workers(10, 4.0, 0, policy, 1, 8)[2] == 8
    offered, unbounded, needed = needed_workers(0, 1.0, 120, policy, 1, 10)
    assert (offered, unbounded, needed) == (2.0, 4, 4)
    assert needed_workers(0, 1.0, 0, policy, 2, 10)[2] == 2


def test_up_at_once_down_only_after_the_need_stayed_lower() -> None:
    """Catches a supervisor that waits before scaling up into a burst, and one that flaps
    (stops and starts worker runs, a process each) when the need dips for a tick."""
    policy = CapacityPolicy(scale_down_after=30)
    s = next_target(None, 2, 0, policy)
    assert next_target(s, 7, 1, policy) == Scale(7)
    s = next_target(Scale(7), 3, 10, policy)
    assert s == Scale(7, 10)
    assert next_target(s, 8, 20, policy) == Scale(8)  # the dip ended: the clock starts over
    assert next_target(s, 2, 39, policy) == Scale(7, 10)
    assert next_target(s, 2, 40, policy) == Scale(2)


def test_worker_targets_take_bounds_or_a_fixed_count() -> None:
    """Catches bounds read as a count, a fixed count that is suddenly sized, and bad input
    accepted silently."""
    t = WorkerTargets.from_env({"SEKALI_WORKERS": "light=1..6,heavy=2,bulk=3.."})
    assert t.bounds("light") == (1, 6) and t.sized("light")
    assert t.bounds("heavy") == (2, 2) and not t.sized("heavy")
    assert t.bounds("bulk")[0] == 3 and t.bounds("bulk")[1] >= 3
    for bad in ("light=5..2", "light=x..3", "light=0..0"):
        with pytest.raises(ValueError, match="SEKALI_WORKERS"):
            WorkerTargets.from_env({"SEKALI_WORKERS": bad})


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.DagsterInstance.ephemeral() as inst:
        yield inst


def _payload(i: int) -> dict[str, str]:
    return {"template": "welcome", "user_id": f"c{i}", "date": "2026-11-29", "to": f"c{i}@x.test"}


def _light(instance: dg.DagsterInstance) -> list[dg.DagsterRun]:
    runs = instance.get_runs(dg.RunsFilter(job_name=sekali_worker.name))
    return [r for r in runs if r.tags.get(tag.QUEUE) == "light"
            and r.status not in (dg.DagsterRunStatus.CANCELED, dg.DagsterRunStatus.CANCELING)]


def _tick(instance: dg.DagsterInstance, db: Database, cursor: str | None, now: float
          ) -> dg.SensorResult:
    result = supervise(dg.build_sensor_context(instance=instance, cursor=cursor),
                       RequestStore(db), sekali_worker.name, now=now)
    for rr in result.run_requests or []:
        instance.create_run_for_job(sekali_worker, run_config=rr.run_config,
                                    tags={**rr.tags, "dagster/run_key": rr.run_key or ""})
    return result


def test_the_supervisor_scales_a_burst_up_at_once_and_back_to_the_floor_after_it(
    db: Database, instance: dg.DagsterInstance, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches a supervisor that keeps SEKALI_WORKERS' number whatever arrives (the backlog
    grows until someone notices), one that scales past the declared ceiling, one that keeps a
    burst's workers for ever, and a doctor that cannot say how many workers the load needs."""
    monkeypatch.setenv("SEKALI_WORKERS", "light=1..5,heavy=1")
    monkeypatch.setenv("SEKALI_SCALE_DOWN_AFTER", "30")
    monkeypatch.delenv("SEKALI_INTAKE_MODE", raising=False)
    monkeypatch.delenv("SEKALI_INTAKE_MODES", raising=False)
    assert JOB_TYPES["send_email"].queue == "light"
    recorder = AttemptRecorder(db)
    for _ in range(50):  # the type's observed duration: 0.5 s
        record = recorder.new("send_email")
        record.started_at -= 0.5
        recorder.finish(record, Outcome.COMPLETED)
    now = time.time()
    quiet = _tick(instance, db, None, now)
    assert len(_light(instance)) == 1  # nothing arrives: the floor
    store = RequestStore(db)
    for i in range(240):  # 4/s over the minute, and all still waiting
        store.enqueue("send_email", f"email:welcome:c{i}:2026-11-29", _payload(i), queue="light")
    burst = _tick(instance, db, quiet.cursor, now + 1)
    assert len(_light(instance)) == 5, burst  # 4/s x 0.5 s + 240 x 0.5 s / 60 s: 4 busy -> 5
    finding = check_worker_capacity(DiagnosisSetup(db=db, job_types=JOB_TYPES, lease_seconds=60,
                                                   clock=lambda: now + 1))
    light = finding.evidence["queues"]["light"]
    assert light["unbounded"] > 5 and light["needed"] == 5 and light["backlog"] == 240
    assert finding.passed and "light" in finding.found  # 5 x 2/s outrun 4/s arriving
    assert light["draining"] and light["capacity_per_second"] > 4
    monkeypatch.setenv("SEKALI_WORKERS", "light=1..1,heavy=1")
    short = check_worker_capacity(DiagnosisSetup(db=db, job_types=JOB_TYPES, lease_seconds=60,
                                                 clock=lambda: now + 1))
    assert not short.passed and "backlog grows" in short.found and "ceiling" in short.fix
    monkeypatch.setenv("SEKALI_WORKERS", "light=1..5,heavy=1")
    store.claim_for_worker(240, owner="drained", job_types=["send_email"])  # served
    later = now + 120  # the arrivals slid out of the window
    held = _tick(instance, db, burst.cursor, later)
    assert len(_light(instance)) == 5  # the need dropped: hysteresis holds the workers ...
    done = _tick(instance, db, held.cursor, later + 31)
    assert len(_light(instance)) == 1, done  # ... then back to the floor
    assert [r.tags[tag.WORKER] for r in _light(instance)] == ["light/0"]
