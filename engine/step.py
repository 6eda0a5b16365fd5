"""The step entry: what one delivery of one or many requests runs, wherever it is delivered.

Batch-first. :func:`run_steps` takes the requests one step runs: one for a per-request Dagster
op (:mod:`pipelines.ops.request_job`), up to N for a micro-batch op, a resident worker's claim
(:mod:`engine.worker`), or a chaos worker's delivery. Every one of them gets the same path: the
validation boundary, the request's status (taken ``running``), the claim of its key, the
concurrency slots (taken by the handler through its context), the handler, the one failure
decision (:class:`engine.failures.FailurePath` with the services' :class:`RetryPolicy` and the
shared :class:`RetryBudget`), and the request settled from that decision: completed, given
back for a retry, or failed with its DLQ record in one transaction
(:mod:`engine.dead_letters`). No lock is taken around it: the idempotency claim and its fence
are the only mutual exclusion.

Who retries a request whose attempt failed transiently is the caller's (:class:`Retry`):
Dagster re-running the step (the per-request op), the request given back to the queue with its
delay (a resident worker: its run goes on), or nobody here (a micro-batch op: re-running its
step would re-run its finished neighbours; a DLQ replay retries).

Nothing here raises for a failed attempt. Each :class:`StepResult` carries the error, the
decision already recorded and what settling did, and the caller turns it into its own signal
(Dagster's ``RetryRequested`` / ``Failure``, a run event, a broker's requeue).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from engine.attempts import Outcome
from engine.dead_letters import DeadLetter, Subject, announce
from engine.failures import FailurePath, Settled, error_text
from engine.registry import JOB_TYPES
from engine.requests import JobRequest, RequestStatus, RequestStore
from engine.runtime import BatchRequest, RequestOutcome, execute_batch, execute_request
from engine.services import Services
from engine.validation import Admitted, ValidationError, admit, check_id
from resources.errors import RequestCancelled
from resources.retry import RetryDecision
from resources.telemetry.redact import loggable

logger = logging.getLogger(__name__)


class Retry(StrEnum):
    """Who retries a request whose attempt failed transiently, and how."""

    IN_STEP = "in_step"
    """The caller runs the step again after the decision's delay (Dagster's
    ``RetryRequested``); the request stays ``running`` meanwhile."""
    REQUEUE = "requeue"
    """The request goes back to ``pending``, claimable after the delay (a resident worker:
    its run goes on with other requests)."""
    DLQ = "dlq"
    """No retry within this step: the decision gives up at once and the request is
    dead-lettered (a micro-batch op: re-running its step would re-run its finished
    neighbours)."""


@dataclass(frozen=True)
class StepAttempt:
    """Which attempt this is: the run (a Dagster run, a worker run, a broker's delivery), the
    step, and the 0-based attempt number of the step (Dagster's ``retry_number``). The
    policy's time budget counts from the first recorded attempt of the same run and step,
    unless a request says when it first started."""

    run_id: str
    step: str
    attempt: int = 0


@dataclass(frozen=True)
class StepRequest(Subject):
    """One request as a step takes it: a ``job_requests`` row (:meth:`of`), or a run's config
    when the run was launched by hand (no row yet: ``request_id`` None). It is also what its
    dead letter is of (:class:`engine.dead_letters.Subject`)."""

    attempt: int | None = None
    """The request's own 0-based attempt (a resident worker's claim counts them on the row);
    None: the step's."""
    first_started: float | None = None
    """When the request's first attempt began, for the policy's time budget (None: the step's
    first attempt, from ``job_attempts``)."""

    @classmethod
    def of(cls, row: JobRequest, *, claimed: bool = False) -> StepRequest:
        """The request of a row; ``claimed``: a resident worker's claim, which counted this
        attempt on the row (the attempt number and the time budget are the request's own)."""
        return cls(
            row.job_type, row.payload, row.key, row.id, row.correlation_id, row.traceparent,
            attempt=max(0, row.attempts - 1) if claimed else None,
            first_started=row.claimed_at if claimed else None,
        )


@dataclass(frozen=True)
class StepResult:
    """How one request's attempt ended: ``outcome`` on success (``completed``, ``duplicate``,
    ``cancelled``); else the ``error``, the path's ``decision`` on it (retry with a delay, or
    give up with a reason), the attempt's recorded outcome (retried, dead_lettered or
    failed_permanent), and what settling did (``dead_letter``, ``retry_at``). ``skipped``: the
    request was not taken (another run completed it first)."""

    outcome: RequestOutcome | None = None
    error: BaseException | None = None
    decision: RetryDecision | None = None
    recorded: Outcome | None = None
    path: FailurePath | None = None
    request: StepRequest | None = None
    dead_letter: DeadLetter | None = None
    retry_at: float | None = None
    skipped: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None


OnFailure = Callable[[StepResult], None]


def failure_path(
    services: Services, job_type: str, at: StepAttempt, request: StepRequest | None = None,
    *, retry: Retry = Retry.IN_STEP,
) -> FailurePath:
    """The failure path of this attempt: the services' policy and budget, the job type's
    downstream (an unknown type fails in the runtime, naming the field), the request's attempt
    and first start (else the step's) for the policy."""
    known = JOB_TYPES.get(job_type)
    attempt = at.attempt if request is None or request.attempt is None else request.attempt
    first = request.first_started if request is not None else None
    return FailurePath(
        attempt=attempt,
        policy=services.retry_policy,
        budget=services.retry_budget,
        downstream=known.calls.budget if known is not None else None,
        retries_here=retry is not Retry.DLQ,
        follow=lambda declared: services.retry_policy_for(
            known.calls.budget if known is not None else None, declared),
        first_started=(lambda: first) if first is not None else (
            lambda: services.attempts.first_started(at.run_id, at.step)),
    )


def run_steps(
    services: Services,
    at: StepAttempt,
    requests: Sequence[StepRequest],
    *,
    retry: Retry = Retry.IN_STEP,
    source: str = "run_config",
    owner: str | None = None,
    run_untaken: bool = False,
    on_failure: OnFailure | None = None,
) -> list[StepResult]:
    """Run the requests of one step together; one request's failure never stops another.

    1. Admit each (:func:`admit_step`): a refusal runs nothing and is dead-lettered, permanent;
       what was admitted runs as it was normalised, not checked again.
    2. Take the rows ``running`` in one statement (``owner``: a worker's claim took them
       already), unless cancelled meanwhile (then nothing runs: ``cancelled``); a row already
       completed is skipped, or with ``run_untaken`` (a run that asked for this one request)
       still run, so the ledger answers with the stored result (``duplicate``).
    3. Execute: one request through :func:`engine.runtime.execute_request` (its handler runs
       alone), several through :func:`engine.runtime.execute_batch` (keys claimed and
       completed in one statement each, the job type's ``handler_many``).
    4. Settle: the completed in one statement; each failure from its decision
       (:meth:`FailurePath.settle`, by ``retry``), told to ``on_failure`` once settled.

    Returns one :class:`StepResult` per request, in order.
    """
    store = RequestStore(services.db)
    requests = [replace(r, payload=_plain(r.payload)) for r in requests]
    results: list[StepResult | None] = [None] * len(requests)
    admitted: list[int] = []
    clean: dict[int, dict[str, Any]] = {}
    for i, request in enumerate(requests):
        refused, passed = _admit(services, at, request, source=source, retry=retry, owner=owner)
        if passed is not None:
            admitted.append(i)
            requests[i] = replace(request, key=passed.key)
            clean[i] = passed.payload
        elif refused is not None:
            results[i] = _told(refused, on_failure)
    run = _take(services, store, at, requests, admitted, results, owner=owner,
                run_untaken=run_untaken, retry=retry, on_failure=on_failure)
    paths = {i: failure_path(services, requests[i].job_type, at, requests[i], retry=retry)
             for i in run}
    outcomes = _execute(services, at, [requests[i] for i in run], [clean[i] for i in run],
                        [paths[i] for i in run])
    done: list[int] = []
    for i, outcome in zip(run, outcomes, strict=True):
        if isinstance(outcome, RequestOutcome):
            results[i] = StepResult(outcome=outcome, request=requests[i])
            if requests[i].request_id is not None:
                done.append(i)
        elif isinstance(outcome, RequestCancelled):  # stopped at a cancel point: not a failure
            _settle(store, paths[i], requests[i], outcome, at, owner, retry)
            results[i] = StepResult(outcome=cancelled(outcome.key, outcome.detail),
                                    request=requests[i])
        else:
            results[i] = _told(_decided(store, paths[i], requests[i], outcome, at, owner, retry),
                               on_failure)
    if done:
        _complete(store, at, requests, done, results, paths, owner=owner, retry=retry,
                  on_failure=on_failure)
    return [r if r is not None else StepResult(skipped=True) for r in results]


def run_step(
    services: Services,
    at: StepAttempt,
    *,
    job_type: str,
    payload: Any,
    key: str | None = None,
    request_id: int | None = None,
    correlation_id: str | None = None,
    source: str = "run_config",
    on_failure: OnFailure | None = None,
    replay_of: int | None = None,
) -> StepResult:
    """One request in a step of its own, as the per-request op runs it (:func:`run_steps`
    with one request, retried by the caller, run even when its row was completed before)."""
    request = StepRequest(job_type, payload, key, request_id, correlation_id,
                          replay_of=replay_of)
    return run_steps(services, at, [request], source=source, run_untaken=True,
                     on_failure=on_failure)[0]


def admit_step(
    services: Services,
    at: StepAttempt,
    request: StepRequest,
    *,
    source: str,
    retry: Retry = Retry.IN_STEP,
    owner: str | None = None,
) -> StepResult | None:
    """The validation boundary before a step runs a request it did not get from ``enqueue``
    (a run's config, a delivery, a row read back). None: admitted. A refusal runs nothing: it
    is kept in ``job_rejections``, recorded as a ``failed_permanent`` attempt, and the request
    is dead-lettered (permanent, never retried). ``request.job_type`` is the step's own."""
    return _admit(services, at, request, source=source, retry=retry, owner=owner)[0]


def _admit(
    services: Services, at: StepAttempt, request: StepRequest, *, source: str, retry: Retry,
    owner: str | None,
) -> tuple[StepResult | None, Admitted | None]:
    """:func:`admit_step`, and what was admitted: the payload as the job type normalised it
    (executed without a second check) and the key, the one it named, else its job type's, so
    that a failure's dead letter names the key (it pins the key against the retention purge
    while open, and reconciliation judges the record by it)."""
    requests = RequestStore(services.db)
    payload = _plain(request.payload)
    try:
        admitted = admit(requests, request.job_type, payload, request.key, source=source,
                         request_id=request.request_id, correlation_id=request.correlation_id,
                         kept_elsewhere=True)
    except ValidationError as exc:
        path = failure_path(services, request.job_type, at, request, retry=retry)
        row_id = request.request_id if request.request_id is not None and _is_row_id(
            request.request_id) else None
        refused = replace(request, request_id=row_id, payload=payload,
                          key=request.key if isinstance(request.key, str) else None)
        try:
            record = services.attempts.new(  # the refused attempt is recorded (invariant 6)
                request.job_type, attempt=path.attempt, run_id=at.run_id, step=at.step,
                request_id=row_id,
            )
            services.attempts.finish(
                record, path.outcome(exc), error=exc,
                error_kind=str(path.decide(exc).error_class),
            )
        except Exception:  # noqa: BLE001 - the store is away: the refusal stays permanent
            logger.warning("refused %s: its attempt row not written now", request.job_type,
                           exc_info=True)
        return _decided(requests, path, refused, exc, at, owner, retry), None
    return None, admitted


def _take(
    services: Services, store: RequestStore, at: StepAttempt, requests: Sequence[StepRequest],
    admitted: list[int], results: list[StepResult | None], *, owner: str | None,
    run_untaken: bool, retry: Retry, on_failure: OnFailure | None,
) -> list[int]:
    """Which admitted requests run: their rows taken ``running`` (a worker's claim did it).
    The database away: every row's request fails through the one path (nothing has run)."""
    rows = {rid: i for i in admitted if (rid := requests[i].request_id) is not None}
    if owner is not None or not rows:
        return admitted
    try:
        taken = store.mark_running_many(sorted(rows), run_id=at.run_id)
        untaken = store.get_many(sorted(set(rows) - taken))
    except Exception as exc:  # noqa: BLE001 - the database is away: the path decides
        for i in rows.values():
            path = failure_path(services, requests[i].job_type, at, requests[i], retry=retry)
            results[i] = _told(StepResult(error=exc, decision=path.decide(exc),
                                          recorded=path.outcome(exc), path=path,
                                          request=requests[i]), on_failure)
        return [i for i in admitted if i not in rows.values()]
    skip: set[int] = set()
    for row in untaken:
        i = rows[row.id]
        if not run_untaken:  # a batch's: completed or cancelled before this step took it
            results[i] = StepResult(skipped=True, request=requests[i])
            skip.add(i)
        elif row.status is RequestStatus.CANCELLED:  # cancelled before this run started it
            results[i] = StepResult(
                outcome=cancelled(row.key, row.cancel_detail or "cancelled before it ran"),
                request=requests[i])
            skip.add(i)
    return [i for i in admitted if i not in skip]


def _execute(
    services: Services, at: StepAttempt, requests: list[StepRequest],
    payloads: list[dict[str, Any]], paths: list[FailurePath],
) -> list[RequestOutcome | Exception]:
    """Each request's outcome or the exception its attempt failed with (already recorded);
    ``payloads`` as the step admitted them."""
    if not requests:
        return []
    if len(requests) == 1:
        request, path = requests[0], paths[0]
        try:
            return [execute_request(
                request.job_type, payloads[0], services=services, key=request.key,
                run_id=at.run_id, step=at.step, attempt=path.attempt,
                correlation_id=request.correlation_id, request_id=request.request_id,
                decide=path.outcome, traceparent=request.traceparent,
            )]
        except Exception as exc:  # noqa: BLE001 - every failure goes through the one path
            return [exc]
    return execute_batch(
        [BatchRequest(r.job_type, payload, key=r.key, correlation_id=r.correlation_id,
                      request_id=r.request_id, decide=p.outcome, traceparent=r.traceparent,
                      attempt=p.attempt)
         for r, payload, p in zip(requests, payloads, paths, strict=True)],
        services=services, run_id=at.run_id, step=at.step, attempt=at.attempt,
    )


def _complete(
    store: RequestStore, at: StepAttempt, requests: Sequence[StepRequest], done: list[int],
    results: list[StepResult | None], paths: dict[int, FailurePath], *, owner: str | None,
    retry: Retry, on_failure: OnFailure | None,
) -> None:
    """The completed rows in one statement. When it cannot be written, each is a failure to
    retry (a retry finds its key completed: a suppressed duplicate moves it)."""
    ids = [rid for i in done if (rid := requests[i].request_id) is not None]
    try:
        store.mark_completed_many(ids, run_id=at.run_id, owner=owner)
    except Exception as exc:  # noqa: BLE001 - the key completed, its row did not move
        for i in done:
            path = paths[i]
            results[i] = _told(StepResult(error=exc, decision=path.decide(exc),
                                          recorded=path.outcome(exc), path=path,
                                          request=requests[i]), on_failure)


def _decided(
    store: RequestStore, path: FailurePath, request: StepRequest, exc: BaseException,
    at: StepAttempt, owner: str | None, retry: Retry,
) -> StepResult:
    """The result of a failed attempt, its request settled from the path's decision."""
    settled = _settle(store, path, request, exc, at, owner, retry)
    return StepResult(error=exc, decision=path.decide(exc), recorded=path.outcome(exc),
                      path=path, request=request, dead_letter=settled.dead_letter,
                      retry_at=settled.retry_at)


def _settle(
    store: RequestStore, path: FailurePath, request: StepRequest, exc: BaseException,
    at: StepAttempt, owner: str | None, retry: Retry,
) -> Settled:
    """Settle the request from the decision already made. Its database may be the very thing
    that failed: the decision stands without it, the row stays ``running`` and is moved when
    its run ends (the intake, the workers' supervisor)."""
    try:
        return path.settle(store, request, exc, run_id=at.run_id, step=at.step,
                           owner=owner, requeue=retry is Retry.REQUEUE)
    except Exception:  # noqa: BLE001 - the database is away: the decision is the step's answer
        logger.warning("request %s: its row not settled now (%s); the decision stands",
                       request.request_id, path.decide(exc).reason or "giving up", exc_info=True)
        return Settled()


def _told(result: StepResult, on_failure: OnFailure | None) -> StepResult:
    """Tell the caller about a failed attempt (its own line first), then announce its dead
    letter."""
    if on_failure is not None and result.error is not None:
        on_failure(result)
    announce(result.dead_letter)
    return result


def summary(results: Sequence[StepResult]) -> dict[str, Any]:
    """Counts per outcome of a step's results (``completed``, ``duplicate``, ``cancelled``,
    ``failed``, ``retrying``, ``skipped``), the failed keys with their errors, and the DLQ
    records written: what a batch step reports."""
    out: dict[str, Any] = dict.fromkeys(
        ("completed", "duplicate", "failed", "retrying", "skipped", "cancelled"), 0)
    failures: dict[str, str] = {}
    dead: list[int] = []
    for result in results:
        if result.skipped:
            out["skipped"] += 1
        elif result.outcome is not None:
            status = result.outcome.status
            out[status if status in out else "completed"] += 1
        elif result.retry_at is not None:
            out["retrying"] += 1
        else:
            out["failed"] += 1
            assert result.error is not None
            key = result.request.key if result.request is not None else None
            failures[str(key)] = error_text(result.error)
            if result.dead_letter is not None:
                dead.append(result.dead_letter.record_id)
    out["failures"] = failures
    out["dead_letters"] = dead
    return out


def run_batch(
    store: RequestStore,
    request_ids: list[int],
    *,
    services: Services,
    run_id: str | None = None,
    step: str | None = None,
    attempt: int = 0,
) -> dict[str, Any]:
    """A micro-batch of requests by id (the micro-batch op, the benchmarks): read from
    ``job_requests``, run together by :func:`run_steps` with no retry within the step (a
    failure is dead-lettered; a DLQ replay retries it), and summarised (:func:`summary`)."""
    rows = store.get_many(request_ids)
    at = StepAttempt(run_id=run_id or "micro_batch", step=step or "execute_request_batch",
                     attempt=attempt)
    results = run_steps(services, at, [StepRequest.of(r) for r in rows], retry=Retry.DLQ,
                        source="micro_batch")
    for result in results:
        if result.error is not None and result.request is not None:
            logger.warning("request %s (%s) failed: %s", result.request.request_id,
                           loggable(str(result.request.key)), loggable(error_text(result.error)))
    return summary(results)


def cancelled(key: str, detail: str) -> RequestOutcome:
    """The outcome of a step whose request was cancelled: status ``cancelled``, no effect."""
    return RequestOutcome("cancelled", {"detail": detail}, key, 0, "")


def _plain(payload: Any) -> Any:
    """A typed run config's payload model as the plain map the job type validates."""
    if callable(getattr(payload, "model_dump", None)):
        return payload.model_dump(mode="json")
    return payload


def _is_row_id(value: Any) -> bool:
    try:
        check_id("request_id", value)
    except ValidationError:
        return False
    return True
