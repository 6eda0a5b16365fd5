"""The job types sekali knows, by name: one place for the intake, the ops and the harness.

Each entry says how to validate a payload, which idempotency key names its intent, which queue
it runs on, its duration budget (``dagster/max_runtime``) and whether it has a side effect (the
doctor checks that every one with a side effect has a key).
"""

from __future__ import annotations

from pipelines.jobs import email, fulfilment, inventory, payment, report
from pipelines.jobs.base import JobType
from resources.errors import ValidationError

JOB_TYPES: dict[str, JobType] = {
    module.JOB_TYPE.name: module.JOB_TYPE
    for module in (payment, email, inventory, report, fulfilment)
}


def get_job_type(name: str) -> JobType:
    """The job type called ``name``; unknown names are a :class:`ValidationError` on ``job_type``.
    """
    try:
        return JOB_TYPES[name]
    except (KeyError, TypeError):
        raise ValidationError(
            "job_type", f"unknown job type (known: {', '.join(sorted(JOB_TYPES))})", name
        ) from None


__all__ = ["JOB_TYPES", "JobType", "get_job_type"]
