"""``execute_request``: the one code path every job runs through (per-request op, intake batch
ops, DLQ replay, chaos harness).

For one request it: validates the payload (a :class:`ValidationError` names the field and is
permanent; a payload a step admitted, :class:`engine.validation.AdmittedPayload`, is not checked
again), derives the idempotency key, claims it (a completed key returns its stored result:
``duplicate``) under the lease its observed durations call for (:mod:`engine.durations`),
runs the job type's handler under a lease keeper that heartbeats, lets the
handler complete the key inside its final business transaction, and records the attempt in
``job_attempts`` with its outcome. On failure it records the error on the claim
(``store.fail(claim, exc, "permanent" | "transient")``; transient releases the key for the
retry), records the attempt with the outcome its :class:`engine.failures.FailurePath` decided,
and raises the original exception: the caller's failure path says how it is retried. The
attempt is recorded before the step succeeds or fails, never after: the record is the evidence
the ack relies on.

A holder whose lease was taken over while it worked (it was paused past its lease, another worker
took the key) raises :class:`LeaseLost`, chained to whatever it was failing with: its own error
means nothing now, the retry finds the key completed by the new owner (a suppressed duplicate)
or still in progress, and nothing is dead-lettered in the new owner's name.

A handler is bounded by its job type's ``max_runtime_seconds``, counted from just before the
claim, whoever runs it (a Dagster op, a resident worker, the chaos harness, a caller of its
own): it runs in a thread of its own (:func:`run_bounded`) while the caller's thread waits for
it up to the bound. At the bound the handler is abandoned: its keeper renews no more (the lease
runs out within the bound + one lease, then a redelivery takes the key over and counts the
abandoned holder towards the crash-loop bound), its send bound has ended (a late
``confirm_lease()`` raises, so nothing is sent), its late writes through the context are
refused, and the attempt fails with :class:`HandlerTimedOut` (``timed_out`` in the DLQ,
permanent: not retried) without waiting for the thread. Python cannot stop a thread: the
abandoned one lives on until its call returns or its process ends, holding whatever it holds
(a connection, a transaction's row locks, a concurrency slot until its lease). So where the
engine owns the process it ends it: a resident worker ends itself after the batch
(:class:`engine.worker.ResidentWorker`), a per-request run ends with its op, the chaos worker
exits; a caller of its own should do the same.

A job type that declares ``Running.exclusive`` has its handler run holding the lock of that
resource (:meth:`engine.context.JobContext.exclusive`), taken after the claim in the handler's
bounded thread and released when it returns; the handler then writes with the lock's fence.

Outcomes recorded: completed, duplicate_suppressed, retried, failed_permanent, dead_lettered
(via ``decide``), lease_lost, in_progress_elsewhere.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import queue
import socket
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from engine.attempts import Attempt, Outcome
from engine.context import CancelWatch, JobContext, batch_slots
from engine.contract import JobType
from engine.failures import FailurePath
from engine.privacy import personal_values
from engine.registry import get_job_type
from engine.requests import RequestStore
from engine.services import Services
from engine.validation import AdmittedPayload
from resources.errors import (
    AlreadyInProgress,
    CrashLoop,
    HandlerTimedOut,
    LeaseLost,
    StoredFailure,
)
from resources.idempotency import BatchLeaseKeeper, Claim, Completed
from resources.retry import ErrorClass, classify
from resources.telemetry.tracing import inject, set_attributes, span, traced, tracing_enabled

logger = logging.getLogger(__name__)
T = TypeVar("T")

Decide = Callable[[BaseException], str]
"""Maps a failure to the outcome to record: ``retried``, ``dead_lettered`` or
``failed_permanent``: :meth:`engine.failures.FailurePath.outcome`."""


@dataclass(frozen=True)
class RequestOutcome:
    """How a request ended without an exception."""

    status: str  # "completed" | "duplicate"
    result: Any
    key: str
    fence: int
    attempt_id: str


def _worker() -> dict[str, str]:
    return {"worker": f"{socket.gethostname()}:{os.getpid()}"}


@traced(
    "sekali.execute", parent="traceparent", fixed=_worker,
    attributes={"job_type": "job_type", "idempotency_key": "key", "run_id": "run_id",
                "step": "step", "attempt": "attempt", "request_id": "request_id",
                "correlation_id": "correlation_id"},
)
def execute_request(
    job_type: str,
    payload: dict[str, Any],
    *,
    services: Services,
    key: str | None = None,
    run_id: str | None = None,
    step: str | None = None,
    attempt: int = 0,
    correlation_id: str | None = None,
    request_id: int | None = None,
    decide: Decide | None = None,
    traceparent: str | None = None,
) -> RequestOutcome:
    """Run one request of ``job_type`` once per key. See the module docstring.

    The whole attempt is the ``sekali.execute`` span (key, resource, attempt, worker, fence,
    outcome): a child of ``traceparent`` (the request's own trace, in a batch of many) or else
    of the caller's current span (the run's).
    """
    jt = get_job_type(job_type)
    decide = decide or FailurePath(attempt=attempt).outcome
    personal = personal_values(jt, payload)
    record = services.attempts.new(
        jt.name,
        attempt=attempt,
        run_id=run_id,
        step=step or jt.op_name,
        correlation_id=correlation_id,
        request_id=request_id,
        idempotency_key=key,
        traceparent=inject(),
        personal=personal,
    )
    asked = time.monotonic()
    try:
        clean, key = _prepare(jt, record, payload, key)
        started = time.perf_counter()
        lease = services.lease_for(jt)
        with span("ledger.claim", idempotency_key=key):
            claimed = services.store.begin(key, payload=clean, lease_seconds=lease.seconds)
        record.add_duration("claim", time.perf_counter() - started)
    except Exception as exc:  # noqa: BLE001 - recorded, then raised again by _refused
        raise _refused(services, record, exc, decide)  # noqa: B904 - the same error, recorded
    if isinstance(claimed, Completed):
        return _duplicate(services, record, claimed)

    _claimed(record, claimed)
    services.attempts.start(record)
    ctx = JobContext(
        services=services, claim=claimed, attempt=record, payload=clean,
        correlation_id=correlation_id, declared_lease=lease.declared,
    )
    try:
        check_crash_loop(services, claimed, record)
        bound = jt.running.max_runtime_seconds
        with services.store.keep_alive(claimed, confirmed_at=asked, runtime=bound) as keeper:
            ctx.keeper = keeper
            ctx.cancel_point("start")
            typed = jt.typed(clean)
            try:
                result = run_bounded(functools.partial(_run_handler, jt, ctx, typed),
                                     until=asked + bound, name=f"handler:{key}")
            except Overran as late:
                raise HandlerTimedOut(key, bound, where=late.where) from None
            finally:
                keeper.met()
            if not ctx.completed:  # once completed, a late heartbeat's "lost" means nothing
                keeper.check()
                started = time.perf_counter()
                with span("ledger.complete", idempotency_key=key, fence=claimed.fence):
                    services.store.complete(claimed, result)
                record.add_duration("complete", time.perf_counter() - started)
    except Exception as exc:  # noqa: BLE001 - recorded, then raised again by _failed
        raise _failed(services, record, claimed, exc, decide)  # noqa: B904 - see _failed
    _finish(services, record, Outcome.COMPLETED)
    if jt.calls.budget and services.retry_budget is not None:
        with contextlib.suppress(Exception):
            services.retry_budget.refund(jt.calls.budget)
    return RequestOutcome("completed", result, key, claimed.fence, record.attempt_id)


@dataclass(frozen=True)
class BatchRequest:
    """One request of a micro-batch, as :func:`execute_request` takes it."""

    job_type: str
    payload: dict[str, Any]
    key: str | None = None
    correlation_id: str | None = None
    request_id: int | None = None
    decide: Decide | None = None
    traceparent: str | None = None
    attempt: int | None = None
    """This request's own 0-based attempt (a resident worker's claim); None: the batch's."""


