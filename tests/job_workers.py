"""Worker code the job tests run in other processes (spawned, or ``python tests/job_workers.py``).

Module-level functions only, so ``multiprocessing`` with the "spawn" context can import them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from engine import Concurrency, FlowControl, Keying, Queue, Running

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def dagster_resources(
    *,
    db_url: str,
    redis_url: str,
    namespace: str,
    gateway_url: str = "http://127.0.0.1:9",
    smtp_port: int = 9,
    lease_seconds: float = 30.0,
    send_idempotency_key: bool = True,
    settle_seconds: float = 1.0,
    retry: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The resources of the per-request jobs, every endpoint explicit (no environment)."""
    from pipelines.profile import DownstreamResource
    from resources.dagster_resources import (
        CacheResource,
        ConcurrencyResource,
        DatabaseResource,
        IdempotencyResource,
        LockResource,
        RetryResource,
    )

    retry_cfg = {
        "max_attempts": 3,
        "base_delay": 0.05,
        "max_delay": 0.2,
        "redis_url": redis_url,
        "budget_namespace": namespace,
        **(retry or {}),
    }
    from engine.registry import downstreams

    unused = {  # every other declared downstream: these tests' runs never call it
        name: DownstreamResource(downstream=name, address="http://127.0.0.1:9")
        for name in downstreams()
    }
    return unused | {
        "idempotency": IdempotencyResource(database_url=db_url, lease_seconds=lease_seconds),
        "app_db": DatabaseResource(database_url=db_url),
        "locks": LockResource(backend="db", database_url=db_url),
        "cache": CacheResource(redis_url=redis_url, namespace=namespace),
        "payment_gateway": DownstreamResource(
            downstream="payment_gateway", address=gateway_url, timeout=5.0,
            extra={"send_idempotency_key": send_idempotency_key}, settle_seconds=settle_seconds,
        ),
        "smtp": DownstreamResource(downstream="smtp", address=f"127.0.0.1:{smtp_port}"),
        "retry": RetryResource(**retry_cfg),
        "concurrency": ConcurrencyResource(
            redis_url=redis_url, prefix=f"{namespace}:flow:limit:", lease_seconds=lease_seconds
        ),
    }


def run_job(job_name: str, run_config: dict[str, Any], resources: dict[str, Any]) -> bool:
    """Run one per-request job in process on an ephemeral instance; True on success."""
    import dagster as dg

    from pipelines import ops

    job = next(j for j in ops.all_jobs if j.name == job_name)
    result = job.execute_in_process(
        run_config=run_config,
        resources=resources,
        instance=dg.DagsterInstance.ephemeral(),
        raise_on_error=False,
    )
    return bool(result.success)


