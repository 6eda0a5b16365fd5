"""The intake sensor: pending job requests become Dagster runs, with deterministic run keys.

Each tick (every ``minimum_interval_seconds=5``; **default status RUNNING**, so ``sekali dev``
and a fresh deployment drain the intake without a click; stop it in the UI to pause intake):

1. Reconcile: runs launched by this sensor that ended since the cursor move their requests on.
   A per-request run that succeeded marks its request ``completed``; any intake run that ended
   FAILURE or CANCELED marks its requests that are not completed ``failed`` (with the run id),
   where the DLQ picks them up, unless Dagster will retry the run (``dagster/will_retry``): then
   the retry moves them, and those it does not run stay ``launched`` and are relaunched. Batch
   ops also move their requests themselves, per request. The class says why: a request no step
   took, or one whose run failed around it (worker killed or cut off, launch failed, canceled),
   failed nothing of its own and is ``transient``; one whose step failed without settling it
   keeps no class here, and the DLQ reads the step's declared class.
2. Claim up to ``max_requests_per_tick`` requests (pending, or launched longer than
   ``relaunch_after_seconds`` ago), highest aged priority first (``claim_rank``, set at enqueue:
   ``SEKALI_INTAKE_PRIORITY_AGING`` seconds of waiting are worth one step, default 60), debounced
   groups once due (one request of the
   group launched, the rest recorded ``coalesced``), and emit runs for them in the request's
   mode, tagged ``dagster/priority`` (Dagster's run queue honours it), ``sekali/priority``,
   ``sekali/coalesced`` and ``sekali/dedupe_window``:

   ``per_request``  ``RunRequest(run_key="intake:{key}", job_name=<job type>)``, one run each:
                    the most visible in the UI, and the costliest (a run per request).
   ``fan_out``      one ``intake_fan_out`` run per batch: a mapped step per request.
   ``micro_batch``  one ``intake_micro_batch`` run per batch: one step runs up to ``batch_size``
                    requests, each claimed, recorded and dead-lettered on its own.

   Batches never mix queues; a batch's run key is ``intake-{mode}:{first}-{last}:{hash of ids}``.

Modes are chosen by the ``requests`` resource (:class:`RequestsResource`),
read at tick time: ``SEKALI_INTAKE_MODES="send_email=micro_batch,charge_payment=per_request"``
per job type, else ``SEKALI_INTAKE_MODE`` for all, else ``per_request``. Batch size and page size
come from ``SEKALI_INTAKE_BATCH_SIZE`` (50) and ``SEKALI_INTAKE_MAX_PER_TICK`` (200).

Why requests are marked ``launched`` before Dagster launches their runs: a sensor cannot act
after its RunRequests are submitted. If a tick claims and then fails, the requests stay
``launched`` and are claimed again after ``relaunch_after_seconds``; the deterministic run key
makes that re-emission a no-op whenever the run does exist. The idempotency ledger still makes a
request run twice have one effect.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import dagster as dg

from engine import tags as tag
from engine.dead_letters import Subject, announce, dead_letter_now
from engine.delivery import Delivery, DeliveryPolicy
from engine.launch import stored_request_run_config
from engine.registry import get_job_type
from engine.requests import JobRequest, RequestStore
from resources.dagster_resources import SettingsResource
from resources.errors import ValidationError
from resources.retry import FailureClass
from resources.telemetry.tracing import trace_id_of

log = logging.getLogger(__name__)

FAN_OUT_JOB, FAN_OUT_OP = "intake_fan_out", "fan_out_requests"
MICRO_BATCH_JOB, MICRO_BATCH_OP = "intake_micro_batch", "execute_request_batch"
"""The batched intake jobs this sensor launches by name, and the op that takes
``{"request_ids": [...]}`` in each (the code location defines them under these names)."""


class RequestsResource(SettingsResource):
    """The intake table (``job_requests``) on the app database: the resource this sensor and
    the batch ops read requests through."""

    def _build(self) -> RequestStore:
        return RequestStore(self.database())

    def get_store(self) -> RequestStore:
        return self._get()  # type: ignore[no-any-return]


IntakeMode = Delivery
"""How a request is delivered (:class:`engine.delivery.Delivery`): this sensor launches runs for
``per_request``, ``fan_out`` and ``micro_batch``; ``resident`` requests are the workers'."""


