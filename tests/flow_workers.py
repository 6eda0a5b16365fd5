"""Worker functions the flow tests run in other processes (forkserver context).

Module-level so ``multiprocessing`` can import them; each opens its own Redis client. The
contention and rate runs are the benchmark's own (:mod:`benchmarks.flow`), so the tests and
the benchmark measure the same thing.
"""

from __future__ import annotations

import time
from typing import Any

from resources.flow import ConcurrencyLimiter
from resources.storage.redis import redis_client


def hold_forever(
    url: str, namespace: str, key: str, limit: int, lease: float, count: int, out: Any
) -> None:
    """Take ``count`` slots of ``key``, report their fences, then sleep until killed."""
    limiter = ConcurrencyLimiter(redis_client(url), namespace, limit=limit, lease=lease)
    slots = [limiter.acquire(key, blocking_timeout=30) for _ in range(count)]
    out.put([s.fence for s in slots])
    while True:
        time.sleep(60)


def queue_and_record(
    url: str, namespace: str, key: str, limit: int, ident: int, order_key: str
) -> None:
    """Wait for a slot of ``key``, then append ``ident`` to the list ``order_key``."""
    client = redis_client(url)
    limiter = ConcurrencyLimiter(client, namespace, limit=limit, lease=10)
    with limiter.hold(key, blocking_timeout=60):
        client.rpush(order_key, ident)
        time.sleep(0.02)
