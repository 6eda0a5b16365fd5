"""One resident worker process of the chaos harness (``sekali chaos --delivery resident``).

Started as ``python -m proof.chaos_resident`` with its configuration (JSON) in
``SEKALI_CHAOS_WORKER_CONFIG``, as :mod:`proof.chaos_worker` is. It runs the shipped
:class:`engine.worker.ResidentWorker`, the loop the ``sekali_worker`` op runs, on one queue
under one owner: it claims with :meth:`RequestStore.claim_for_worker`, runs each batch through
:func:`engine.step.run_steps`, gives transient failures back and dead-letters final ones where
they are decided. Nothing is delivered to it: the coordinator only enqueues, arms faults, and
gives back what a dead worker held (:func:`engine.worker.give_back`, as the supervisor does).

Its stdout carries JSON lines for the coordinator: ``ready``; ``batch`` (the correlation ids
claimed) and ``batch_done``; ``fail`` per failed attempt once settled (error, class, the
decision); ``killing``/``loop`` just before it SIGKILLs itself; ``stopping``/``resumed``
around a SIGSTOP; ``worker_failed`` when the worker loop itself raised (the run would end
FAILED); ``ended``. Its stdin carries ``arm`` (``crash`` or ``stop`` at a point: the next
effect call of this process that reaches the point strikes) and ``exit`` (the worker stops
claiming, finishes its batch and ends, as a terminated run does).

Fault points: ``before_effect`` / ``after_effect`` around every effect call of the downstream
clients (not the lookups' reads), and ``after_record`` once a batch's keys completed and before
its requests are settled (a kill there leaves completed keys under requests still ``running``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from typing import Any

from engine import step as step_module
from engine.contract import freeze_here
from engine.registry import get_job_type
from engine.step import StepResult
from engine.worker import ResidentWorker, WorkerPolicy
from proof.chaos_mix import mix_names
from proof.chaos_outbox import Relay
from proof.chaos_worker import (
    CONFIG_ENV,
    Hooks,
    WorkerConfig,
    _Channel,
    build_services,
    lookup_reads,
)
from resources.retry import failure_class

logger = logging.getLogger(__name__)

READ_PREFIXES = ("find_", "get_", "lookup")


class Armed:
    """The faults armed on this process: at most one crash and one stop, struck by the first
    effect call (of any request) that reaches their point. Process-wide, not per thread: the
    coordinator arms a worker, not a delivery."""

    def __init__(self, channel: _Channel, crash_loops: frozenset[str]) -> None:
        self.channel = channel
        self.crash_loops = crash_loops
        self.lock = threading.Lock()
        self.crash: str | None = None
        self.stop: str | None = None

    def arm(self, msg: dict[str, Any]) -> None:
        with self.lock:
            self.crash = msg.get("crash") or self.crash
            self.stop = msg.get("stop") or self.stop

    def disarm(self) -> None:
        """The coordinator took the crash back (to strike elsewhere); a stop stays."""
        with self.lock:
            self.crash = None

    def point(self, name: str, cid: str | None) -> None:
        if name == "before_effect" and cid in self.crash_loops:
            self.channel.send("loop", "", cid=cid)  # its handler kills the process every time
            os.kill(os.getpid(), signal.SIGKILL)
        with self.lock:
            crash = self.crash == name
            stop = self.stop == name
            if stop:
                self.stop = None
        if crash:
            self.channel.send("killing", "", cid=cid, point=name)
            os.kill(os.getpid(), signal.SIGKILL)
        if stop:
            with Hooks.gate.quiesced():
                self.channel.send("stopping", "", cid=cid, point=name)
                freeze_here()
            self.channel.send("resumed", "", cid=cid, point=name)


class ArmedClient:
    """A downstream client with the fault points around its effect calls (every public method
    but its reads); the request is known by the call's ``correlation_id``."""

    def __init__(self, inner: Any, armed: Armed, reads: frozenset[str]) -> None:
        self.inner = inner
        self.armed = armed
        self.reads = reads

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        if (not callable(value) or name.startswith("_") or name in self.reads
                or name.startswith(READ_PREFIXES)):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            cid = kwargs.get("correlation_id")
            self.armed.point("before_effect", cid)
            answer = value(*args, **kwargs)
            self.armed.point("after_effect", cid)
            return answer

        return call