@dataclass
class _Item:
    index: int
    request: BatchRequest
    record: Attempt
    decide: Decide
    clean: dict[str, Any] = field(default_factory=dict)
    key: str = ""
    claim: Claim | None = None
    ctx: JobContext | None = None


def execute_batch(
    requests: Sequence[BatchRequest],
    *,
    services: Services,
    run_id: str | None = None,
    step: str | None = None,
    attempt: int = 0,
) -> list[RequestOutcome | Exception]:
    """:func:`execute_request` for a micro-batch, with the same guarantees for every request,
    in as few statements as the batch allows: the keys are claimed in one statement
    (``begin_many``), the attempts recorded and finished together, the leases kept by one
    thread, the job type's ``handler_many`` (if any) runs the effects in as few transactions or
    connections as the job type allows, and the keys not completed by their handler complete in
    one statement (``complete_many``).

    Returns one entry per request, in order: its :class:`RequestOutcome`, or the exception
    :func:`execute_request` would have raised (returned, not raised; already recorded through
    the request's ``decide``): one request's failure never stops its neighbours.
    """
    out: list[RequestOutcome | Exception] = [Exception("not run")] * len(requests)
    by_type: dict[str, list[int]] = {}
    for i, request in enumerate(requests):
        by_type.setdefault(request.job_type, []).append(i)
    for job_type, indexes in by_type.items():
        try:
            jt = get_job_type(job_type)
        except Exception as exc:  # noqa: BLE001 - an unknown job type: each request fails as it would
            for i in indexes:
                out[i] = _unknown(services, requests[i], exc, run_id, step, attempt)
            continue
        items = [
            _Item(
                i,
                requests[i],
                services.attempts.new(
                    jt.name,
                    attempt=_attempt_of(requests[i], attempt),
                    run_id=run_id,
                    step=step or jt.op_name,
                    correlation_id=requests[i].correlation_id,
                    request_id=requests[i].request_id,
                    idempotency_key=requests[i].key,
                    personal=personal_values(jt, requests[i].payload),
                    traceparent=requests[i].traceparent,
                ),
                requests[i].decide or FailurePath(attempt=attempt).outcome,
            )
            for i in indexes
        ]
        while items:  # a key twice in one batch: its second request runs in the next round
            seen: set[str] = set()
            now: list[_Item] = []
            later: list[_Item] = []
            for item in items:
                try:
                    item.clean, item.key = _prepare(
                        jt, item.record, item.request.payload, item.request.key
                    )
                except Exception as exc:  # noqa: BLE001 - this request fails, the batch goes on
                    out[item.index] = _refused(services, item.record, exc, item.decide)
                    continue
                (later if item.key in seen else now).append(item)
                seen.add(item.key)
            _run_batch(jt, now, out, services)
            items = later
    return out