@dataclass(frozen=True)
class IntakePolicy:
    """How the sensor drains the intake; built from the environment at tick time. Which job
    types it launches runs for is :class:`DeliveryPolicy`'s decision (``default_mode`` for the
    job types that declare none, ``modes`` per job type); the rest are resident workers'."""

    default_mode: IntakeMode = IntakeMode.RESIDENT
    modes: dict[str, IntakeMode] = field(default_factory=dict)
    batch_size: int = 50
    max_requests_per_tick: int = 200
    relaunch_after_seconds: float = 120.0
    max_queued_runs: int = 100

    @property
    def delivery(self) -> DeliveryPolicy:
        return DeliveryPolicy(default=self.default_mode, per_type=self.modes)

    def mode_for(self, job_type: str) -> IntakeMode:
        return self.delivery.of(job_type)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> IntakePolicy:
        env = dict(os.environ) if env is None else env
        delivery = DeliveryPolicy.from_env(env)
        return cls(
            default_mode=delivery.default,
            modes=dict(delivery.per_type),
            batch_size=int(env.get("SEKALI_INTAKE_BATCH_SIZE", "50")),
            max_requests_per_tick=int(env.get("SEKALI_INTAKE_MAX_PER_TICK", "200")),
            relaunch_after_seconds=float(env.get("SEKALI_INTAKE_RELAUNCH_AFTER", "120")),
            max_queued_runs=int(env.get("SEKALI_INTAKE_MAX_QUEUED", "100")),
        )


def per_request_run_config(request: JobRequest) -> dict[str, Any]:
    """Run config of a per-request job serving a stored request: its id only (the op reads the
    payload from ``job_requests``; no payload value goes into Dagster's run storage).
    :class:`ValidationError` if the stored payload is not valid (no run can serve it)."""
    get_job_type(request.job_type).validate(dict(request.payload))
    return stored_request_run_config(request.job_type, request.id)


def merge_debounced(job_type: str, payloads: list[dict[str, Any]]) -> dict[str, Any]:
    """The payload a debounced group runs with: the job type's ``merge``, else the newest."""
    debounce = get_job_type(job_type).flow.debounce
    if debounce is None or debounce.merge is None:
        return payloads[-1]
    return debounce.merge(payloads)


def _tags(mode: IntakeMode, requests: Sequence[JobRequest]) -> dict[str, str]:
    priority = max(r.priority for r in requests)
    tags = {
        tag.INTAKE: str(mode),
        tag.QUEUE: requests[0].queue,
        tag.REQUEST_IDS: ",".join(str(r.id) for r in requests),
        tag.PRIORITY: str(priority),
        tag.PRIORITY_RUN: str(priority),
    }
    tenants = {r.tenant for r in requests}
    tags[tag.TENANT] = tenants.pop() if len(tenants) == 1 else tag.SEVERAL_TENANTS
    coalesced = sum(r.coalesced_count for r in requests)
    if coalesced:
        tags[tag.COALESCED] = str(coalesced)
    if mode is not IntakeMode.PER_REQUEST:  # per-request jobs carry their own
        tags[tag.MAX_RUNTIME] = tag.run_bound(sum(_max_runtime(r.job_type) for r in requests))
    if len(requests) == 1:
        only = requests[0]
        tags[tag.KEY] = only.key
        tags[tag.REQUEST_ID] = str(only.id)
        tags[tag.DEDUPE_WINDOW] = only.dedupe
        if only.amends:
            tags[tag.AMENDS] = only.amends
        if only.correlation_id:
            tags[tag.CORRELATION_ID] = only.correlation_id
        if only.traceparent:
            tags[tag.TRACEPARENT] = only.traceparent
            tags[tag.TRACE_ID] = trace_id_of(only.traceparent) or ""
    return tags


