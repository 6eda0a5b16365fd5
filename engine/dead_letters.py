"""Dead letters written where the failure is decided.

When the one failure path gives a request up (permanent, out of attempts, time or budget, a
crash loop, refused input), the step that decided writes the request's final state and its DLQ
record in **one transaction** (:func:`dead_letter`): the record exists if and only if the
request is ``failed``, whatever dies next. No run has to fail for a request to reach the DLQ, so
a long-lived run (a resident worker) dead-letters a request and goes on; no sensor rebuilds the
failure later from Dagster's event log, run tags or run config.

The record carries what the step knew: the job type, the request (id, key, payload,
correlation and trace), the error's type, message (personal values masked:
:func:`engine.privacy.mask_failure`), innermost frame and trace, the class the failure path
decided, and the run and step that decided it. A request that failed before (a replay that
failed again) updates its one open record (``request:{id}``), counting the failure once per run
and step: a delivery that finds its key failed before
(:class:`StoredFailure`) is no new failure and leaves the record as its decision wrote it.
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass
from typing import Any

from engine.privacy import mask_failure
from engine.requests import RequestStore, close_dead_letters
from resources.dlq import DlqRecord, DlqStore, FailureInfo, dedupe_key_for, top_frame
from resources.errors import StoredFailure
from resources.retry import failure_class
from resources.telemetry.redact import loggable, redact
from resources.telemetry.tracing import inject, trace_id_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Subject:
    """What failed: the request as the step had it (its ``job_requests`` row, or a run's config
    when no row exists yet)."""

    job_type: str
    payload: Any
    key: str | None = None
    request_id: int | None = None
    correlation_id: str | None = None
    traceparent: str | None = None
    replay_of: int | None = None
    """The DLQ record a replay run serves: a failure reopens that record."""


@dataclass(frozen=True)
class DeadLetter:
    """The record a decision wrote: its id, whether this failure is new to it (else a run and
    step it had counted already), and the one line a person reads."""

    record_id: int
    new: bool
    error_class: str
    line: str
    run_id: str = ""
    correlation_id: str | None = None


def error_text(exc: BaseException) -> str:
    """How a failure is written into ``job_requests.last_error`` and batch summaries, e-mail
    addresses masked."""
    return redact(f"{type(exc).__name__} ({failure_class(exc)}): {exc}")


def failure_info(
    subject: Subject, exc: BaseException, *, run_id: str, step: str, now: float
) -> FailureInfo:
    """The DLQ's view of ``exc`` failing ``subject`` in ``run_id``/``step``, masked."""
    stack = traceback.format_exception(exc)
    return mask_failure(FailureInfo(
        job_type=subject.job_type,
        dedupe_key=dedupe_key_for(subject.job_type, request_id=subject.request_id,
                                  idempotency_key=subject.key, run_id=run_id, step=step),
        error_type=type(exc).__name__,
        message=str(exc).strip() or type(exc).__name__,
        run_id=run_id,
        error_class=failure_class(exc),
        step=step,
        frame=top_frame(traceback.format_tb(exc.__traceback__)),
        trace="".join(stack),
        idempotency_key=subject.key,
        request_id=subject.request_id,
        payload=subject.payload,
        correlation_id=subject.correlation_id,
        failed_at=now,
        dlq_id=subject.replay_of,
        trace_id=trace_id_of(subject.traceparent or inject()),
    ))


def dead_letter(
    requests: RequestStore,
    subject: Subject,
    exc: BaseException,
    *,
    run_id: str,
    step: str,
    owner: str | None = None,
    actor: str = "failure_path",
) -> DeadLetter | None:
    """The request ``failed`` and its DLQ record, in one transaction. ``owner``: only if this
    worker still holds the request (None and nothing written when it does not: the worker that
    holds it now decides). A subject without a request row gets its record alone.

    A request whose cancel waited for the holder of its key ends ``cancelled`` instead, once
    that holder gave up (:meth:`RequestStore.settle_requested_cancel`): no record, its open
    dead letters closed, None returned."""
    now = requests.clock()
    run_id = run_id or f"request:{subject.request_id}"
    info = failure_info(subject, exc, run_id=run_id, step=step, now=now)
    dlq = DlqStore(requests.db, clock=requests.clock)
    earlier = dlq.find(info.dedupe_key) if isinstance(exc, StoredFailure) else None
    with requests.db.transaction() as conn:
        error_class = earlier.error_class if earlier is not None else str(info.error_class)
        moved = subject.request_id is not None and requests.mark_failed(
            subject.request_id, error_text(exc), error_class=error_class,
            run_id=run_id, owner=owner, conn=conn,
        )
        if subject.request_id is not None and requests.settle_requested_cancel(
            subject.request_id, error_text(exc), conn=conn
        ):
            recorded = None
        elif subject.request_id is not None and not moved and owner is not None:
            return None
        elif earlier is not None:  # a delivery that found the key failed before: not a failure
            record = earlier
            return DeadLetter(record.id, False, str(record.error_class), _line(record),
                              run_id, record.correlation_id)
        else:
            recorded = dlq.record_failure(info, actor=actor, conn=conn)
    if recorded is None:  # cancelled: what a cancel of a failed request closes, closed
        assert subject.request_id is not None
        close_dead_letters(requests.db, subject.request_id, actor,
                           "the delivery holding its key gave up after a cancel")
        return None
    record = recorded.record
    return DeadLetter(record.id, recorded.new_failure, str(record.error_class), _line(record),
                      run_id, record.correlation_id)


def _line(record: DlqRecord) -> str:
    return loggable(f"{record.job_type} key={record.idempotency_key} ({record.error_class}, "
                    f"{record.error_type}) dead-lettered as {record.id}: sekali dlq show"
                    f" {record.id}")


def announce(dead: DeadLetter | None) -> None:
    """The console's line for a new dead letter (what, and the command next), logged once the
    failure's own line is out (the step's caller prints that one)."""
    if dead is not None and dead.new:
        log.warning(dead.line, extra={"sekali": {"dlq_id": dead.record_id,
                                                 "run_id": dead.run_id,
                                                 "correlation_id": dead.correlation_id}})


def dead_letter_now(subject: Subject, exc: BaseException, requests: RequestStore, **kw: Any
                    ) -> DeadLetter | None:
    """:func:`dead_letter` that never raises: the database may be the very thing that failed.
    The request row then stays as it was and is moved when its run ends (the intake, the
    supervisor); the decision stands."""
    try:
        return dead_letter(requests, subject, exc, **kw)
    except Exception:  # noqa: BLE001 - the store is away: the decision is the step's answer
        log.warning("%s key=%s: its dead letter not written now (%s)", subject.job_type,
                    loggable(str(subject.key)), type(exc).__name__, exc_info=True)
        return None