def _attempt_of(request: BatchRequest, batch_attempt: int) -> int:
    return batch_attempt if request.attempt is None else request.attempt


def check_crash_loop(services: Services, claim: Claim, record: Attempt) -> None:
    """Refuse to run a key whose workers died mid-run more than ``services.crash_loop_limit``
    times (:class:`CrashLoop`, permanent: the failure path stores it on the key and
    dead-letters it as ``crash_loop``), with the dead attempts as evidence."""
    if claim.crashes <= services.crash_loop_limit:
        return
    dead = [
        {"run_id": row["run_id"], "worker": f"{row['host']}:{row['pid']}", "fence": row["fence"],
         "step": row["step"], "started_at": row["started_at"]}
        for row in services.attempts.for_key(claim.key)
        if row["outcome"] == "started" and row["attempt_id"] != record.attempt_id
    ][-10:]
    if dead:
        dead[-1]["reached"] = claim.recovery_point
    raise CrashLoop(claim.key, claim.crashes, services.crash_loop_limit, dead)


def _run_batch(jt: JobType, items: list[_Item], out: list[Any], services: Services) -> None:
    if not items:
        return
    asked = time.monotonic()
    started = time.perf_counter()
    lease = services.lease_for(jt)
    try:
        answers = services.store.begin_many([(item.key, item.clean) for item in items],
                                            lease_seconds=lease.seconds)
    except Exception as exc:  # noqa: BLE001 - the store is down: every claim fails as begin would
        for item in items:
            out[item.index] = _refused(services, item.record, exc, item.decide)
        return
    took = time.perf_counter() - started
    claimed: list[_Item] = []
    for item, answer in zip(items, answers, strict=True):
        item.record.add_duration("claim", took)
        if isinstance(answer, Exception):
            out[item.index] = _refused(services, item.record, answer, item.decide)
        elif isinstance(answer, Completed):
            out[item.index] = _duplicate(services, item.record, answer)
        else:
            item.claim = answer
            _claimed(item.record, answer)
            claimed.append(item)
    if not claimed:
        return
    services.attempts.start_many([item.record for item in claimed])
    claims = [item.claim for item in claimed if item.claim is not None]
    results: list[Any] = [None] * len(claimed)
    cancels = CancelWatch(RequestStore(services.db), [item.key for item in claimed])
    with services.store.keep_alive_many(claims, confirmed_at=asked) as keeper:
        for item in claimed:
            assert item.claim is not None
            item.ctx = JobContext(
                services=services, claim=item.claim, attempt=item.record, payload=item.clean,
                correlation_id=item.request.correlation_id,
                keeper=keeper.keeper_for(item.claim), cancels=cancels,
                declared_lease=lease.declared,
            )
        fresh, suspects = _triage(services, claimed, results)
        _round(jt, services, keeper, claimed, fresh, results)
        for n in suspects:
            try:
                services.store.run_alone(_claim(claimed[n]))
            except LeaseLost as lost:
                results[n] = lost
                continue
            _round(jt, services, keeper, claimed, [n], results)
        for item in claimed:
            keeper.release(_claim(item).key)
    done = []
    for item, result in zip(claimed, results, strict=True):
        assert item.claim is not None
        if isinstance(result, Exception):
            out[item.index] = _failed(
                services, item.record, item.claim, result, item.decide, solo=False)
        else:
            out[item.index] = RequestOutcome(
                "completed", result, item.key, item.claim.fence, item.record.attempt_id
            )
            done.append(item)
    services.attempts.finish_many([(item.record, Outcome.COMPLETED, None, None) for item in done])
    if done and jt.calls.budget and services.retry_budget is not None:
        with contextlib.suppress(Exception):
            services.retry_budget.refund(jt.calls.budget, successes=len(done))


