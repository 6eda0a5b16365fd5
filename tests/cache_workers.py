"""Worker functions the cache tests start in spawned processes (importable, module level).

Each process runs ``threads`` callers of one key behind a barrier; the parent opens the gate
(``go``) once every process is ready, so all callers hit the key at once. The loader counts its
calls in Redis (``INCR``), so the count covers every process.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from resources.cache.core import StampedeCache
from resources.storage.redis import redis_client


def calls_key(namespace: str) -> str:
    return f"{namespace}:loader_calls"


def release_key(namespace: str) -> str:
    return f"{namespace}:release"


def stampede_callers(
    redis_url: str,
    namespace: str,
    key: str,
    threads: int,
    mode: str,
    ready: Any,
    go: Any,
    out: Any,
) -> None:
    """``mode='sleep'``: the loader takes 0.3 s. ``mode='block'``: it waits for the parent's
    release (so callers that return before the release provably did not wait for it)."""
    client = redis_client(redis_url)
    cache = StampedeCache.from_url(redis_url, namespace=namespace, wait_timeout=60, lock_ttl=60)

    def loader() -> dict[str, Any]:
        n = int(client.incr(calls_key(namespace)))
        if mode == "block":
            client.blpop([release_key(namespace)], timeout=60)
        else:
            time.sleep(0.3)
        return {"version": 2, "call": n}

    barrier = threading.Barrier(threads + 1)
    results: list[Any] = []
    lock = threading.Lock()

    def call() -> None:
        barrier.wait(timeout=60)
        try:
            value = cache.get_or_load(key, loader, ttl=60, stale_ttl=600)
        except Exception as exc:  # noqa: BLE001 - reported to the parent as data
            value = {"error": repr(exc)}
        with lock:
            results.append(value)

    workers = [threading.Thread(target=call) for _ in range(threads)]
    for worker in workers:
        worker.start()
    ready.put("ready")
    go.wait(60)
    barrier.wait(timeout=60)
    for worker in workers:
        worker.join(timeout=90)
    out.put(results)
    cache.close()  # waits for a background refresh (released by the parent in mode 'block')
    client.close()
