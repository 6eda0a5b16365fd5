"""The resident worker job: a Dagster run that stays, claiming and running requests of one
queue through the engine (:class:`engine.worker.ResidentWorker`) until its lifetime, its idle
bound or a termination ends it. The workers' supervisor sensor (:mod:`sensors.workers`) keeps
``SEKALI_WORKERS`` of them alive per queue.

What the run's page shows: one event at most every ``SEKALI_WORKER_PROGRESS`` second(s) with
what the worker did since the last (requests by id, counts per outcome, the dead letters it
wrote), so a run's event log grows with its lifetime, not with the traffic; the output's
metadata sums its life. Each request names the run that executed it (``job_requests.run_id``,
``sekali requests show``), and so does each dead letter.

A handler that hangs is abandoned at its job type's bound and dead-lettered ``timed_out``; the
worker then ends after its batch (:class:`engine.worker.ResidentWorker`), so the run and its
process end with the hung thread, and the supervisor launches a fresh run for the slot.

Termination (the UI's "Terminate", run monitoring): the signal waits for the batch in hand
(:func:`deferred_interrupts`), so a batch is never cut between a send and its record; the
worker then stops claiming and the run ends CANCELED. A worker killed outright leaves its
requests ``running`` under its run: the supervisor gives them back once the run has ended.
"""

# No `from __future__ import annotations`: Dagster reads the op config annotations at runtime.
import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import dagster as dg
import pydantic

from engine import tags as tag
from engine.step import StepResult
from engine.worker import ResidentWorker, WorkDone, WorkerPolicy
from pipelines.ops.batch import SERVICE_RESOURCE_KEYS
from pipelines.ops.failures import failure_line, step_services
from resources.dagster_resources import PlainDocs
from sensors.workers import WORKER_JOB, WORKER_OP


class WorkerConfig(PlainDocs, dg.Config):
    """Which queue the worker serves."""

    queue: str = pydantic.Field(
        default="light", description="The queue whose job types this worker runs: heavy or light.")


_STOPPING = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold the signals that end a run (SIGINT, SIGTERM) until the block ends, then deliver
    them to the handlers that were in place (Dagster's: the run ends CANCELED). Off the main
    thread, where handlers cannot be set, the block runs as is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {s: signal.getsignal(s) for s in _STOPPING}
    for sig in _STOPPING:
        signal.signal(sig, lambda signo, _frame: received.append(signo))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if received:
            os.kill(os.getpid(), received[0])


@dg.op(
    name=WORKER_OP,
    required_resource_keys=set(SERVICE_RESOURCE_KEYS),
    tags={"kind": "sekali-worker"},
)
def resident_worker(context: dg.OpExecutionContext, config: WorkerConfig) -> dict[str, Any]:
    """Claim and run the queue's requests until a bound ends the worker (module docstring)."""
    services = step_services(context, WORKER_OP)
    policy = WorkerPolicy.from_env(config.queue)

    def report(batch: WorkDone) -> None:
        context.log.info(f"{config.queue} worker: {batch.line()}")

    def failed(result: StepResult) -> None:  # the console's line, as a per-request run prints
        request, path = result.request, result.path
        assert request is not None and path is not None and result.error is not None
        assert result.decision is not None
        context.log.warning(failure_line(request.job_type, request.key, request.payload,
                                         path.attempt, result.error, result.decision))

    worker = ResidentWorker(services, policy, owner=context.run_id, on_progress=report,
                            on_failure=failed, batch=deferred_interrupts,
                            step=f"{WORKER_OP}[{config.queue}]")
    context.log.info(f"{config.queue} worker serving {', '.join(worker.job_types()) or 'nothing'}"
                     f" (batches of {policy.batch_size}, lifetime {policy.lifetime_seconds:.0f}"
                     f" s, idle {policy.idle_seconds:.0f} s)")
    stats = worker.run()
    if stats.abandoned:  # the run ends now, so its process takes the hung threads with it
        context.log.error(f"{config.queue} worker ended: {stats.reason}")
    context.add_output_metadata({
        "ended": stats.reason, "requests": stats.requests, "batches": stats.batches,
        **{k: v for k, v in stats.counts.items() if v},
    })
    return {"ended": stats.reason, "requests": stats.requests, "counts": stats.counts}


@dg.job(
    name=WORKER_JOB,
    description="A resident worker: claims its queue's requests as they arrive and runs them "
    "in this run's process (started and kept alive by the worker_supervisor sensor).",
    executor_def=dg.in_process_executor,
    tags={**tag.NO_RUN_RETRY},
)
def sekali_worker() -> None:
    resident_worker()
