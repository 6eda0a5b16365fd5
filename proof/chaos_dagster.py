"""The ``--dagster`` worker of the chaos harness: :mod:`proof.chaos_worker` with each delivery
run as a real Dagster run of the job type's per-request job (started as ``python -m
proof.chaos_dagster``, configured like the plain worker). A module of its own so that only
``--dagster`` runs pay for importing Dagster."""

from __future__ import annotations

import os
import sys
from typing import Any

import dagster as dg

from engine.registry import get_job_type
from pipelines.ops import all_jobs
from pipelines.profile import resource_defs
from proof.chaos_worker import WorkerConfig, main
from resources.dagster_resources import IdempotencyResource, RetryResource
from resources.dlq import DlqStore
from resources.storage.db import shared_database
from sensors.dlq import dead_letter_run


class DagsterDeliveries:
    """``--dagster``: each delivery is a real run of the job type's per-request Dagster job
    (``execute_in_process`` on a persistent instance, the job's own resources from the
    environment, its declared downstreams' clients with the fault points), so Dagster's own
    handling of ``RetryRequested``/``Failure`` decides the retries inside the run, and a failed
    run is dead-lettered by the run-failure sensor's own function
    (:func:`sensors.dlq.dead_letter_run`), not by the harness."""

    def __init__(self, config: WorkerConfig, clients: dict[str, Any]) -> None:
        os.environ["DAGSTER_HOME"] = config.dagster_home
        self.instance = dg.DagsterInstance.get()
        self.jobs = {job.name: job for job in all_jobs}
        self.resources: dict[str, Any] = {
            **resource_defs(),
            "idempotency": IdempotencyResource(lease_seconds=config.lease_seconds),
            "retry": RetryResource(max_attempts=config.max_attempts,
                                   base_delay=config.retry_base, max_delay=config.retry_cap,
                                   max_unknown_attempts=config.max_attempts),
        }
        for name in {d.name for t in config.job_types for d in get_job_type(t).calls.clients}:
            self.resources[name] = _Wired(clients[name], config.settle_seconds)
        self.database_url = config.database_url

    def deliver(self, msg: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
        """Run the delivery; ``("done"|"fail", tok, fields)`` for the broker."""
        tok, jt = msg["tok"], get_job_type(msg["job_type"])
        config = {"ops": {jt.op_name: {"config": {
            "payload": msg["payload"], "request_id": int(msg["request_id"]),
            "correlation_id": f"chaos-req-{msg['req']}"}}}}
        try:
            result = self.jobs[jt.name].execute_in_process(
                run_config=config, resources=self.resources, instance=self.instance,
                raise_on_error=False, tags={"sekali/chaos": "true"},
            )
        except dg.DagsterInvalidConfigError as exc:  # refused before any run: permanent
            return ("fail", tok, {"error": "DagsterInvalidConfigError", "kind": "permanent",
                                  "message": str(exc)[:500], "retry": False})
        if result.success:
            out = result.output_for_node(jt.op_name)
            return ("done", tok, {"status": out["status"], "run_id": result.run_id})
        run = self.instance.get_run_by_id(result.run_id)
        assert run is not None
        recorded = dead_letter_run(self.instance, run, DlqStore(shared_database(
            self.database_url)), actor="dlq_sensor")
        kinds = {str(r.record.error_class) for r in recorded}
        return ("fail", tok, {"error": "RunFailed", "kind": kinds.pop() if len(kinds) == 1
                              else "unknown", "message": f"run {result.run_id} failed",
                              "retry": False, "dead_lettered": bool(recorded),
                              "run_id": result.run_id})


class _Wired:
    """A downstream resource as the op reads it (``get_client``, ``get_settle_seconds``),
    holding the worker's hooked client."""

    def __init__(self, client: Any, settle_seconds: float) -> None:
        self.client = client
        self.settle_seconds = settle_seconds

    def get_client(self) -> Any:
        return self.client

    def get_settle_seconds(self) -> float:
        return self.settle_seconds


if __name__ == "__main__":
    sys.exit(main(deliveries=DagsterDeliveries))