def _triage(
    services: Services, claimed: list[_Item], results: list[Any]
) -> tuple[list[int], list[int]]:
    """Split a batch's claims: (fresh ones, run together; suspects, each run alone after them).
    A suspect is a takeover (its last holder died or stalled with the key in hand, maybe in a
    group, so maybe because of it); suspects already counted as crashers run last, so a known
    crasher that dies again takes no innocent suspect with it. A key over the crash-loop
    limit does not run: its result is the :class:`CrashLoop`; nor does a cancelled one (its
    :class:`RequestCancelled`)."""
    fresh: list[int] = []
    suspects: list[int] = []
    for n, item in enumerate(claimed):
        claim = _claim(item)
        try:
            check_crash_loop(services, claim, item.record)
            if item.ctx is not None:
                item.ctx.cancel_point("start")  # as in execute_request
        except Exception as exc:  # noqa: BLE001 - a crash loop, cancelled, or the store down
            results[n] = exc
            continue
        (suspects if claim.takeover else fresh).append(n)
    suspects.sort(key=lambda n: _claim(claimed[n]).crashes)
    return fresh, suspects


def _round(
    jt: JobType, services: Services, keeper: BatchLeaseKeeper, claimed: list[_Item],
    part: list[int], results: list[Any],
) -> None:
    """Run and complete the requests ``part`` (indexes into ``claimed``) together, so a death
    in a later round finds them done."""
    if not part:
        return
    items = [claimed[n] for n in part]
    got = _handle(jt, keeper, items)
    _complete(services, items, got)
    for n, result in zip(part, got, strict=True):
        results[n] = result


