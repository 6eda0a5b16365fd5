"""The Dagster ops and jobs: one per-request job per registered job type (``all_jobs``, in the
registry's order; ``jobs_by_name`` by job type, and ``<job type>_job`` as a module attribute),
the batched intake jobs, and ``dlq_operations``. Nothing here names a job type: adding one adds
its job."""

from __future__ import annotations

import dagster as dg

from engine.registry import JOB_TYPES
from pipelines.ops.request_job import RequestConfig, request_job

jobs_by_name = {name: request_job(jt) for name, jt in JOB_TYPES.items()}
all_jobs = list(jobs_by_name.values())


def __getattr__(name: str) -> dg.JobDefinition:
    """``charge_payment_job`` and the like: the per-request job of a registered job type."""
    job = jobs_by_name.get(name.removesuffix("_job")) if name.endswith("_job") else None
    if job is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return job


__all__ = ["RequestConfig", "all_jobs", "jobs_by_name"]
