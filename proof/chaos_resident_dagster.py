"""A resident worker of the chaos harness as a real Dagster run (``sekali chaos --delivery
resident --dagster``): :mod:`proof.chaos_resident` with the worker run by the shipped
``sekali_worker`` job (its ``resident_worker`` op: the services from the run's resources, the
termination deferred to the end of a batch, the run's id as the owner of what it claims),
executed in this process on the run's instance with the run config and tags the workers'
supervisor asked for (:func:`sensors.workers.worker_run_requests`). A module of its own so that
only ``--dagster`` runs pay for importing Dagster.

Same protocol as the plain resident worker; ``exit`` interrupts the run (SIGINT, which the
op defers to the end of its batch, as it does Dagster's "Terminate"; executed in process, the
interrupted run ends FAILURE where a launched one ends CANCELED).
A killed process leaves its run STARTED: the coordinator plays run monitoring and marks it
failed, then the supervisor's own step gives back what it held.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from typing import Any

import dagster as dg

from engine import worker as worker_module
from engine.requests import RequestStore
from pipelines.ops.worker import sekali_worker
from pipelines.profile import resource_defs
from proof.chaos_dagster import _Wired
from proof.chaos_resident import Armed, ArmedClient, _hook_after_record, lookup_reads_of
from proof.chaos_worker import CONFIG_ENV, Hooks, WorkerConfig, _Channel, build_services
from resources.dagster_resources import (
    ConcurrencyResource,
    IdempotencyResource,
    RetryResource,
)
from resources.storage.db import shared_database
from resources.storage.settings import SETTLE_ENV

logger = logging.getLogger(__name__)


def _tell_batches(channel: _Channel) -> None:
    """``batch`` (with the owner: the run's id) and ``batch_done`` events around the op's
    claims and batches, as the plain resident worker sends them."""
    claim = RequestStore.claim_for_worker
    run_steps = worker_module.run_steps

    def claimed(self: RequestStore, *args: Any, **kwargs: Any) -> Any:
        rows = claim(self, *args, **kwargs)
        if rows:
            channel.send("batch", "", cids=[r.correlation_id for r in rows],
                         ids=[r.id for r in rows], owner=kwargs.get("owner"))
        return rows

    def ran(*args: Any, **kwargs: Any) -> Any:
        results = run_steps(*args, **kwargs)
        channel.send("batch_done", "")
        return results

    RequestStore.claim_for_worker = claimed  # type: ignore[method-assign]
    worker_module.run_steps = ran  # type: ignore[assignment]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    config = WorkerConfig.from_json(args[0] if args else os.environ[CONFIG_ENV])
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr,
        format=f"%(asctime)s d{config.worker_id} %(levelname)s %(name)s: %(message)s",
    )
    os.environ.update({
        "REDIS_URL": config.redis_url, "DATABASE_URL": config.database_url,
        "DAGSTER_HOME": config.dagster_home,
        "SEKALI_WAKEUP_NAMESPACE": config.wakeup_namespace or "sekali-chaos",
        "SEKALI_WORKER_BATCH": str(config.batch_size), "SEKALI_WORKER_POLL": "0.5",
        "SEKALI_WORKER_PROGRESS": "5",
        "SEKALI_CRASH_LOOP_LIMIT": str(config.crash_loop_limit or 2),
        SETTLE_ENV: str(config.settle_seconds),  # every downstream resource's settle window
    })
    channel = _Channel()
    armed = Armed(channel, frozenset(config.crash_loops))
    services = build_services(config)  # the hooked clients; the run builds its own services
    shared = shared_database(config.database_url)
    if shared is not services.db:
        Hooks.gate.wrap(shared)  # the database the run's resources share
    clients: dict[str, Any] = {}
    for name, reads in lookup_reads_of(services.clients).items():
        clients[name] = _Wired(ArmedClient(services.clients[name], armed, reads),
                               config.settle_seconds)
    resources: dict[str, Any] = {
        **resource_defs(),
        "idempotency": IdempotencyResource(lease_seconds=config.lease_seconds),
        # a dead holder's slot lasts the run's lease, as the plain workers' services keep it
        "concurrency": ConcurrencyResource(lease_seconds=min(30.0, config.lease_seconds)),
        "retry": RetryResource(max_attempts=config.max_attempts, base_delay=config.retry_base,
                               max_delay=config.retry_cap,
                               max_unknown_attempts=config.max_attempts),
        **clients,
    }
    _tell_batches(channel)
    _hook_after_record(armed)

    told_to_end = threading.Event()

    def listen() -> None:
        for line in sys.stdin:
            msg = json.loads(line) if line.strip() else {}
            if msg.get("t") == "arm":
                armed.arm(msg)
            elif msg.get("t") == "exit":
                break
        told_to_end.set()
        os.kill(os.getpid(), signal.SIGINT)  # a termination: the op ends after its batch

    threading.Thread(target=listen, name="chaos-stdin", daemon=True).start()
    instance = dg.DagsterInstance.get()
    channel.send("ready", "", queue=config.queue)
    result = sekali_worker.execute_in_process(
        run_config=config.run_config, resources=resources, instance=instance,
        tags=config.run_tags, raise_on_error=False)
    run = instance.get_run_by_id(result.run_id)
    status = run.status.value if run is not None else "unknown"
    if not result.success and not told_to_end.is_set():
        channel.send("worker_failed", "", error="RunFailed", message=f"run {result.run_id} "
                     f"ended {status}")
    channel.send("ended", "", run_id=result.run_id, status=status)
    return 0 if result.success else 3


if __name__ == "__main__":
    sys.exit(main())
