"""Worker code the job tests run in other processes (spawned, or ``python tests/job_workers.py``).

Module-level functions only, so ``multiprocessing`` with the "spawn" context can import them.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

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
    from pipelines.profile import MailerResource, PaymentGatewayResource
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
    return {
        "idempotency": IdempotencyResource(database_url=db_url, lease_seconds=lease_seconds),
        "app_db": DatabaseResource(database_url=db_url),
        "locks": LockResource(backend="db", database_url=db_url),
        "cache": CacheResource(redis_url=redis_url, namespace=namespace),
        "gateway": PaymentGatewayResource(
            base_url=gateway_url, timeout=5.0, send_idempotency_key=send_idempotency_key,
            settle_seconds=settle_seconds,
        ),
        "mailer": MailerResource(host="127.0.0.1", port=smtp_port),
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
        if not self.stopped:
            self.stopped = True
            os.kill(os.getpid(), signal.SIGSTOP)
        return self.inner.charge(**kwargs)

    def find_charges(self, reference: str) -> Any:
        return self.inner.find_charges(reference)


def request_loop(args: dict[str, Any]) -> list[dict[str, Any]]:
    """Run ``execute_request`` for each payload, waiting out ``AlreadyInProgress``.

    Returns one dict per payload: ``status`` (completed, duplicate or the error class) and the
    result. Used by the concurrency tests from threads and spawned processes alike.
    """
    from pipelines.runtime import execute_request
    from pipelines.services import Services
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
        send_idempotency_key=bool(args.get("send_idempotency_key", True)),
    )
    if args.get("stop_in_charge"):
        services.gateway = _StopInCharge(services.gateway)
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
    import os
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
    from pipelines.attempts import AttemptRecorder
    from pipelines.domain.mail import SmtpMailer
    from pipelines.ops.batch import run_batch
    from pipelines.requests import RequestStore
    from pipelines.services import Services
    from resources.idempotency import IdempotencyStore
    from resources.storage.db import Database

    db = Database.from_url(spec["db_url"])
    services = Services(
        db=db,
        store=IdempotencyStore(db, lease_seconds=spec.get("lease_seconds", 30.0)),
        attempts=AttemptRecorder(db),
        mailer=SmtpMailer("127.0.0.1", spec.get("smtp_port", 9)),
    )
    time.sleep(max(0.0, spec.get("go", 0.0) - time.time()))
    try:
        return run_batch(
            RequestStore(db), spec["request_ids"], services=services, run_id=spec.get("run_id")
        )
    finally:
        db.dispose()


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