def _handle(jt: JobType, keeper: BatchLeaseKeeper, items: list[_Item]) -> list[Any]:
    """Every claimed request's result or exception, through ``handler_many`` when the job type
    has one (under the batch's concurrency slots: :func:`batch_slots`), else ``handler`` one by
    one (each holds its own slot). Each handler is bounded from its own start (the requests of
    a batch run one after another); ``handler_many`` by one bound for its group, which names
    no culprit when it overruns (:class:`HandlerTimedOut` with ``alone`` False, unless the
    group is one request)."""
    pairs = [(item.ctx, jt.typed(item.clean)) for item in items if item.ctx is not None]
    bound = jt.running.max_runtime_seconds
    if jt.running.handler_many is not None:
        results: list[Any] = [None] * len(pairs)
        with batch_slots(jt, [ctx for ctx, _ in pairs]) as refused:
            run = [n for n in range(len(pairs)) if n not in refused]
            for n, error in refused.items():
                results[n] = error
            if run:
                group = [pairs[n] for n in run]
                until = min(keeper.bound(ctx.key, bound) for ctx, _ in group)
                for n, result in zip(run, _handle_many(jt, group, until), strict=True):
                    results[n] = result
                for ctx, _ in group:
                    keeper.met(ctx.key)
        return results
    results = []
    for ctx, typed in pairs:
        until = keeper.bound(ctx.key, bound)
        try:
            results.append(run_bounded(functools.partial(_run_handler, jt, ctx, typed),
                                       until=until, name=f"handler:{ctx.key}"))
        except Overran as late:
            results.append(HandlerTimedOut(ctx.key, bound, where=late.where))
        except Exception as exc:  # noqa: BLE001 - this request's failure, not the batch's
            results.append(exc)
        keeper.met(ctx.key)
    return results


def _run_handler(jt: JobType, ctx: JobContext, typed: Any) -> Any:
    """The handler, holding its job type's exclusive resource if it declares one
    (:meth:`JobContext.exclusive`), inside the handler's bounded thread: the lock is taken
    after the claim and released when the handler returns."""
    with ctx.exclusive(jt):
        return jt.handler(ctx, typed)


def _handle_many(jt: JobType, pairs: list[tuple[JobContext, Any]], until: float) -> list[Any]:
    handle_many = jt.running.handler_many
    assert handle_many is not None
    try:
        results = run_bounded(lambda: handle_many(pairs), until=until,
                              name=f"handler_many:{jt.name}")
    except Overran as late:
        return [HandlerTimedOut(ctx.key, jt.running.max_runtime_seconds, where=late.where,
                                alone=len(pairs) == 1) for ctx, _ in pairs]
    except Exception as exc:  # noqa: BLE001 - the hook failed as a whole: so did each request
        return [exc] * len(pairs)
    if len(results) != len(pairs):
        error = RuntimeError(f"{jt.name}.handler_many returned {len(results)} results")
        return [error] * len(pairs)
    return list(results)


def _complete(services: Services, items: list[_Item], results: list[Any]) -> None:
    """Complete, in one statement, every key whose handler succeeded without completing it;
    a lost lease or a failed write becomes that request's result."""
    todo = []
    for n, (item, result) in enumerate(zip(items, results, strict=True)):
        if isinstance(result, Exception) or item.ctx is None or item.ctx.completed:
            continue
        try:
            item.ctx.check_lease()
        except LeaseLost as lost:
            results[n] = lost
            continue
        todo.append(n)
    if not todo:
        return
    started = time.perf_counter()
    try:
        answers: list[Exception | None] = list(
            services.store.complete_many([(_claim(items[n]), results[n]) for n in todo])
        )
    except Exception as exc:  # noqa: BLE001 - the store is down: none of them completed
        answers = [exc] * len(todo)
    took = time.perf_counter() - started
    for n, answer in zip(todo, answers, strict=True):
        items[n].record.add_duration("complete", took)
        if answer is not None:
            results[n] = answer


def _claim(item: _Item) -> Claim:
    assert item.claim is not None
    return item.claim


def _prepare(
    jt: JobType, record: Attempt, payload: dict[str, Any], key: str | None
) -> tuple[dict[str, Any], str]:
    if isinstance(payload, AdmittedPayload) and payload.job_type == jt.name:
        clean: dict[str, Any] = payload  # admitted at the step's boundary: not checked again
    else:
        clean = jt.validate(dict(payload or {}))
    key = key or jt.keying.key_for(clean)
    record.idempotency_key = key
    record.resource_id = jt.keying.resource_id(clean)
    set_attributes(idempotency_key=key, resource_id=record.resource_id)
    return clean, key


