"""How each job type's requests reach their handler: resident workers, or Dagster runs.

- ``resident`` (the default): long-lived worker runs claim requests as they arrive and run them
  through the one step entry (:mod:`engine.worker`); nothing is launched per request. The path
  of volume: a job starts within milliseconds of its enqueue.
- ``per_request``: a Dagster run per request (the intake sensor launches it): the most visible
  in the UI and the costliest (a fresh process per run, 2.6-3.1 CPU-seconds).
- ``micro_batch`` / ``fan_out``: a Dagster run per batch of requests (one step for all, or a
  step each).

A job type may declare its own (``Running.delivery``: ``per_request`` when each of its
requests must be a run a person watches); ``SEKALI_INTAKE_MODES="send_email=micro_batch"``
overrides per job type, and ``SEKALI_INTAKE_MODE`` sets the default of the job types that
declare none. The intake sensor launches runs only for the job types not delivered by resident
workers, and the workers claim only those that are, so a request is never claimed by both.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from engine.contract import JobType
from engine.registry import JOB_TYPES
from resources.errors import ValidationError


class Delivery(StrEnum):
    RESIDENT = "resident"
    PER_REQUEST = "per_request"
    FAN_OUT = "fan_out"
    MICRO_BATCH = "micro_batch"


def _parse(variable: str, value: str) -> Delivery:
    try:
        return Delivery(value.strip())
    except ValueError:
        known = ", ".join(str(d) for d in Delivery)
        raise ValidationError(variable, f"unknown delivery {value.strip()!r} (known: {known})",
                              value) from None


@dataclass(frozen=True)
class DeliveryPolicy:
    """Which delivery each job type gets (see the module docstring)."""

    default: Delivery = Delivery.RESIDENT
    per_type: Mapping[str, Delivery] = field(default_factory=dict)

    def of(self, job_type: JobType | str) -> Delivery:
        name = job_type if isinstance(job_type, str) else job_type.name
        if name in self.per_type:
            return self.per_type[name]
        jt = JOB_TYPES.get(name) if isinstance(job_type, str) else job_type
        if jt is not None and jt.running.delivery is not None:
            return _parse("delivery", jt.running.delivery)
        return self.default

    def resident(self, queue: str | None = None,
                 job_types: Iterable[JobType] | None = None) -> list[str]:
        """The job types (of ``queue``, or all) resident workers serve, by name."""
        types = JOB_TYPES.values() if job_types is None else job_types
        return sorted(jt.name for jt in types
                      if (queue is None or jt.queue == queue) and self.of(jt) is Delivery.RESIDENT)

    def launched(self, job_types: Iterable[JobType] | None = None) -> list[str]:
        """The job types the intake sensor launches runs for, by name."""
        types = JOB_TYPES.values() if job_types is None else job_types
        return sorted(jt.name for jt in types if self.of(jt) is not Delivery.RESIDENT)

    def queues(self) -> list[str]:
        """The queues that have job types delivered by resident workers."""
        return sorted({jt.queue.value for jt in JOB_TYPES.values()
                       if self.of(jt) is Delivery.RESIDENT})

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> DeliveryPolicy:
        env = os.environ if env is None else env
        per_type: dict[str, Delivery] = {}
        for item in env.get("SEKALI_INTAKE_MODES", "").split(","):
            if not item.strip():
                continue
            job_type, _, mode = item.partition("=")
            per_type[job_type.strip()] = _parse("SEKALI_INTAKE_MODES", mode)
        raw = env.get("SEKALI_INTAKE_MODE", "").strip()
        default = _parse("SEKALI_INTAKE_MODE", raw) if raw else Delivery.RESIDENT
        return cls(default=default, per_type=per_type)