def _max_runtime(job_type: str) -> float:
    return get_job_type(job_type).running.max_runtime_seconds


def batch_run_key(mode: IntakeMode, request_ids: Sequence[int]) -> str:
    digest = hashlib.sha256(",".join(map(str, request_ids)).encode()).hexdigest()[:12]
    return f"intake-{mode}:{request_ids[0]}-{request_ids[-1]}:{digest}"


def run_requests_for(
    requests: Sequence[JobRequest],
    policy: IntakePolicy,
    refused: dict[int, ValidationError] | None = None,
) -> tuple[list[dg.RunRequest], dict[int, str]]:
    """The RunRequests for claimed requests, and the run key each request went out under.

    A per-request payload that no longer makes a valid run (stored before a rule changed) gets
    no run: it goes into ``refused`` with its error, instead of failing the whole tick."""
    out: list[dg.RunRequest] = []
    run_keys: dict[int, str] = {}
    batches: dict[tuple[IntakeMode, str], list[JobRequest]] = {}
    for request in requests:
        mode = policy.mode_for(request.job_type)
        if mode in (IntakeMode.PER_REQUEST, IntakeMode.RESIDENT):  # resident: asked by hand
            run_key = f"intake:{request.key}"
            try:
                run_config = per_request_run_config(request)
            except ValidationError as exc:
                if refused is None:
                    raise
                refused[request.id] = exc
                continue
            out.append(
                dg.RunRequest(
                    run_key=run_key,
                    job_name=request.job_type,
                    run_config=run_config,
                    tags=_tags(mode, [request]),
                )
            )
            run_keys[request.id] = run_key
        else:
            batches.setdefault((mode, request.queue), []).append(request)
    for (mode, _queue), members in batches.items():
        for start in range(0, len(members), policy.batch_size):
            chunk = members[start : start + policy.batch_size]
            ids = sorted(r.id for r in chunk)  # the run key names the set, not the order
            run_key = batch_run_key(mode, ids)
            job_name = MICRO_BATCH_JOB if mode is IntakeMode.MICRO_BATCH else FAN_OUT_JOB
            op_name = MICRO_BATCH_OP if mode is IntakeMode.MICRO_BATCH else FAN_OUT_OP
            out.append(
                dg.RunRequest(
                    run_key=run_key,
                    job_name=job_name,
                    run_config={"ops": {op_name: {"config": {"request_ids": ids}}}},
                    tags=_tags(mode, chunk),
                )
            )
            run_keys.update({i: run_key for i in ids})
    return out, run_keys


_STEP_FAILURE = "STEP_FAILURE"
"""Dagster's ``dagster/failure_reason`` of a run a step failed (``RunFailureReason``)."""

_TERMINAL = [
    dg.DagsterRunStatus.SUCCESS,
    dg.DagsterRunStatus.FAILURE,
    dg.DagsterRunStatus.CANCELED,
]


RECONCILE_OVERLAP_SECONDS = 1.0
"""Each read starts this far before the cursor: re-reading a run is harmless (transitions are
conditional), and a run whose end committed a little after a newer one is still seen."""
_PAGE_OVERLAP_SECONDS = 0.001


@dataclass(frozen=True)
class Reconciled:
    """What a reconcile did: the new cursor, the requests it moved, and how many of those went
    back to the queue because their run ended before any step took them (a launch that failed,
    a run that died starting: what the launch throttle reads)."""

    cursor: float
    moved: int = 0
    returned: int = 0


