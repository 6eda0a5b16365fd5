"""Resident workers the worker tests run in other processes: ``python -m tests.worker_procs
SPEC_JSON``. A worker runs until SIGTERM (it finishes its batch first), its idle bound, or its
lifetime, then prints its stats as one JSON line.

SPEC: ``db_url``, ``redis_url``, ``smtp_port``, ``smtp_log_url`` (the sink's record, for
lookups), ``owner``, ``queue`` (``light``), ``lease``
(seconds), ``batch`` (size), ``poll``, ``idle``, ``namespace``, ``max_attempts``.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def services_for(spec: dict[str, Any]) -> Any:
    """The services a worker of the tests runs with: the spec's stores, its mail sink, a
    retry policy with short delays, the retry budget and concurrency limits on its Redis."""
    from engine.attempts import AttemptRecorder
    from engine.services import Services
    from pipelines.domain.mail import SmtpMailer
    from resources.flow import ConcurrencyLimits
    from resources.idempotency import IdempotencyStore
    from resources.retry import RetryBudget, RetryPolicy
    from resources.storage.db import Database
    from resources.storage.redis import redis_client

    db = Database.from_url(spec["db_url"])
    redis = redis_client(spec["redis_url"])
    lease = float(spec.get("lease", 30.0))
    return Services(
        db=db,
        store=IdempotencyStore(db, lease_seconds=lease),
        attempts=AttemptRecorder(db),
        clients={"smtp": SmtpMailer("127.0.0.1", int(spec["smtp_port"]), timeout=5,
                                    deadline=10, log_url=spec.get("smtp_log_url"))},
        retry_policy=RetryPolicy(max_attempts=int(spec.get("max_attempts", 3)),
                                 base_delay=0.05, max_delay=0.2),
        retry_budget=RetryBudget(redis, namespace=spec.get("namespace", "t")),
        concurrency=ConcurrencyLimits(redis, lease=min(30.0, lease),
                                      prefix=f"{spec.get('namespace', 't')}:flow:limit:"),
        settle_seconds=1.0,
    )


def worker(spec: dict[str, Any], stop: threading.Event | None = None) -> Any:
    from engine.worker import ResidentWorker, WorkerPolicy
    from resources.wakeup import RedisWakeup

    stop = stop or threading.Event()
    policy = WorkerPolicy(
        queue=spec.get("queue", "light"), batch_size=int(spec.get("batch", 20)),
        poll_seconds=float(spec.get("poll", 0.5)), idle_seconds=float(spec.get("idle", 600)),
        lifetime_seconds=float(spec.get("lifetime", 1800)),
        progress_seconds=float(spec.get("progress", WorkerPolicy.progress_seconds)),
    )
    return ResidentWorker(
        services_for(spec), policy, owner=spec["owner"], stop=stop,
        wakeup=RedisWakeup(spec["redis_url"], namespace=spec.get("namespace", "t")),
    )


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stats = worker(spec, stop).run()
    print(json.dumps({"reason": stats.reason, "batches": stats.batches,
                      "requests": stats.requests, "counts": stats.counts}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
