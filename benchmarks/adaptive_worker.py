"""One resident worker process of the adaptive benchmark (:mod:`benchmarks.adaptive`): the
engine's :class:`engine.worker.ResidentWorker`, exactly as the ``sekali_worker`` op runs it
(services from the environment, the policy of ``SEKALI_WORKER_*``, Redis wake-ups), under the
owner id given; SIGTERM asks it to stop after the batch in hand, as a run's termination does.

    python -m benchmarks.adaptive_worker OWNER
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from engine.registry import JOB_TYPES
from engine.services import Services
from engine.worker import ResidentWorker, WorkerPolicy


def main(owner: str) -> int:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda _signo, _frame: stop.set())
    JOB_TYPES.reload()
    namespace = os.environ["SEKALI_WAKEUP_NAMESPACE"]
    services = Services.from_settings(
        lease_seconds=float(os.environ["SEKALI_BENCH_LEASE"]),
        budget_namespace=namespace, cache_namespace=namespace,
    )
    worker = ResidentWorker(services, WorkerPolicy.from_env("light"), owner=owner, stop=stop)
    stats = worker.run()
    print(f"{owner}: {stats.reason}, {stats.requests} requests", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