def reconcile_runs(
    instance: dg.DagsterInstance,
    store: RequestStore,
    after: float,
    *,
    limit: int = 200,
    max_pages: int = 25,
) -> Reconciled:
    """Move requests of intake runs that ended after ``after`` (a timestamp).

    Runs are read in update-timestamp order, ``limit`` a page, paging on while pages are full
    (up to ``max_pages``; the cursor keeps the rest for the next tick). Reading by run id and
    moving the cursor to the newest end seen would skip runs created earlier that ended later
    than a page's newest: their requests would never reach completed or failed (invariant 2).
    """
    moved = returned = 0
    newest = after
    lower = max(0.0, after - RECONCILE_OVERLAP_SECONDS)
    for _ in range(max_pages):
        records = instance.get_run_records(
            filters=dg.RunsFilter(
                statuses=_TERMINAL,
                tags={tag.INTAKE: [str(m) for m in IntakeMode]},
                updated_after=datetime.fromtimestamp(lower, tz=UTC),
            ),
            limit=limit,
            order_by="update_timestamp",
            ascending=True,
        )
        for record in records:
            newest = max(newest, _timestamp(record.update_timestamp))
            done = _move_requests(store, record.dagster_run)
            moved, returned = moved + done.moved, returned + done.returned
        if len(records) < limit:
            break
        # A full page: read on from just before its newest end (ties there are read again,
        # harmlessly); the wide overlap is for the next tick. Always move forward.
        lower = max(newest - _PAGE_OVERLAP_SECONDS, lower + _PAGE_OVERLAP_SECONDS)
    return Reconciled(newest, moved, returned)


def _move_requests(store: RequestStore, run: dg.DagsterRun) -> Reconciled:
    ids = [int(i) for i in run.tags.get(tag.REQUEST_IDS, "").split(",") if i]
    run_key = run.tags.get(tag.RUN_KEY)  # only requests launched under this run's key
    if run.status == dg.DagsterRunStatus.SUCCESS:
        if run.tags.get(tag.INTAKE) != IntakeMode.PER_REQUEST:
            return Reconciled(0)
        return Reconciled(0, sum(store.mark_completed(i, run_id=run.run_id, run_key=run_key)
                                 for i in ids))
    if run.tags.get(tag.WILL_RETRY, "").lower() == "true":
        # the retry moves what it runs; a resume retry runs only the steps that were in flight,
        # so the requests no step took stay launched and are relaunched after relaunch_after
        return Reconciled(0)
    reason = run.tags.get(tag.FAILURE_REASON)
    error = f"run {run.run_id} ended {run.status.value}" + (f" ({reason})" if reason else "")
    error += " and Dagster will not retry it"
    # a run that failed around its requests (worker killed or cut off, launch failed, canceled)
    # failed nothing of theirs: those no step took go back to the queue; those a step took fail
    # transient, as the DLQ classes a run with no failed step
    step_failed = run.status == dg.DagsterRunStatus.FAILURE and reason == _STEP_FAILURE
    back, failed = store.settle_unsettled(
        ids, run_id=run.run_id, run_key=run_key, error=error,
        taken_class=None if step_failed else str(FailureClass.TRANSIENT))
    return Reconciled(0, back + failed, back)


def _timestamp(stamp: datetime) -> float:
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=UTC)
    return stamp.timestamp()


_IN_FLIGHT = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
]


def without_runs_in_flight(
    instance: dg.DagsterInstance, claimed: Sequence[JobRequest]
) -> list[JobRequest]:
    """Drop re-claimed requests whose earlier run is still queued or running.

    A request stays ``launched`` until its op starts; when the run queue is backed up past
    ``relaunch_after`` it is claimed again. Re-emitting it would put it in a new batch (a new run
    key, a second run) every time, feeding the backlog with runs that can only find the key in
    progress. It stays ``launched`` and is looked at again after the next ``relaunch_after``.
    """
    in_flight: dict[str, bool] = {}
    kept = []
    for request in claimed:
        key = request.run_key
        if key is not None and key not in in_flight:
            in_flight[key] = bool(
                instance.get_run_records(
                    dg.RunsFilter(tags={tag.RUN_KEY: key}, statuses=_IN_FLIGHT), limit=1
                )
            )
        if key is None or not in_flight[key]:
            kept.append(request)
    return kept


