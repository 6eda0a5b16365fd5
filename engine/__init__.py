"""The job platform: what a job type declares and the one path every request takes.

No business word and no Dagster here: the job types live in the code location
(``pipelines.jobs``, and the modules named in ``SEKALI_JOB_MODULES``) and are found by the
registry; the Dagster adapter, the CLI and the proof stand above. Public names:

- the contract a job type module writes against: :class:`JobType` and its option groups
  (:class:`Keying`, :class:`Running` with :class:`Exclusive`, :class:`Calls`,
  :class:`FlowControl` with :class:`Concurrency`, :class:`Upkeep`, :class:`Presentation`), the
  :class:`Queue`, :class:`PayloadField`,
  the payload model's :class:`Check`, ``formatted`` keys, the lookup hook's :class:`Effect`
  and :data:`Lookup`, :class:`Debounce`, :class:`LeaseBounds`, :class:`Retained`,
  :class:`Downstream`, :class:`ClientOptions`, :class:`Sandbox`, the hook protocols
  :class:`Reconciling` and :class:`Tally`, the handler's :class:`JobContext`, ``crash_point``,
  ``fenced`` and ``fenced_update`` (the one fence check), ``batch_slots`` and ``in_lanes``,
  ``SEND_TRIES`` and the ``require_*`` / ``reject_unknown`` checks; what the chaos proof asks
  of a type (:class:`ChaosProof`, :class:`ChaosCase`, :class:`ChaosCount`, :class:`NaiveRun`);
- the registry: :func:`get_job_type`, ``JOB_TYPES``, :func:`downstreams`;
- the ways in: :func:`enqueue` (intake) and :func:`execute_request` (the one execution path),
  with the :class:`Services` they run on.
"""

from engine.chaos import ChaosCase, ChaosCount, ChaosProof, NaiveRun
from engine.context import SEND_TRIES, JobContext, batch_slots, in_lanes
from engine.contract import (
    Calls,
    Concurrency,
    Debounce,
    Effect,
    Exclusive,
    FlowControl,
    JobType,
    Keying,
    Lookup,
    PayloadField,
    Presentation,
    Queue,
    Reconciling,
    Retained,
    Running,
    Tally,
    Upkeep,
    crash_point,
    fenced,
    fenced_update,
    formatted,
    reject_unknown,
    require_int,
    require_str,
)
from engine.downstreams import ClientOptions, Downstream, Sandbox
from engine.durations import LeaseBounds
from engine.intake import enqueue
from engine.payloads import Check
from engine.registry import JOB_TYPES, downstreams, get_job_type
from engine.runtime import execute_request
from engine.services import Services

__all__ = [
    "JOB_TYPES",
    "SEND_TRIES",
    "Calls",
    "ChaosCase",
    "ChaosCount",
    "ChaosProof",
    "Check",
    "ClientOptions",
    "Concurrency",
    "Debounce",
    "Downstream",
    "Effect",
    "Exclusive",
    "FlowControl",
    "JobContext",
    "JobType",
    "Keying",
    "LeaseBounds",
    "NaiveRun",
    "Lookup",
    "PayloadField",
    "Presentation",
    "Queue",
    "Reconciling",
    "Retained",
    "Running",
    "Sandbox",
    "Services",
    "Tally",
    "Upkeep",
    "batch_slots",
    "crash_point",
    "downstreams",
    "enqueue",
    "execute_request",
    "fenced",
    "fenced_update",
    "formatted",
    "get_job_type",
    "in_lanes",
    "reject_unknown",
    "require_int",
    "require_str",
]
