"""The workers' supervisor: keeps the configured number of resident worker runs alive per queue
(``SEKALI_WORKERS``, :class:`engine.worker.WorkerTargets`), and gives back what a dead one held.

Each tick (every 5 s; **default status RUNNING**, so ``sekali dev`` and a deployment serve
requests without a click):

1. **Give back**: the runs holding requests (:meth:`RequestStore.holders`) that are worker runs
   Dagster has ended (killed, cut off, terminated, or finished without settling) give their
   requests back to ``pending`` (:meth:`RequestStore.take_back`), each claimable once the
   ledger's lease on its key has run out. A worker run Dagster still shows as started counts as
   alive, however dead its process: run monitoring ends it first (its worker's death, or its
   ``dagster/max_runtime``).
2. **Size**: a queue ``SEKALI_WORKERS`` gives bounds (``light=1..8``) gets the workers its
   observed load needs by Little's law (:mod:`engine.capacity`: arrivals x duration over the
   target utilisation, plus the backlog's drain), up at once, down only after the need stayed
   lower for ``SEKALI_SCALE_DOWN_AFTER`` seconds (the state in the cursor); a plain count is
   kept as is.
3. **Keep the count**: for every queue with job types delivered by resident workers
   (:class:`engine.delivery.DeliveryPolicy`), one run per slot ``0..target-1``, tagged
   ``sekali/worker=<queue>/<slot>``. A slot whose run is queued, starting or started is filled;
   an empty one gets a run under the run key ``worker:<queue>/<slot>:<generation>``, the
   generation kept in the cursor and moved on only once the slot's run has ended, so a tick
   repeated after a failure asks for the same run and Dagster keeps one. A slot above the
   target (the target was lowered) has its run terminated: it finishes its batch and ends.

Heavy and light never share a worker: a sick heavy downstream holds the heavy workers, never
the light ones.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import dagster as dg

from engine import tags as tag
from engine.attempts import AttemptRecorder
from engine.capacity import CapacityPolicy, QueueLoad, Scale, plan
from engine.delivery import DeliveryPolicy
from engine.durations import DurationModel
from engine.registry import JOB_TYPES
from engine.requests import RequestStore
from engine.worker import WorkerPolicy, WorkerTargets
from engine.worker import give_back as give_back_held
from sensors.intake import RequestsResource

log = logging.getLogger(__name__)

WORKER_JOB, WORKER_OP = "sekali_worker", "resident_worker"
"""The worker job this sensor launches by name, and its op, whose config is ``{"queue": ...}``
(the code location defines them under these names)."""

IN_FLIGHT = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
]
_ENDED = {dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED}


def give_back(instance: dg.DagsterInstance, requests: RequestStore) -> int:
    """Step 1 of a tick; returns how many requests went back to ``pending``."""
    holders = requests.holders()
    if not holders:
        return 0
    ended = [
        run.run_id
        for run in instance.get_runs(dg.RunsFilter(run_ids=holders))
        if tag.WORKER in run.tags and run.status in _ENDED
    ]
    moved = give_back_held(requests, ended)
    if moved:
        log.warning("gave back %d requests held by %d ended worker run(s): %s", len(moved),
                    len(ended), ", ".join(ended))
    return len(moved)


LAUNCH_BACKOFF = (5.0, 300.0)
"""A slot whose last run ended without starting (its launch failed: the code server overloaded
or down) is relaunched after 5 s, then twice as long after each such run in a row, at most
300 s, instead of every tick."""


def _in(run: dg.DagsterRun, location: str | None) -> bool:
    """Whether ``run`` was launched from the code location ``location`` (any, when None; a run
    that names no location counts for every one, so no supervisor launches past it)."""
    origin = run.remote_job_origin
    return location is None or origin is None or origin.location_name == location


def held_back(
    instance: dg.DagsterInstance, worker_job: str, slot: str, now: float,
    location: str | None = None,
) -> float | None:
    """When the slot may be relaunched, if its last run ended without ever starting (None:
    now). The wait doubles with each such run in a row (:data:`LAUNCH_BACKOFF`)."""
    records = instance.get_run_records(
        dg.RunsFilter(job_name=worker_job, tags={tag.WORKER: slot}), limit=8)
    records = [r for r in records if _in(r.dagster_run, location)]
    failed_starts = 0
    for record in records:  # newest first
        if (record.start_time is not None
                or record.dagster_run.status is not dg.DagsterRunStatus.FAILURE):
            break
        failed_starts += 1
    if not failed_starts:
        return None
    base, cap = LAUNCH_BACKOFF
    ended = records[0].end_time or records[0].update_timestamp.timestamp()
    at = ended + min(cap, base * 2 ** (failed_starts - 1))
    return at if at > now else None


def worker_run_requests(
    instance: dg.DagsterInstance,
    worker_job: str,
    generations: dict[str, int],
    *,
    delivery: DeliveryPolicy,
    targets: WorkerTargets,
    now: float | None = None,
    location: str | None = None,
) -> tuple[list[dg.RunRequest], list[str], dict[str, int]]:
    """Step 2 of a tick: (the runs to launch, the runs to terminate, the new generations).
    ``location``: the code location this supervisor runs in; with several (one per worker
    host), each keeps its own workers, so every host serves requests."""
    now = time.time() if now is None else now
    alive: dict[str, str] = {}
    for record in instance.get_run_records(
        dg.RunsFilter(job_name=worker_job, statuses=IN_FLIGHT)
    ):
        run = record.dagster_run
        slot = run.tags.get(tag.WORKER)
        if slot is not None and _in(run, location):
            alive[slot] = run.run_id
    generations = dict(generations)
    launch: list[dg.RunRequest] = []
    wanted: set[str] = set()
    longest = max((jt.running.max_runtime_seconds for jt in JOB_TYPES.values()), default=0.0)
    for queue in delivery.queues():
        policy = WorkerPolicy.from_env(queue)
        for n in range(targets.of(queue)):
            slot = f"{queue}/{n}"
            wanted.add(slot)
            if slot in alive:
                continue
            waiting = held_back(instance, worker_job, slot, now, location)
            if waiting is not None:
                log.warning("worker slot %s: its last run never started; relaunching at %s",
                            slot, datetime.fromtimestamp(waiting, tz=UTC).isoformat())
                continue
            generation = generations.get(slot, -1) + 1
            generations[slot] = generation
            launch.append(dg.RunRequest(
                run_key=f"worker:{slot}:{generation}",
                job_name=worker_job,
                run_config={"ops": {WORKER_OP: {"config": {"queue": queue}}}},
                tags=_worker_tags(queue, n, policy, longest),
            ))
    surplus = [run_id for slot, run_id in alive.items() if slot not in wanted]
    return launch, surplus, generations


def _worker_tags(queue: str, slot: int, policy: WorkerPolicy, longest: float) -> dict[str, str]:
    return {
        tag.QUEUE: queue,
        tag.WORKER: f"{queue}/{slot}",
        tag.MAX_RUNTIME: str(int(policy.lifetime_seconds + longest + 300)),
        tag.MAX_RETRIES: "0",  # the supervisor starts the next one
    }


def end_surplus(instance: dg.DagsterInstance, run_id: str) -> None:
    """End a worker run the target no longer wants: one not started yet is canceled as it is;
    a started one is terminated (it finishes the batch in hand, then ends CANCELED)."""
    run = instance.get_run_by_id(run_id)
    if run is None or run.status in _ENDED:
        return
    if run.status in (dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED):
        instance.report_run_canceled(run, message="above its queue's worker target")
        return
    try:
        instance.run_coordinator.cancel_run(run_id)
    except Exception:  # noqa: BLE001 - a launcher that cannot terminate: the run ends itself
        log.warning("worker run %s could not be terminated; it ends at its lifetime", run_id,
                    exc_info=True)


def sized_targets(
    requests: RequestStore, delivery: DeliveryPolicy, targets: WorkerTargets,
    scales: dict[str, Scale], now: float, policy: CapacityPolicy | None = None,
) -> tuple[WorkerTargets, dict[str, Scale], dict[str, QueueLoad]]:
    """The worker count of each queue this tick (:func:`engine.capacity.plan`): a queue
    ``SEKALI_WORKERS`` gives bounds is sized from its load; when the load cannot be read, each
    keeps the count it had (or its floor)."""
    queues = {q: delivery.resident(q) for q in delivery.queues()}
    model = DurationModel(AttemptRecorder(requests.db), clock=lambda: now)
    before = {q: s.target for q, s in scales.items()}
    try:
        counts, scales, loads = plan(requests, model, queues, targets, scales,
                                     policy or CapacityPolicy.from_env(), now)
    except Exception:  # noqa: BLE001 - the database is away: keep the workers running
        log.warning("could not measure the queues' load; keeping the worker counts",
                    exc_info=True)
        counts = {q: before.get(q, targets.of(q)) for q in queues}
        return WorkerTargets(counts), scales, {}
    for queue, load in loads.items():
        if before.get(queue) != scales[queue].target:
            log.warning("worker target of %s", load.describe(scales[queue].target))
    return WorkerTargets(counts), scales, loads


def supervise(
    context: dg.SensorEvaluationContext, requests: RequestStore, worker_job: str,
    *, now: float | None = None,
) -> dg.SensorResult:
    """One tick (see the module docstring); usable from tests with ``build_sensor_context``."""
    now = time.time() if now is None else now
    state: dict[str, Any] = json.loads(context.cursor) if context.cursor else {}
    given = give_back(context.instance, requests)
    origin = context.code_location_origin
    delivery = DeliveryPolicy.from_env()
    scales = {q: s for q, raw in (state.get("scale") or {}).items()
              if (s := Scale.from_json(raw)) is not None}
    targets, scales, _ = sized_targets(requests, delivery, WorkerTargets.from_env(), scales, now)
    launch, surplus, generations = worker_run_requests(
        context.instance, worker_job, dict(state.get("generations") or {}),
        delivery=delivery, targets=targets, now=now,
        location=origin.location_name if origin is not None else None,
    )
    for run_id in surplus:
        log.warning("worker run %s is above its queue's target: terminating it", run_id)
        end_surplus(context.instance, run_id)
    cursor = json.dumps({"generations": generations,
                         "scale": {q: s.as_json() for q, s in scales.items()}})
    if not launch:
        return dg.SensorResult(
            skip_reason=f"every worker slot filled; gave back {given} request(s)", cursor=cursor)
    return dg.SensorResult(run_requests=launch, cursor=cursor)


def worker_sensors(
    worker_jobs: Sequence[dg.JobDefinition], *, name: str = "worker_supervisor"
) -> list[dg.SensorDefinition]:
    """The supervisor over the worker job given (the code location's ``sekali_worker``); it
    reads the ``requests`` resource."""
    (job,) = worker_jobs

    @dg.sensor(
        name=name,
        job=job,
        minimum_interval_seconds=5,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Keeps SEKALI_WORKERS resident worker runs alive per queue; gives back what "
        "a dead one held.",
    )
    def _supervisor(
        context: dg.SensorEvaluationContext, requests: RequestsResource
    ) -> dg.SensorResult:
        return supervise(context, requests.get_store(), job.name)

    return [_supervisor]