@dataclass(frozen=True)
class LaunchThrottle:
    """How many requests a tick may launch, from what the launcher absorbs: additive increase,
    multiplicative decrease. Requests that came back from runs that ended before any step took
    them (a launch that failed: a code server overloaded or down) halve the allowance; while
    ``max_queued`` intake runs wait in Dagster's run queue nothing more is launched; otherwise
    the allowance grows back by a tenth of ``most`` a tick. So an overloaded launcher is given
    less and less instead of the same 200 runs a tick failing over and over (their retries used
    up), and a recovered one is refilled gradually."""

    most: int
    max_queued: int = 100

    def next(self, allowed: int | None, returned: int, queued: int) -> tuple[int, int, str]:
        """(the allowance to keep, what this tick launches, why it is less than ``most``)."""
        allowed = self.most if allowed is None else allowed
        if returned:
            allowed //= 2
            return allowed, allowed, (f"{returned} request(s) came back from runs that never "
                                      f"started: launching at most {allowed} a tick")
        if queued >= self.max_queued:
            return allowed, 0, f"{queued} intake runs wait in Dagster's queue: launching none"
        grown = min(self.most, allowed + max(1, self.most // 10))
        return grown, grown, "" if grown >= self.most else f"resuming: {grown} a tick"


def evaluate_intake(
    context: dg.SensorEvaluationContext, store: RequestStore, policy: IntakePolicy
) -> dg.SensorResult:
    """One tick (see the module docstring); usable from tests with ``build_sensor_context``."""
    cursor = json.loads(context.cursor) if context.cursor else {}
    done = reconcile_runs(context.instance, store, float(cursor.get("runs_after", 0.0)))
    throttle = LaunchThrottle(policy.max_requests_per_tick, policy.max_queued_runs)
    queued = context.instance.get_runs_count(dg.RunsFilter(
        statuses=[dg.DagsterRunStatus.QUEUED], tags={tag.INTAKE: [str(m) for m in IntakeMode]}))
    allowed, now, why = throttle.next(cursor.get("allowed"), done.returned, queued)
    if why:
        log.warning("intake: %s", why)
    claimed = store.claim_for_launch(
        now,
        relaunch_after=policy.relaunch_after_seconds,
        job_types=policy.delivery.launched(),
        merge=merge_debounced,
    )
    claimed = without_runs_in_flight(context.instance, claimed)
    refused: dict[int, ValidationError] = {}
    run_requests, run_keys = run_requests_for(claimed, policy, refused)
    store.set_run_keys(run_keys)
    by_id = {r.id: r for r in claimed}
    for request_id, exc in refused.items():  # dead-lettered where the intake decides it
        request = by_id[request_id]
        announce(dead_letter_now(
            Subject(request.job_type, request.payload, request.key, request.id,
                    request.correlation_id, request.traceparent),
            exc, store, run_id=f"intake:{request.key}", step="intake_sensor", actor="intake"))
    new_cursor = json.dumps({"runs_after": done.cursor, "allowed": allowed})
    if not run_requests:
        return dg.SensorResult(
            skip_reason=f"no pending job requests launched (reconciled {done.moved}"
            + (f"; {why}" if why else "") + ")", cursor=new_cursor
        )
    log.info("intake: %d requests -> %d runs", len(claimed), len(run_requests))
    return dg.SensorResult(run_requests=run_requests, cursor=new_cursor)


def intake_sensors(
    request_jobs: Sequence[dg.JobDefinition],
    batch_jobs: Sequence[dg.JobDefinition],
    *,
    name: str = "intake_sensor",
) -> list[dg.SensorDefinition]:
    """The intake sensor over the per-request jobs and the two batch jobs given (named
    :data:`FAN_OUT_JOB` and :data:`MICRO_BATCH_JOB`); it reads the ``requests`` resource
    (:class:`RequestsResource`)."""

    @dg.sensor(
        name=name,
        jobs=[*request_jobs, *batch_jobs],
        minimum_interval_seconds=5,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Pending job_requests -> runs (per request, fan-out or micro-batch).",
    )
    def _intake(context: dg.SensorEvaluationContext, requests: RequestsResource) -> dg.SensorResult:
        return evaluate_intake(context, requests.get_store(), IntakePolicy.from_env())

    return [_intake]