class _StopInCharge:
    """The real gateway client, frozen (SIGSTOP, until SIGCONT) once inside ``charge`` just
    before the real client runs: past the job's last lease confirmation, before any byte."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.stopped = False

    def charge(self, **kwargs: Any) -> Any:
        from engine.contract import freeze_here

        if not self.stopped:
            self.stopped = True
            freeze_here()
        return self.inner.charge(**kwargs)

    def find_charges(self, reference: str) -> Any:
        return self.inner.find_charges(reference)


def request_loop(args: dict[str, Any]) -> list[dict[str, Any]]:
    """Run ``execute_request`` for each payload, waiting out ``AlreadyInProgress``.

    Returns one dict per payload: ``status`` (completed, duplicate or the error class) and the
    result. Used by the concurrency tests from threads and spawned processes alike.
    """
    from engine.downstreams import ClientOptions
    from engine.runtime import execute_request
    from engine.services import Services
    from resources.errors import AlreadyInProgress
    from resources.retry import RetryPolicy
    from resources.storage.settings import Settings

    settings = Settings(
        database_url=args["db_url"],
        redis_url=args["redis_url"],
        dagster_home=Path("/nonexistent"),
        gateway_url=args.get("gateway_url", "http://127.0.0.1:9"),
        smtp_host="127.0.0.1",
        smtp_port=int(args.get("smtp_port", 9)),
        gateway_settle_seconds=float(args.get("settle_seconds", 1.0)),
    )
    services = Services.from_settings(
        settings,
        lease_seconds=float(args.get("lease_seconds", 30.0)),
        retry_policy=RetryPolicy(),
        budget_namespace=args["namespace"],
        cache_namespace=args["namespace"],
        options={"payment_gateway": ClientOptions(
            extra={"send_idempotency_key": bool(args.get("send_idempotency_key", True))}
        )},
    )
    if args.get("stop_in_charge"):
        services.clients["payment_gateway"] = _StopInCharge(services.client("payment_gateway"))
    if args.get("ready_dir"):
        _wait_for_go(Path(args["ready_dir"]))
    out: list[dict[str, Any]] = []
    for payload in args["payloads"]:
        deadline = time.monotonic() + 60
        while True:
            try:
                outcome = execute_request(args["job_type"], payload, services=services)
                out.append({"status": outcome.status, "result": outcome.result})
                break
            except AlreadyInProgress:
                if time.monotonic() > deadline:
                    out.append({"status": "AlreadyInProgress", "result": None})
                    break
                time.sleep(0.02)
            except Exception as exc:  # noqa: BLE001 - reported to the test
                out.append({"status": type(exc).__name__, "result": str(exc)})
                break
    return out


def _wait_for_go(folder: Path) -> None:
    """Say "ready" (a file named after this pid and thread), then wait for the "go" file, so
    every process and thread starts its requests at the same moment."""
    import threading

    (folder / f"ready-{os.getpid()}-{threading.get_ident()}").touch()
    deadline = time.monotonic() + 120
    while not (folder / "go").exists():
        if time.monotonic() > deadline:
            raise TimeoutError("no go signal")
        time.sleep(0.005)


def batch_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one micro-batch (``run_batch``) of ``spec["request_ids"]`` on its own stores, after
    waiting for ``spec["go"]`` (a wall-clock time) if given; returns the batch's summary."""
    from engine.attempts import AttemptRecorder
    from engine.requests import RequestStore
    from engine.services import Services
    from engine.step import run_batch
    from pipelines.domain.mail import SmtpMailer
    from resources.idempotency import IdempotencyStore
    from resources.storage.db import Database

    db = Database.from_url(spec["db_url"])
    services = Services(
        db=db,
        store=IdempotencyStore(db, lease_seconds=spec.get("lease_seconds", 30.0)),
        attempts=AttemptRecorder(db),
        clients={"smtp": SmtpMailer(
            "127.0.0.1", spec.get("smtp_port", 9), log_url=spec.get("smtp_log_url")
        )},
    )
    time.sleep(max(0.0, spec.get("go", 0.0) - time.time()))
    try:
        return run_batch(
            RequestStore(db), spec["request_ids"], services=services, run_id=spec.get("run_id")
        )
    finally:
        db.dispose()


_TALLY = """
-- KEYS[1] - holders now of the group   KEYS[2] - the most ever seen at once
-- ARGV[1] - +1 on entering the effect, -1 on leaving; returns the holders now
local n = redis.call('INCRBY', KEYS[1], ARGV[1])
if n > tonumber(redis.call('GET', KEYS[2]) or '0') then redis.call('SET', KEYS[2], n) end
return n
"""

TALLY_LIMIT = 2


