"""Failed runs into the DLQ, and DLQ replays back into runs.

- ``dlq_sensor``: a run-failure sensor. Skips runs Dagster will retry (``dagster/will_retry``),
  and turns each failed job request into one record (per request, not per run): seeing a run
  twice changes nothing. It returns ``None`` so one tick handles up to five runs.
- ``dlq_sweep_sensor``: the safety net. A run-failure sensor alone loses records (its first tick
  only sets the cursor; a tick that raises moves the cursor past its run), so every few minutes
  this one reads FAILURE runs updated since its cursor, and ``job_requests`` marked failed with no
  record (a micro-batch failure that did not fail its step), and dead-letters what is missing.
- ``dlq_replay_sensor``: launches runs for records whose replay was requested, at most
  ``max_per_tick`` per tick and ``per_second`` on average (a token bucket kept in the cursor),
  with run keys ``dlq-replay:{id}:{n}``, the original run config and tags (so the original
  idempotency key: an effect that already happened is not repeated) plus ``sekali/dlq_id``.
  A record stored without op config (batch failures, the sweep) is replayed as a run of its
  per-request job built from the record; a record whose run cannot be built goes back to
  ``open`` with the reason in its audit; one whose request the validation boundary refuses
  (``engine/validation.py``) goes back to ``open`` as ``permanent``, with a rejection row.
  It also settles replays: a successful replay run
  resolves its record; a failed or canceled one reopens it with its count increased (the
  dlq_sensor does the same for failed runs when it sees the run first).

Every tick does a bounded amount of work whatever the number of open records: the replay
sensor reads one page (``TICK_PAGE``, ``RESOLVE_PAGE``) of each kind of record it looks at,
keeping where the next page starts in its cursor (``pages``), and ``publish`` reads the store's
change mark, then, only if it moved, a grouped count and the oldest rows
(:mod:`pipelines.assets.dead_letters`). ``benchmarks/dlq_sensor.py`` measures a tick at 10k,
100k and 500k open records.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import dagster as dg
from dagster import DagsterRunStatus, RunsFilter

from engine import tags as tag
from engine.dead_letters import Subject, announce, dead_letter_now
from engine.launch import stored_request_run_config
from engine.registry import JOB_TYPES
from engine.requests import JobRequest, RequestStatus, RequestStore
from engine.upkeep.retention import resolve_completed_page
from engine.validation import ValidationError, admit
from resources.dagster_resources import DlqResource
from resources.dlq import (
    DlqRecord,
    DlqRecordNotFound,
    DlqStatus,
    DlqStore,
    FailureClass,
    FailureInfo,
    RecordedFailure,
)
from resources.errors import RunEndedAroundRequest
from resources.idempotency import IdempotencyStore
from resources.telemetry.tracing import trace_id_of

log = logging.getLogger(__name__)

_WRAPPERS = {"DagsterExecutionStepExecutionError", "Failure", "DagsterUserCodeExecutionError"}


# -- a failed run --------------------------------------------------------------------------


def is_job_run(run: dg.DagsterRun) -> bool:
    """Runs of sekali job types and intake batches (they carry ``sekali/`` tags and are not
    DLQ operations); asset runs (reconciliation, warming, metrics) are not dead-lettered, nor
    are resident worker runs (their supervisor gives back what a dead one held)."""
    if tag.WORKER in run.tags:
        return False
    if any(tag in run.tags for tag in (tag.KEY, tag.REQUEST_ID, tag.DLQ_ID, tag.JOB_TYPE)):
        return True
    return run.job_name.startswith("intake_") or run.job_name in _job_type_names()


def _job_type_names() -> frozenset[str]:
    return frozenset(JOB_TYPES)


def will_retry(run: dg.DagsterRun) -> bool:
    return run.tags.get(tag.WILL_RETRY, "").lower() == "true"


def _replay_of(run: dg.DagsterRun) -> int | None:
    if tag.DLQ_REPLAY in run.tags and tag.DLQ_ID in run.tags:
        with contextlib.suppress(ValueError):
            return int(run.tags[tag.DLQ_ID])
    return None


def _ended_around(run: dg.DagsterRun, requests: RequestStore) -> list[JobRequest]:
    """The requests a run launched by hand or by a replay (not by the intake, whose sensor
    moves its own) held when it ended, undecided: still ``running`` under this run."""
    if tag.INTAKE in run.tags or tag.REQUEST_ID not in run.tags:
        return []
    try:
        held = requests.get(int(run.tags[tag.REQUEST_ID]))  # nosec B113: a row, not HTTP
    except ValueError:
        return []
    if held is None or held.status is not RequestStatus.RUNNING or held.run_id != run.run_id:
        return []
    return [held]


def dead_letter_run(
    instance: dg.DagsterInstance, run: dg.DagsterRun, store: DlqStore, *, actor: str
) -> list[RecordedFailure]:
    """What only Dagster knows about a failed run: link it to the records its steps wrote where
    they decided (:mod:`engine.dead_letters`), and dead-letter, ``transient``, a request the
    run held when it ended around it (its worker killed or cut off, canceled) with no decision
    (:class:`RunEndedAroundRequest`). Idempotent; skips runs Dagster will retry (the retry
    decides) and resident worker runs (their supervisor gives back what they held)."""
    if will_retry(run) or not is_job_run(run):
        return []
    requests = RequestStore(store.db)
    how = f"ended {run.status.value}"
    if run.tags.get(tag.FAILURE_REASON):
        how += f" ({run.tags[tag.FAILURE_REASON]})"
    replayed = _replay_of(run)
    held = _ended_around(run, requests)
    for request in held:
        announce(dead_letter_now(
            Subject(request.job_type, request.payload, request.key, request.id,
                    request.correlation_id, request.traceparent, replay_of=replayed),
            RunEndedAroundRequest(run.run_id, how), requests, run_id=run.run_id, step="",
            owner=run.run_id, actor=actor,
        ))
    if replayed is not None and not held and replayed not in {
            r.id for r in store.records_of_run(run.run_id)}:
        _replay_ended(store, requests, replayed, run, how, actor)
    records = store.records_of_run(run.run_id)
    link_run(instance, run, [r.id for r in records])
    return [RecordedFailure(r, False, False) for r in records]


def _replay_ended(
    store: DlqStore, requests: RequestStore, record_id: int, run: dg.DagsterRun, how: str,
    actor: str,
) -> None:
    """A replay run that ended with no decision on its request (canceled before its op ran,
    its worker killed): its record is reopened with the failure counted, never left
    ``replaying``."""
    try:
        record = store.get(record_id)
    except DlqRecordNotFound:
        return
    announce(dead_letter_now(
        Subject(record.job_type, record.payload, record.idempotency_key, record.request_id,
                record.correlation_id, replay_of=record.id),
        RunEndedAroundRequest(run.run_id, how), requests, run_id=run.run_id, step="",
        actor=actor,
    ))


def link_run(instance: dg.DagsterInstance, run: dg.DagsterRun, record_ids: Sequence[int]) -> None:
    """Point a dead-lettered run at its DLQ record(s): ``sekali/dlq_id`` (comma-separated for a
    batch run) and, on a per-request run that died before saying how it ended,
    ``sekali/outcome=dead_lettered`` (an op's own ``failed`` or ``dead_lettered`` stands). The
    record names the run (``run_id``), so the link goes both ways. Written only when it
    changes: the sweep sees runs more than once."""
    if not record_ids:
        return
    wanted = {tag.DLQ_ID: ",".join(str(i) for i in sorted(set(record_ids)))}
    if tag.DLQ_REPLAY in run.tags:  # a replay run names the record it serves already
        wanted = {}
    said = run.tags.get(tag.OUTCOME)
    if (tag.KEY in run.tags or run.job_name in JOB_TYPES) and said in (
            None, str(tag.RunOutcome.RETRIED)):  # it died before saying how it ended
        wanted[tag.OUTCOME] = str(tag.RunOutcome.DEAD_LETTERED)
    changed = {k: v for k, v in wanted.items() if run.tags.get(k) != v}
    if changed:
        instance.add_run_tags(run.run_id, changed)


def dead_letter_failed_requests(
    store: DlqStore, *, limit: int = 200, instance: dg.DagsterInstance | None = None
) -> list[RecordedFailure]:
    """Records for ``job_requests`` marked failed that have none (the sweep's second half), with
    the class the failure path stored on the request; the run that failed them (when
    ``instance`` knows it) is linked to its records (:func:`link_run`), and a request whose run
    Dagster will retry is left to that retry, as :func:`dead_letter_run` leaves the run."""
    out = []
    runs: dict[str, dg.DagsterRun | None] = {}  # a batch run's requests share it: read once

    def run_of(run_id: str | None) -> dg.DagsterRun | None:
        if instance is None or not run_id:
            return None
        if run_id not in runs:
            runs[run_id] = instance.get_run_by_id(run_id)
        return runs[run_id]

    for r in RequestStore(store.db).failed_without_dlq_record(limit):
        run = run_of(r.run_id)
        if run is not None and will_retry(run):
            continue
        last_error = r.last_error or "failed"
        error_type, _, message = last_error.partition(": ")
        error_type = error_type.split(" (", 1)[0]
        if not message or " " in error_type:
            error_type, message = "RequestFailed", last_error
        out.append(
            store.record_failure(
                FailureInfo(
                    job_type=r.job_type,
                    dedupe_key=f"request:{r.id}",
                    error_type=error_type,
                    message=message,
                    error_class=FailureClass.parse(r.error_class),
                    run_id=r.run_id or f"request:{r.id}",
                    idempotency_key=r.key,
                    request_id=r.id,
                    payload=r.payload,
                    correlation_id=r.correlation_id,
                    failed_at=r.updated_at,
                    trace_id=trace_id_of(r.traceparent),
                ),
                actor="dlq_sweep_sensor",
            )
        )
    if instance is not None:  # link each run to its records
        by_run: dict[str, list[int]] = {}
        for item in out:
            if item.record.run_id and not item.record.run_id.startswith("request:"):
                by_run.setdefault(item.record.run_id, []).append(item.record.id)
        for run_id, ids in by_run.items():
            run = run_of(run_id)
            if run is not None:
                link_run(instance, run, ids)
    return out


# -- the sensors -------------------------------------------------------------------------------


Publish = Callable[[dg.DagsterInstance, DlqStore], Any]
"""Makes the DLQ's new state visible (the code location's ``dead_letters`` asset events)."""


def build_dlq_sensor(publish: Publish, *, name: str = "dlq_sensor") -> dg.SensorDefinition:
    """The run-failure sensor: each failed job request becomes one DLQ record."""

    @dg.run_failure_sensor(
        name=name,
        description="Each failed job request becomes one DLQ record (skips runs Dagster will "
        "retry).",
        minimum_interval_seconds=15,
        default_status=dg.DefaultSensorStatus.RUNNING,
    )
    def dlq_sensor(context: dg.RunFailureSensorContext, dlq: DlqResource) -> None:
        # Returning None lets one tick handle up to five failed runs. An exception is not
        # swallowed: the tick shows as failed in the UI, and the sweep records the run skipped.
        store = dlq.get_store()
        recorded = dead_letter_run(
            context.instance, context.dagster_run, store, actor="dlq_sensor"
        )
        if any(r.new_failure for r in recorded):
            publish(context.instance, store)

    return dlq_sensor


SWEEP_OVERLAP_SECONDS = 600.0


def sweep(
    instance: dg.DagsterInstance, store: DlqStore, cursor: float | None, *, limit: int = 200
) -> tuple[int, int, float | None]:
    """One sweep: (failed runs examined, new records, next cursor). It also ends the cancels
    that waited for a holder of the key that ended without deciding (killed), once its lease
    ran out (:meth:`RequestStore.settle_waiting_cancels`)."""
    after = (
        None if cursor is None else datetime.fromtimestamp(cursor - SWEEP_OVERLAP_SECONDS, tz=UTC)
    )
    records = instance.get_run_records(
        filters=RunsFilter(statuses=[DagsterRunStatus.FAILURE], updated_after=after),
        limit=limit,
        order_by="update_timestamp",
        ascending=True,
    )
    created = 0
    next_cursor = cursor
    for record in records:
        created += sum(
            r.created
            for r in dead_letter_run(instance, record.dagster_run, store, actor="dlq_sweep_sensor")
        )
        stamp = record.update_timestamp.timestamp()
        next_cursor = stamp if next_cursor is None else max(next_cursor, stamp)
    created += sum(
        r.created for r in dead_letter_failed_requests(store, limit=limit, instance=instance)
    )
    RequestStore(store.db).settle_waiting_cancels(actor="dlq_sweep_sensor", limit=limit)
    if len(records) >= limit and next_cursor is not None:
        next_cursor += SWEEP_OVERLAP_SECONDS  # page on; the overlap is only for the quiet case
    return len(records), created, next_cursor


def build_dlq_sweep_sensor(
    publish: Publish, *, name: str = "dlq_sweep_sensor"
) -> dg.SensorDefinition:
    """The safety net of the run-failure sensor (see the module)."""

    @dg.sensor(
        name=name,
        description="Safety net for dlq_sensor: dead-letters failed runs and requests it missed.",
        minimum_interval_seconds=300,
        default_status=dg.DefaultSensorStatus.RUNNING,
    )
    def dlq_sweep_sensor(
        context: dg.SensorEvaluationContext, dlq: DlqResource
    ) -> dg.SkipReason:
        cursor = float(context.cursor) if context.cursor else None
        store = dlq.get_store()
        examined, created, next_cursor = sweep(context.instance, store, cursor)
        if next_cursor is not None:
            context.update_cursor(repr(next_cursor))
        if created:
            publish(context.instance, store)
        return dg.SkipReason(f"swept {examined} failed runs; {created} new DLQ records")

    return dlq_sweep_sensor


class ReplayRate:
    """A token bucket kept in the sensor cursor: ``per_second`` on average, ``burst`` at most at
    once, never more than ``max_per_tick`` in one tick. Time comes from ``clock``."""

    def __init__(self, *, per_second: float, burst: float, max_per_tick: int) -> None:
        if per_second <= 0 or burst < 1 or max_per_tick < 1:
            raise ValueError("per_second > 0, burst >= 1 and max_per_tick >= 1 are required")
        self.per_second = per_second
        self.burst = burst
        self.max_per_tick = max_per_tick

    def allowance(self, state: dict[str, float] | None, now: float) -> tuple[int, float]:
        """(how many may start now, tokens left before spending)."""
        if not state:
            tokens = self.burst
        else:
            elapsed = max(0.0, now - state["at"])
            tokens = min(self.burst, state["tokens"] + elapsed * self.per_second)
        return min(self.max_per_tick, math.floor(tokens)), tokens


class ReplayNotBuildable(ValueError):
    """The record holds no valid run for its job (no such per-request job, no payload, or a
    config the job rejects). The replay sensor reopens such a record and says why."""


def replay_run_config(record: DlqRecord, requests: RequestStore) -> dict[str, Any]:
    """The per-request job's config serving the record's request: its id only (the op reads
    the payload from ``job_requests``, kept while the record is unresolved; no payload value
    goes into Dagster's run storage). A record whose request has no row (refused at a run
    launched by hand before it became one) gets one first, from the payload the record keeps,
    written ``failed`` so only this replay takes it."""
    if record.request_id is not None and requests.get(record.request_id) is not None:  # nosec B113: a row, not HTTP
        return stored_request_run_config(record.job_type, record.request_id)
    jt = JOB_TYPES.get(record.job_type)
    if not isinstance(record.payload, dict) or jt is None:
        raise ReplayNotBuildable(
            f"DLQ record {record.id} ({record.job_type}) has no request and no payload a run"
            " of a known job type can take; fix and re-enqueue the request, or discard it"
        )
    try:
        clean = jt.validate(dict(record.payload))
        key = record.idempotency_key or jt.keying.key_for(clean)
    except ValidationError as exc:
        raise ReplayNotBuildable(
            f"DLQ record {record.id} ({record.job_type}): its payload is not valid ({exc});"
            " fix and re-enqueue the request, or discard it"
        ) from exc
    row = requests.record_run(jt.name, key, clean, queue=jt.queue, source="dlq_replay",
                              run_id=None, status=RequestStatus.FAILED,
                              correlation_id=record.correlation_id)
    if row is None:
        raise ReplayNotBuildable(
            f"DLQ record {record.id}: its key {key} is stored with another payload; replay the"
            " request stored under it, or discard this record")
    return stored_request_run_config(record.job_type, row.id)


def replay_run_request(
    record: DlqRecord, requests: RequestStore,
    jobs: Mapping[str, dg.JobDefinition] | None = None,
) -> dg.RunRequest:
    """The run of a replay: the original job, config and tags, a new deterministic run key.
    With ``jobs`` (the sensor's targets by name) the job must be one of them and the config
    must be valid for it, else :class:`ReplayNotBuildable`."""
    run_config = replay_run_config(record, requests)
    if jobs is not None:
        job = jobs.get(record.job_type)
        if job is None:
            raise ReplayNotBuildable(
                f"DLQ record {record.id}: job {record.job_type!r} is not a per-request job"
                f" the replay sensor can launch ({', '.join(sorted(jobs))})"
            )
        try:
            dg.validate_run_config(job, run_config)
        except dg.DagsterInvalidConfigError as exc:
            raise ReplayNotBuildable(
                f"DLQ record {record.id}: invalid run config for {record.job_type}: {exc}"
            ) from exc
    tags = {k: v for k, v in record.tags.items() if not k.startswith(tag.DAGSTER_PREFIX)}
    tags.update({tag.DLQ_ID: str(record.id), tag.DLQ_REPLAY: str(record.replay_count)})
    if record.idempotency_key and tag.KEY not in tags:
        tags[tag.KEY] = record.idempotency_key
    if record.request_id is not None and tag.REQUEST_ID not in tags:
        tags[tag.REQUEST_ID] = str(record.request_id)
    if record.correlation_id and tag.CORRELATION_ID not in tags:
        tags[tag.CORRELATION_ID] = record.correlation_id
    return dg.RunRequest(
        run_key=record.replay_run_key,
        job_name=record.job_type,
        run_config=run_config,
        tags=tags,
    )


def admit_replay(record: DlqRecord, requests: RequestStore) -> None:
    """The request a replay would run, through the validation boundary (way in ``dlq_replay``):
    the job type, payload, key and ids the record keeps. A refusal keeps one rejection row and
    raises :class:`ValidationError`."""
    admit(
        requests,
        record.job_type,
        record.payload,
        record.idempotency_key,
        source="dlq_replay",
        request_id=record.request_id,
        correlation_id=record.correlation_id,
    )


def _replay_or_refuse(
    store: DlqStore, record: DlqRecord, jobs: Mapping[str, dg.JobDefinition] | None
) -> list[dg.RunRequest]:
    """The record's RunRequest, or none and the record back to ``open``: an invalid request
    would fail the tick and leave the record ``replaying`` (re-emitted every relaunch). A
    request the validation boundary refuses is refused for good: the record becomes
    ``permanent`` (a replay cannot help; fix and re-enqueue, or discard)."""
    try:
        if record.job_type in JOB_TYPES:  # the request of a per-request job: the boundary first
            admit_replay(record, RequestStore(store.db))
        run_request = replay_run_request(record, RequestStore(store.db), jobs)
    except ReplayNotBuildable as exc:
        log.warning("replay of DLQ record %d refused: %s", record.id, exc)
        store.refuse_replay(record.id, actor="dlq_replay_sensor", detail=str(exc)[:2000])
        return []
    except ValidationError as exc:
        log.warning("replay of DLQ record %d refused (permanent): %s", record.id, exc)
        store.refuse_replay(
            record.id,
            actor="dlq_replay_sensor",
            detail=f"permanent: {exc}; fix the request and enqueue it again, or discard this"
            " record",
            error_class=FailureClass.PERMANENT,
        )
        return []
    return [run_request]


TICK_PAGE = 200
"""Records of one kind a replay-sensor tick reads at most (``replaying`` ones to settle, stale
ones to re-emit); the next tick reads the next page, from its cursor."""


def next_page(page: Sequence[DlqRecord], limit: int) -> int:
    """Where the page after ``page`` starts: its last id, or 0 (the oldest again) after the
    last page."""
    return page[-1].id if len(page) >= limit else 0


def settle_replays(
    instance: dg.DagsterInstance, store: DlqStore, *, after_id: int = 0, limit: int = TICK_PAGE
) -> tuple[int, int, int]:
    """Resolve records whose replay run succeeded, reopen those whose replay failed or was
    canceled (an operator's cancel would otherwise leave the record ``replaying`` for good).
    One page of ``replaying`` records (ids above ``after_id``); returns (resolved, reopened,
    where the next page starts)."""
    replaying = store.list_records(status=DlqStatus.REPLAYING, after_id=after_id, limit=limit)
    following = next_page(replaying, limit)
    if not replaying:
        return 0, 0, following
    by_id = {r.id: r for r in replaying}
    runs = instance.get_runs(
        filters=RunsFilter(
            tags={tag.DLQ_ID: [str(i) for i in by_id]},
            statuses=[
                DagsterRunStatus.SUCCESS,
                DagsterRunStatus.FAILURE,
                DagsterRunStatus.CANCELED,
            ],
        )
    )
    resolved = reopened = 0
    for run in runs:
        record = by_id.get(int(run.tags[tag.DLQ_ID]))
        if record is None or run.tags.get(tag.DLQ_REPLAY) != str(record.replay_count):
            continue
        if run.status == DagsterRunStatus.SUCCESS:
            resolved += store.resolve(
                record.id, actor="dlq_replay_sensor", detail=f"replay run {run.run_id} succeeded"
            )
        elif not will_retry(run):
            reopened += sum(
                r.new_failure
                for r in dead_letter_run(instance, run, store, actor="dlq_replay_sensor")
            )
    return resolved, reopened, following


def build_dlq_replay_sensor(
    jobs: Sequence[dg.JobDefinition],
    publish: Publish,
    *,
    name: str = "dlq_replay_sensor",
    max_per_tick: int = 20,
    per_second: float = 1.0,
    burst: float | None = None,
    relaunch_after: float = 600.0,
    minimum_interval_seconds: int = 30,
    clock: Callable[[], float] = time.time,
) -> dg.SensorDefinition:
    """The replay sensor with its rate bound over ``jobs`` (every job type's per-request job:
    replays target the original job); tests build one with their own ``clock``."""
    jobs = list(jobs)
    targets = {j.name: j for j in jobs if isinstance(j, dg.JobDefinition)} or None
    rate = ReplayRate(
        per_second=per_second, burst=burst or max(1.0, per_second), max_per_tick=max_per_tick
    )

    @dg.sensor(
        name=name,
        jobs=jobs or None,
        minimum_interval_seconds=minimum_interval_seconds,
        description=f"Launches requested DLQ replays, at most {max_per_tick} per tick and "
        f"{per_second}/s (run keys dlq-replay:{{id}}:{{n}}).",
        default_status=dg.DefaultSensorStatus.RUNNING,
    )
    def _sensor(context: dg.SensorEvaluationContext, dlq: DlqResource) -> dg.SensorResult:
        store = dlq.get_store()
        state = json.loads(context.cursor) if context.cursor else None
        pages = dict((state or {}).get("pages") or {})
        resolved, reopened, pages["settle"] = settle_replays(
            context.instance, store, after_id=int(pages.get("settle", 0))
        )
        # a record whose key completed (a late retry, a relaunch, or the worker that died after
        # completing it): its intent is done, launch nothing
        done, pages["resolve"] = resolve_completed_page(
            store, IdempotencyStore(store.db), RequestStore(store.db), actor="dlq_replay_sensor",
            after_id=int(pages.get("resolve", 0)),
        )
        resolved += len(done)
        now = clock()
        allowed, tokens = rate.allowance(state, now)
        stale, pages["stale"] = _stale_replays(
            context.instance, store, now - relaunch_after, after_id=int(pages.get("stale", 0))
        )
        requests = [
            request for r in stale for request in _replay_or_refuse(store, r, targets)
        ]
        allowed = max(0, allowed - len(requests))
        requests += [
            request
            for r in store.claim_for_replay(allowed)
            for request in _replay_or_refuse(store, r, targets)
        ]
        tokens -= len(requests)
        context.update_cursor(json.dumps({"tokens": tokens, "at": now, "pages": pages}))
        publish(context.instance, store)
        if not requests:
            return dg.SensorResult(
                skip_reason=dg.SkipReason(
                    f"no replay requested; resolved {resolved}, reopened {reopened}"
                )
            )
        return dg.SensorResult(run_requests=requests)

    return _sensor


def _stale_replays(
    instance: dg.DagsterInstance,
    store: DlqStore,
    cutoff: float,
    *,
    after_id: int = 0,
    limit: int = TICK_PAGE,
) -> tuple[list[DlqRecord], int]:
    """Records left ``replaying`` with no run (a tick that claimed and then died): re-emitted
    under the same run key, which Dagster dedupes if the run does exist. One page of
    ``replaying`` records; returns the stale ones and where the next page starts."""
    page = store.list_records(status=DlqStatus.REPLAYING, after_id=after_id, limit=limit)
    following = next_page(page, limit)
    stale = [r for r in page if r.status_changed_at <= cutoff]
    if not stale:
        return [], following
    seen = {
        (run.tags.get(tag.DLQ_ID), run.tags.get(tag.DLQ_REPLAY))
        for run in instance.get_runs(
            filters=RunsFilter(tags={tag.DLQ_ID: [str(r.id) for r in stale]})
        )
    }
    return [r for r in stale if (str(r.id), str(r.replay_count)) not in seen], following


def dlq_sensors(
    jobs: Sequence[dg.JobDefinition], publish: Publish
) -> list[dg.SensorDefinition]:
    """The three DLQ sensors of a code location: run failures, the sweep, and replays of
    ``jobs`` (its per-request jobs); each calls ``publish`` after it changed the DLQ."""
    return [
        build_dlq_sensor(publish),
        build_dlq_sweep_sensor(publish),
        build_dlq_replay_sensor(jobs, publish),
    ]
