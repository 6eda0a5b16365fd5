"""The Dagster ops and jobs: one per-request job per job type (``all_jobs``), the batched intake
jobs, and ``dlq_operations``."""

from __future__ import annotations

from pipelines.jobs import email, fulfilment, inventory, payment, report
from pipelines.ops.request_job import RequestConfig, request_job

charge_payment_job = request_job(payment.JOB_TYPE)
send_email_job = request_job(email.JOB_TYPE)
reserve_inventory_job = request_job(inventory.JOB_TYPE)
rebuild_report_cache_job = request_job(report.JOB_TYPE)
fulfill_order_job = request_job(fulfilment.JOB_TYPE)

all_jobs = [
    charge_payment_job,
    send_email_job,
    reserve_inventory_job,
    rebuild_report_cache_job,
    fulfill_order_job,
]

__all__ = [
    "RequestConfig",
    "all_jobs",
    "charge_payment_job",
    "fulfill_order_job",
    "rebuild_report_cache_job",
    "reserve_inventory_job",
    "send_email_job",
]
