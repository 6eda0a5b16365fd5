"""The intake's reconcile step against a real Dagster instance and the real app database."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import dagster as dg
import pytest

from engine.requests import JobRequest, RequestStatus, RequestStore
from pipelines.ops import all_jobs, send_email_job
from pipelines.ops.batch import BATCH_JOBS
from resources.storage.db import Database
from sensors.intake import (
    IntakeMode,
    IntakePolicy,
    LaunchThrottle,
    evaluate_intake,
    reconcile_runs,
    run_requests_for,
    without_runs_in_flight,
)

pytestmark = pytest.mark.dagster


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    with dg.DagsterInstance.ephemeral() as inst:
        yield inst


def test_runs_ending_out_of_creation_order_beyond_one_page_all_move_their_requests(
    db: Database, instance: dg.DagsterInstance
) -> None:
    """Catches a reconcile that reads ended runs by run id, a page at a time, but moves its
    cursor to the newest end seen: when more runs ended between ticks than a page holds, a
    run created later that ended earlier was never read, and its request (its run CANCELED
    before it started: back to the queue) stayed launched forever."""
    store = RequestStore(db)
    for i in range(5):
        payload = {
            "template": "welcome",
            "user_id": f"r{i}",
            "date": "2026-11-29",
            "to": f"r{i}@x.test",
        }
        store.enqueue("send_email", f"email:welcome:r{i}:2026-11-29", payload, queue="light")
    claimed = store.claim_for_launch(10, relaunch_after=120)
    run_requests, run_keys = run_requests_for(claimed, IntakePolicy())
    store.set_run_keys(run_keys)
    cursor = reconcile_runs(instance, store, 0.0, limit=2).cursor  # a tick before the ends

    runs = [
        instance.create_run_for_job(
            send_email_job,
            run_config=rr.run_config,
            tags={**rr.tags, "dagster/run_key": rr.run_key or ""},
        )
        for rr in run_requests
    ]
    for run in reversed(runs):  # the highest run id ends first
        instance.report_run_canceled(run)
        time.sleep(0.01)

    moved = reconcile_runs(instance, store, cursor, limit=2).moved
    assert moved == 5
    statuses = {r.id: store.get(r.id).status for r in claimed}  # type: ignore[union-attr]
    assert set(statuses.values()) == {RequestStatus.PENDING}, statuses


def test_a_relaunch_skips_requests_whose_batch_run_has_not_ended(
    db: Database, instance: dg.DagsterInstance
) -> None:
    """Catches a backed-up queue feeding itself: requests of a batch run still QUEUED past
    relaunch_after were claimed again, re-chunked under a new batch run key and launched a
    second time."""
    now = [1000.0]
    store = RequestStore(db, clock=lambda: now[0])
    for i in range(3):
        store.enqueue("send_email", f"email:w:q{i}:2026-11-29", {"i": i}, queue="light")
    policy = IntakePolicy(modes={"send_email": IntakeMode.MICRO_BATCH})
    claimed = store.claim_for_launch(10, relaunch_after=120)
    (batch,), run_keys = run_requests_for(claimed, policy)
    store.set_run_keys(run_keys)
    micro_batch_job = next(j for j in BATCH_JOBS if j.name == batch.job_name)
    run = instance.create_run_for_job(
        micro_batch_job, run_config=batch.run_config,
        tags={"dagster/run_key": batch.run_key or ""},  # NOT_STARTED: not launched yet
    )

    now[0] += 121  # the run waits past relaunch_after
    store.enqueue("send_email", "email:w:q3:2026-11-29", {"i": 3}, queue="light")
    again = without_runs_in_flight(instance, store.claim_for_launch(10, relaunch_after=120))
    assert [r.key for r in again] == ["email:w:q3:2026-11-29"]

    instance.report_run_canceled(run)  # once the run has ended, its requests may go again
    now[0] += 121
    relaunched = without_runs_in_flight(instance, store.claim_for_launch(10, relaunch_after=120))
    assert sorted(r.key for r in relaunched) == [f"email:w:q{i}:2026-11-29" for i in range(4)]


def test_a_failed_run_dagster_will_retry_leaves_its_requests_to_the_retry_and_the_relaunch(
    db: Database, instance: dg.DagsterInstance
) -> None:
    """Catches requests stranded by a run retry: a fan-out run whose process was SIGKILLed ends
    FAILURE with ``dagster/will_retry``; its resume retry re-runs only the step that was in
    flight (Dagster's ``step_keys_to_execute``), and the reconcile had already marked every
    request of the failed run ``failed``, so the requests whose steps never started were
    neither run nor relaunched (and the DLQ sensor skips a run that will retry). Found by
    ``sekali chaos --topology hosts``."""
    now = [1000.0]
    store = RequestStore(db, clock=lambda: now[0])
    claimed, run = _fan_out_run(store, instance, "k", {"dagster/will_retry": "true"})
    cursor = reconcile_runs(instance, store, 0.0).cursor
    instance.report_run_failed(run)
    moved = reconcile_runs(instance, store, cursor).moved
    assert moved == 0
    assert {store.get(r.id).status for r in claimed} == {RequestStatus.LAUNCHED}  # type: ignore[union-attr]

    now[0] += 121  # the retry ran none of them: they go again after relaunch_after
    again = without_runs_in_flight(instance, store.claim_for_launch(10, relaunch_after=120))
    assert sorted(r.key for r in again) == [f"email:w:k{i}:2026-11-29" for i in range(3)]


def _fan_out_run(
    store: RequestStore, instance: dg.DagsterInstance, tag_: str, tags: dict[str, str]
) -> tuple[list[JobRequest], dg.DagsterRun]:
    """Three requests claimed into one fan-out run (not started), with ``tags`` besides the
    intake's."""
    for i in range(3):
        store.enqueue("send_email", f"email:w:{tag_}{i}:2026-11-29", {"i": i}, queue="light")
    claimed = store.claim_for_launch(10, relaunch_after=120)
    (batch,), run_keys = run_requests_for(claimed, IntakePolicy(default_mode=IntakeMode.FAN_OUT))
    store.set_run_keys(run_keys)
    fan_out_job = next(j for j in BATCH_JOBS if j.name == batch.job_name)
    run = instance.create_run_for_job(
        fan_out_job, run_config=batch.run_config,
        tags={**batch.tags, "dagster/run_key": batch.run_key or "", **tags},
    )
    return claimed, run


def _ended_fan_out_run(
    store: RequestStore, instance: dg.DagsterInstance, tag_: str, failure_reason: str | None
) -> tuple[list[int], str]:
    """A fan-out run of three requests that ended FAILURE for good (no
    ``dagster/will_retry``): the first completed by its step, the second taken by a step that
    did not settle it (``running``), the third never taken (``launched``)."""
    tags = {"dagster/will_retry": "false"}
    if failure_reason is not None:
        tags["dagster/failure_reason"] = failure_reason
    claimed, run = _fan_out_run(store, instance, tag_, tags)
    ids = [r.id for r in claimed]
    store.mark_running(ids[0], run_id=run.run_id)
    store.mark_completed(ids[0], run_id=run.run_id)
    store.mark_running(ids[1], run_id=run.run_id)
    instance.report_run_failed(run)
    return ids, run.run_id


@pytest.mark.parametrize("reason", [None, "RUN_WORKER_RESTART", "START_TIMEOUT"])
def test_a_run_that_failed_around_its_requests_returns_the_untaken_and_fails_the_taken(
    db: Database, instance: dg.DagsterInstance, reason: str | None
) -> None:
    """Catches requests dead-lettered when their run died for good around them (a worker
    killed or cut off, a launch that failed, Dagster's run retries used up): one no step took
    never ran, whatever Dagster did with the run, and goes back to the queue after a backoff
    (a 50,000 burst whose launches failed once dead-lettered every one of them); one a step
    took fails ``transient`` (nothing of it failed; the run did: replay it), never ``unknown``
    (the class of a bug)."""
    now = [5000.0]
    store = RequestStore(db, clock=lambda: now[0])
    ids, run_id = _ended_fan_out_run(store, instance, "t", reason)
    done = reconcile_runs(instance, store, 0.0)
    assert done.returned == 1
    finished, taken, untaken = (store.get(i) for i in ids)
    assert finished is not None and finished.status is RequestStatus.COMPLETED
    assert taken is not None and taken.status is RequestStatus.FAILED, taken
    assert taken.error_class == "transient" and run_id in (taken.last_error or ""), taken
    assert untaken is not None and untaken.status is RequestStatus.PENDING, untaken
    assert untaken.available_at is not None and untaken.available_at >= now[0] + 5
    assert "no step had taken it" in (untaken.last_error or ""), untaken
    assert store.claim_for_launch(10) == []  # not before its backoff
    now[0] = untaken.available_at
    assert [r.id for r in store.claim_for_launch(10)] == [untaken.id]


def test_a_step_failure_leaves_its_own_class_and_returns_the_untaken(
    db: Database, instance: dg.DagsterInstance
) -> None:
    """Catches a request no step of the run took (a resumed retry runs only the steps that were
    in flight) failed with the class of a sibling's step failure, or at all: it never ran here.
    The request a failed step took keeps no class of the intake's own (its step's decision
    wrote its dead letter)."""
    store = RequestStore(db)
    ids, _ = _ended_fan_out_run(store, instance, "s", "STEP_FAILURE")
    reconcile_runs(instance, store, 0.0)
    _, taken, untaken = (store.get(i) for i in ids)
    assert taken is not None and taken.status is RequestStatus.FAILED
    assert taken.error_class is None, taken
    assert untaken is not None and untaken.status is RequestStatus.PENDING, untaken


def test_the_launch_allowance_halves_on_failed_launches_holds_on_a_deep_queue_and_grows_back(
) -> None:
    """Catches an intake that launches its full page every tick while the launcher fails them
    (each failed launch spent a retry of its run, then the requests were dead-lettered), or
    that stays throttled after the launcher recovered."""
    throttle = LaunchThrottle(most=200, max_queued=50)
    allowed, now, why = throttle.next(None, returned=120, queued=0)
    assert (allowed, now) == (100, 100) and "came back" in why
    allowed, now, _ = throttle.next(allowed, returned=80, queued=0)
    assert (allowed, now) == (50, 50)
    allowed, now, why = throttle.next(allowed, returned=0, queued=60)
    assert (allowed, now) == (50, 0) and "queue" in why
    steps = []
    while now < 200:
        allowed, now, _ = throttle.next(allowed, returned=0, queued=0)
        steps.append(now)
    assert steps == [70, 90, 110, 130, 150, 170, 190, 200]


def test_a_tick_after_failed_launches_launches_fewer(
    db: Database, instance: dg.DagsterInstance
) -> None:
    """The tick itself: requests that came back from runs that never started make the next
    claim smaller (its allowance kept in the cursor), and it says why."""
    store = RequestStore(db)
    for i in range(30):
        payload = {"template": "welcome", "user_id": f"b{i}", "date": "2026-11-29",
                   "to": f"b{i}@x.test"}
        store.enqueue("send_email", f"email:welcome:b{i}:2026-11-29", payload, queue="light")
    policy = IntakePolicy(default_mode=IntakeMode.PER_REQUEST, max_requests_per_tick=8)
    first = evaluate_intake(dg.build_sensor_context(instance=instance), store, policy)
    runs = first.run_requests or []
    assert len(runs) == 8
    for rr in runs:  # the launcher failed every one before it started
        job = next(j for j in all_jobs if j.name == rr.job_name)
        run = instance.create_run_for_job(
            job, run_config=rr.run_config,
            tags={**rr.tags, "dagster/run_key": rr.run_key or "", "dagster/will_retry": "false"})
        instance.report_run_failed(run, "launch failed: DEADLINE_EXCEEDED")
    second = evaluate_intake(dg.build_sensor_context(instance=instance, cursor=first.cursor),
                             store, policy)
    assert len(second.run_requests or []) == 4
    assert json.loads(second.cursor or "{}")["allowed"] == 4
    assert store.counts()[RequestStatus.FAILED] == 0  # none dead-lettered