def tally_job_type(redis_url: str, namespace: str) -> Any:
    """A job type whose requests (distinct keys) share a concurrency key, ``group:{group}``
    (limit :data:`TALLY_LIMIT`), and whose batch hook, like ``reserve_inventory``'s, takes no
    slot itself and runs its effects on four lanes at once (:func:`engine.in_lanes`, as
    ``send_email``'s does); every effect counts itself in and out of its group in Redis,
    keeping the most ever inside at once under ``{namespace}:tally:max:{group}``."""
    from engine import JobContext, JobType, in_lanes
    from resources.storage.redis import redis_client

    tally = redis_client(redis_url).register_script(_TALLY)

    def effect(p: dict[str, Any]) -> dict[str, Any]:
        keys = [f"{namespace}:tally:now:{p['group']}", f"{namespace}:tally:max:{p['group']}"]
        tally(keys=keys, args=[1])
        time.sleep(0.02)  # the effect's work: a window for another holder to overlap it
        tally(keys=keys, args=[-1])
        return {"n": p["n"]}

    def handler(ctx: JobContext, p: dict[str, Any]) -> dict[str, Any]:
        with ctx.concurrency_slot(job_type):
            return effect(p)

    def lane(part: Any) -> list[Any]:
        out = []
        for ctx, p in part:
            ctx.check_lease()
            out.append(effect(p))
        return out

    def handler_many(items: Any) -> list[Any]:
        return in_lanes(items, 4, lane)

    job_type = JobType(
        name="tally_group",
        queue=Queue.LIGHT,
        validate=dict,
        handler=handler,
        side_effect=True,
        keying=Keying(key_for=lambda p: f"tally:{p['group']}:{p['n']}",
                      resource_id=lambda p: str(p["group"])),
        running=Running(max_runtime_seconds=60, handler_many=handler_many),
        flow=FlowControl(concurrency=Concurrency("group:{group}", limit=TALLY_LIMIT)),
    )
    return job_type


def limited_batch_worker(spec: dict[str, Any]) -> list[str]:
    """Run ``spec["payloads"]`` of ``tally_group`` as micro-batches of ``spec["batch"]``
    through ``execute_batch``, with the concurrency limits on the shared Redis, after waiting
    for ``spec["go"]``; returns each request's status or error class."""
    from engine.attempts import AttemptRecorder
    from engine.registry import JOB_TYPES
    from engine.runtime import BatchRequest, execute_batch
    from engine.services import Services
    from resources.flow import ConcurrencyLimits
    from resources.idempotency import IdempotencyStore
    from resources.storage.db import Database
    from resources.storage.redis import redis_client

    JOB_TYPES["tally_group"] = tally_job_type(spec["redis_url"], spec["namespace"])
    db = Database.from_url(spec["db_url"])
    services = Services(
        db=db, store=IdempotencyStore(db), attempts=AttemptRecorder(db),
        concurrency=ConcurrencyLimits(
            redis_client(spec["redis_url"]), wait=60, prefix=f"{spec['namespace']}:limit:"
        ),
    )
    time.sleep(max(0.0, spec["go"] - time.time()))
    statuses: list[str] = []
    payloads = spec["payloads"]
    try:
        for lo in range(0, len(payloads), spec["batch"]):
            batch = [BatchRequest("tally_group", p) for p in payloads[lo:lo + spec["batch"]]]
            for outcome in execute_batch(batch, services=services, run_id=spec["run_id"]):
                statuses.append(
                    type(outcome).__name__ if isinstance(outcome, Exception) else outcome.status
                )
    finally:
        db.dispose()
    return statuses


def main() -> None:
    """``python tests/job_workers.py JSON``: run one job in process (the crash tests), with
    ``job_type`` in the JSON :func:`request_loop` without Dagster, or one micro-batch when the
    JSON names ``request_ids``; the last two print their results."""
    spec = json.loads(sys.argv[1])
    if "job_type" in spec:
        print(json.dumps(request_loop(spec)), flush=True)
        return
    if "request_ids" in spec:
        print(json.dumps(batch_worker(spec)))
        sys.exit(0)
    resources = dagster_resources(**spec["resources"])
    ok = run_job(spec["job"], spec["run_config"], resources)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()


def replay_sensor(**kwargs: Any) -> Any:
    """The DLQ replay sensor over this code location's per-request jobs, publishing the
    dead-letters asset as the definitions' one does; ``kwargs`` as
    :func:`sensors.dlq.build_dlq_replay_sensor` takes them (name, rates, clock)."""
    from pipelines.assets import dead_letters
    from pipelines.ops import all_jobs
    from sensors.dlq import build_dlq_replay_sensor

    return build_dlq_replay_sensor(all_jobs, dead_letters.publish, **kwargs)