def _refused(
    services: Services, record: Attempt, exc: Exception, decide: Decide
) -> Exception:
    """Record an attempt that got no claim; returns the exception to raise."""
    if isinstance(exc, AlreadyInProgress):
        _finish(services, record, Outcome.IN_PROGRESS_ELSEWHERE, exc)
    elif isinstance(exc, StoredFailure):
        _finish(services, record, Outcome.FAILED_PERMANENT, exc)
    else:
        _finish(services, record, decide(exc), exc)
    return exc


def _unknown(
    services: Services,
    request: BatchRequest,
    exc: Exception,
    run_id: str | None,
    step: str | None,
    attempt: int,
) -> Exception:
    record = services.attempts.new(
        request.job_type, attempt=attempt, run_id=run_id, step=step,
        correlation_id=request.correlation_id, request_id=request.request_id,
        idempotency_key=request.key,
    )
    return _refused(services, record, exc, request.decide or FailurePath(attempt=attempt).outcome)


def _duplicate(services: Services, record: Attempt, done: Completed) -> RequestOutcome:
    set_attributes(fence=done.fence)
    if tracing_enabled():
        original = services.attempts.effect_traceparent(done.key)
        with span("sekali.duplicate", links=[original] if original else None):
            set_attributes(fence=done.fence)
    record.fence = done.fence
    record.claim_attempt = done.attempt
    record.status_before = record.status_after = "completed"
    _finish(services, record, Outcome.DUPLICATE_SUPPRESSED)
    return RequestOutcome("duplicate", done.result, done.key, done.fence, record.attempt_id)


def _claimed(record: Attempt, claim: Claim) -> None:
    record.fence = claim.fence
    record.claim_attempt = claim.attempt
    record.takeover = claim.takeover
    set_attributes(fence=claim.fence, takeover=claim.takeover)


def _failed(
    services: Services, record: Attempt, claim: Claim, exc: Exception, decide: Decide,
    *, solo: bool = True,
) -> Exception:
    """Record a claimed attempt's failure on its claim and attempt; returns what to raise (the
    error, or :class:`LeaseLost` chained to it when the key was taken over meanwhile).
    ``solo``: the claim ran its handler alone (a per-request claim), so a takeover counted it
    as a crash, which a :class:`LeaseLost` here takes back (the holder stalled, it did not
    die); a batch's members stay counted (conservative)."""
    if isinstance(exc, LeaseLost):
        if solo:
            _stalled(services, claim)
        _finish(services, record, Outcome.LEASE_LOST, exc)
        return exc
    if isinstance(exc, HandlerTimedOut):
        _abandoned(services, claim, exc, solo)
        _finish(services, record, decide(exc), exc)
        return exc
    kind = "permanent" if classify(exc) is ErrorClass.PERMANENT else "transient"
    try:
        services.store.fail(claim, exc, kind)
    except LeaseLost as lost:
        if solo:
            _stalled(services, claim)
        _finish(services, record, Outcome.LEASE_LOST, exc)
        lost.__cause__ = exc
        return lost
    except Exception:  # noqa: BLE001 - the store is down: the lease expires on its own
        logger.exception("could not record the failure of %s on its claim", claim.key)
    _finish(services, record, decide(exc), exc)
    return exc


def _abandoned(services: Services, claim: Claim, exc: HandlerTimedOut, solo: bool) -> None:
    """A handler abandoned at its bound keeps its claim as it is: nothing is written on the key
    (its thread may still be in a call it started in time), so the key passes on only once the
    last lease has run out, to a takeover. A handler that ran alone is then counted as a crash
    towards the crash-loop bound: a per-request claim always is; a batch's member that overran
    alone is made so here (:meth:`IdempotencyStore.run_alone`); a group that overran together
    counts none (it names no culprit: its members are retried, each alone)."""
    logger.error("%s", exc)
    if solo or not exc.alone:
        return
    try:
        services.store.run_alone(claim)
    except Exception:  # noqa: BLE001 - taken over already, or the store away: nothing to count
        logger.warning("could not mark the abandoned holder of %s as alone", claim.key)


