"""Personal data: which payload fields are personal, and masked views of what sekali keeps.

A job type names its personal payload fields (``Presentation.personal``, e.g. a recipient address).
Their values, and every e-mail address anywhere, are masked (:mod:`resources.telemetry.redact`)
in what outlives a request and is read by more people than its producer:

- log lines: the attempt line (:mod:`engine.attempts`) and the JSON log format;
- attempt errors (``job_attempts.error_reason``) and request errors (``last_error``);
- DLQ records: message and trace are masked when the failure is recorded
  (:func:`mask_failure`); the payload is kept as it was, since a replay needs it, and is
  masked in every view (``sekali dlq show``, ``list``: :func:`dlq_view`); so is a request's
  (``sekali requests``, ``enqueue --wait``: :func:`request_view`).

The guarantee is about what sekali writes; the payload in ``job_requests`` and in a DLQ
record's run config stays whole (the work needs it) and leaves with them under retention.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from engine.contract import JobType
from engine.registry import JOB_TYPES
from engine.requests import JobRequest
from resources.dlq import DlqRecord, FailureInfo
from resources.telemetry.redact import VALUE_MASK, redact, redact_data


def personal_fields(job_type: JobType | str | None) -> frozenset[str]:
    """The payload fields ``job_type`` marks personal (none for an unknown type)."""
    if isinstance(job_type, str):
        job_type = JOB_TYPES.get(job_type)
    return job_type.presentation.personal if job_type is not None else frozenset()


def personal_values(job_type: JobType | str | None, payload: Any) -> tuple[str, ...]:
    """The values of the personal fields in ``payload``, to be masked wherever they appear."""
    if not isinstance(payload, dict):
        return ()
    return tuple(
        str(payload[f]) for f in sorted(personal_fields(job_type)) if payload.get(f) is not None
    )


def mask_text(text: str, job_type: JobType | str | None = None, payload: Any = None) -> str:
    """``text`` with e-mail addresses and the payload's personal values masked."""
    return redact(text, personal_values(job_type, payload))


def mask_payload(job_type: JobType | str | None, payload: Any) -> Any:
    """A copy of ``payload`` for display: personal fields replaced, addresses elsewhere masked."""
    if not isinstance(payload, dict):
        return redact_data(payload)
    fields = personal_fields(job_type)
    values = personal_values(job_type, payload)
    return {
        k: VALUE_MASK if k in fields and v is not None else redact_data(v, values)
        for k, v in payload.items()
    }


def mask_failure(info: FailureInfo) -> FailureInfo:
    """The failure with its message and trace masked, as the DLQ should keep it (the payload
    and run config stay whole: a replay runs them)."""
    values = personal_values(info.job_type, info.payload)
    return replace(info, message=redact(info.message, values), trace=redact(info.trace, values))


def dlq_view(record: DlqRecord, *, summary: bool = False) -> dict[str, Any]:
    """What ``sekali dlq show`` prints of a record, masked: the summary, payload, error, trace
    (with ``summary``, what ``dlq list --json`` prints: the summary alone)."""
    values = personal_values(record.job_type, record.payload)
    short = record.summary()
    short["last_error"] = redact(short["last_error"], values)
    if summary:
        return short
    return {
        **short,
        "dedupe_key": record.dedupe_key,
        "run_id": record.run_id,
        "step": record.step,
        "correlation_id": record.correlation_id,
        "payload": mask_payload(record.job_type, record.payload),
        "last_error": redact(record.last_error or "", values),
        "trace": redact(record.trace or "", values),
    }


def request_view(request: JobRequest) -> dict[str, Any]:
    """Every field of a request record, by name (fields added to :class:`JobRequest` show up
    without edits here), with the payload's personal fields and the error masked."""
    view = {f.name: getattr(request, f.name) for f in fields(request)}
    view["status"] = str(request.status)
    view["payload"] = mask_payload(request.job_type, request.payload)
    if request.last_error:
        view["last_error"] = mask_text(request.last_error, request.job_type, request.payload)
    return view