def lookup_reads_of(clients: dict[str, Any], job_types: tuple[str, ...] | None = None
                    ) -> dict[str, frozenset[str]]:
    """The downstream clients the job types use (by default the built-in mix's), each with the
    methods their lookups read (:func:`proof.chaos_worker.lookup_reads`): the ones that get no
    fault point."""
    out: dict[str, frozenset[str]] = {}
    for name in mix_names() if job_types is None else job_types:
        found = lookup_reads(name, clients)
        for downstream in get_job_type(name).calls.clients:
            if downstream.name in clients:
                out[downstream.name] = out.get(downstream.name, frozenset()) | found
    return out


class ChaosResidentWorker(ResidentWorker):
    """The shipped worker, telling the coordinator which requests each batch holds."""

    channel: _Channel

    def run_once(self, types: list[str] | None = None) -> tuple[list[StepResult], float]:
        claim = self.requests.claim_for_worker

        def told(*args: Any, **kwargs: Any) -> Any:
            rows = claim(*args, **kwargs)
            if rows:
                self.channel.send("batch", "", cids=[r.correlation_id for r in rows],
                                  ids=[r.id for r in rows])
            return rows

        self.requests.claim_for_worker = told  # type: ignore[method-assign]
        try:
            results, took = super().run_once(types)
        finally:
            self.requests.claim_for_worker = claim  # type: ignore[method-assign]
        if results:
            self.channel.send("batch_done", "", seconds=round(took, 3))
        return results, took


def _hook_after_record(armed: Armed) -> None:
    """The ``after_record`` point: the batch's keys completed in the ledger, its requests not
    yet settled (a fault point of the harness around the step's own settling)."""
    original = step_module._complete

    def hooked(store: Any, at: Any, requests: Any, done: list[int], *args: Any,
               **kwargs: Any) -> None:
        for i in done:
            armed.point("after_record", requests[i].correlation_id)
        original(store, at, requests, done, *args, **kwargs)

    step_module._complete = hooked


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    config = WorkerConfig.from_json(args[0] if args else os.environ[CONFIG_ENV])
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr,
        format=f"%(asctime)s r{config.worker_id} %(levelname)s %(name)s: %(message)s",
    )
    # the wake-ups of this run's Redis, under the run's own namespace (the enqueues' too)
    os.environ.update({"REDIS_URL": config.redis_url, "DATABASE_URL": config.database_url,
                       "SEKALI_WAKEUP_NAMESPACE": config.wakeup_namespace or "sekali-chaos"})
    channel = _Channel()
    armed = Armed(channel, frozenset(config.crash_loops))
    services = build_services(config)
    clients = services.clients
    for name, reads in lookup_reads_of(clients).items():
        clients[name] = ArmedClient(clients[name], armed, reads)
    _hook_after_record(armed)
    policy = WorkerPolicy(queue=config.queue, batch_size=config.batch_size,
                          lifetime_seconds=86400.0, idle_seconds=86400.0, poll_seconds=0.5)

    def failed(result: StepResult) -> None:
        error, decision, request = result.error, result.decision, result.request
        if error is None or decision is None:
            return
        channel.send(
            "fail", "", cid=request.correlation_id if request is not None else None,
            error=type(error).__name__, kind=str(decision.error_class),
            message=str(error)[:500], retry=decision.retry, delay=decision.delay,
            reason=decision.reason, outcome=str(result.recorded),
            dlq_class=str(failure_class(error)),
            dead_letter=result.dead_letter is not None,
        )

    worker = ChaosResidentWorker(services, policy, owner=config.owner, on_failure=failed,
                                 step=f"resident_worker[{config.queue}]")
    worker.channel = channel

    def listen() -> None:
        for line in sys.stdin:
            msg = json.loads(line) if line.strip() else {}
            if msg.get("t") == "arm":
                armed.arm(msg)
            elif msg.get("t") == "disarm":
                armed.disarm()
            elif msg.get("t") == "exit":
                break
        worker.stop.set()

    threading.Thread(target=listen, name="chaos-stdin", daemon=True).start()
    if config.outbox_relay:
        Relay(services.db, config.lease_seconds,
              on_error=lambda exc: logger.warning("outbox relay: %s", exc)).start()
    channel.send("ready", "", owner=config.owner, queue=config.queue)
    try:
        stats = worker.run()
    except Exception as exc:  # noqa: BLE001 - the run would end FAILED; the coordinator hears it
        logger.exception("resident worker %s failed", config.owner)
        channel.send("worker_failed", "", error=type(exc).__name__, message=str(exc)[:500])
        return 3
    channel.send("ended", "", reason=stats.reason, requests=stats.requests)
    return 0


if __name__ == "__main__":
    sys.exit(main())