def _stalled(services: Services, claim: Claim) -> None:
    """A per-request holder that learns its key was taken over is alive: its takeover does not
    count towards the crash-loop bound (:meth:`IdempotencyStore.survived`)."""
    try:
        services.store.survived(claim)
    except Exception:  # noqa: BLE001 - the store is away: the count stays (conservative)
        logger.warning("could not take back the crash counted for %s", claim.key)


def _finish(
    services: Services, record: Attempt, outcome: str, error: BaseException | None = None
) -> None:
    set_attributes(outcome=outcome)
    kind = str(classify(error)) if error is not None else None
    services.attempts.finish(record, outcome, error=error, error_kind=kind)


class Overran(Exception):
    """:func:`run_bounded`'s call was still running at its bound; ``where`` it was."""

    def __init__(self, where: str) -> None:
        super().__init__(where)
        self.where = where


def run_bounded(fn: Callable[[], T], *, until: float, name: str) -> T:
    """Run ``fn`` in a daemon thread of its own and wait for it until ``until`` (monotonic):
    its result, or its exception re-raised here; :class:`Overran` when it is still running
    then (the thread is abandoned, not stopped: Python cannot stop a thread, so it runs on
    until its call returns or its process ends, and whatever it raises or returns then is
    only logged). The thread carries the caller's context variables (the trace).

    Threads that returned in time are kept for the next call (:class:`_Runner`), since
    starting one per call cost more CPU than handing work to one already there; an abandoned
    thread is never given another call."""
    box: dict[str, Any] = {}
    done = threading.Event()
    context = contextvars.copy_context()

    def job() -> bool:
        threading.current_thread().name = name
        try:
            box["result"] = context.run(fn)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            box["error"] = exc
        finally:
            done.set()
        if box.get("abandoned"):
            logger.warning("%s, abandoned at its bound, ended late: %s", name,
                           box.get("error", "returned"))
            return False
        return True

    runner = _Runner.take()
    runner.work.put(job)
    if done.wait(max(0.0, until - time.monotonic())):
        _Runner.keep(runner)
    else:
        box["abandoned"] = True
        if not done.is_set():
            raise Overran(_where(runner.thread))
    if "error" in box:
        raise box["error"]
    return box["result"]  # type: ignore[no-any-return]


class _Runner:
    """A daemon thread that runs :func:`run_bounded`'s calls, one at a time. It goes back to
    the idle ones (at most :attr:`IDLE`) when its call returned in time, and ends once a call
    it was abandoned on returns (or with its process, if that call never does). A call that
    returns in the instant between its bound and the caller's second look is answered, and its
    thread, not kept, may wait for work for good: a daemon thread, idle. A forked child starts
    with none (the parent's threads are not in it)."""

    IDLE = 32
    _idle: list[_Runner] = []
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.work: queue.SimpleQueue[Callable[[], bool] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="handler", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while (job := self.work.get()) is not None:
            if not job():
                return

    @classmethod
    def take(cls) -> _Runner:
        with cls._lock:
            if cls._idle:
                return cls._idle.pop()
        return cls()

    @classmethod
    def keep(cls, runner: _Runner) -> None:
        with cls._lock:
            if len(cls._idle) < cls.IDLE:
                cls._idle.append(runner)
                return
        runner.work.put(None)

    @classmethod
    def forget(cls) -> None:
        cls._idle = []
        cls._lock = threading.Lock()


os.register_at_fork(after_in_child=_Runner.forget)


_LIBRARIES = tuple(sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib"))


def _where(thread: threading.Thread) -> str:
    """Where ``thread`` is now: the innermost frame of code outside the standard library and
    installed packages (the job type's own), and the innermost frame if that is elsewhere."""
    frame = sys._current_frames().get(thread.ident or -1)
    if frame is None:
        return "unknown"
    stack = traceback.extract_stack(frame)
    inner = stack[-1]
    own = next((f for f in reversed(stack) if not f.filename.startswith(_LIBRARIES)
                and not f.filename.endswith(("engine/runtime.py",))), inner)

    def shown(f: traceback.FrameSummary) -> str:
        try:
            path = str(Path(f.filename).resolve().relative_to(Path.cwd()))
        except ValueError:
            path = f.filename
        return f"{path}:{f.lineno} in {f.name}"

    return shown(own) if own is inner else f"{shown(own)} (waiting in {shown(inner)})"
