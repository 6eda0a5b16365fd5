"""Worker functions the flow tests and benchmarks run in other processes (forkserver context).

Module-level so ``multiprocessing`` can import them; each opens its own Redis client.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from resources.flow import ConcurrencyLimiter, RateLimiter
from resources.storage.redis import redis_client

# KEYS[1] - holders now of one key   KEYS[2] - the most holders ever seen at once
# returns the holders now, after counting this one
TRACK_MAX = """
local n = redis.call('INCR', KEYS[1])
if n > tonumber(redis.call('GET', KEYS[2]) or '0') then redis.call('SET', KEYS[2], n) end
return n
"""


def gauge_keys(namespace: str, key: str) -> list[str]:
    """The test's own counters for ``key``: holders now, most holders at once (one hash tag)."""
    return [f"{namespace}:gauge:{{{key}}}:now", f"{namespace}:gauge:{{{key}}}:max"]


def hammer(
    url: str,
    namespace: str,
    keys: list[str],
    limit: int,
    threads: int,
    rounds: int,
    hold: float,
    barrier: Any,
    out: Any,
) -> None:
    """``threads`` threads each take a slot ``rounds`` times, cycling over ``keys``; inside the
    slot they count themselves in Redis (holders now, most at once) and record the fence and
    how long they waited. Puts ``{"fences": {key: [[...] per thread]}, "waits": [...],
    "errors": [...]}``."""
    client = redis_client(url)
    limiter = ConcurrencyLimiter(client, namespace, limit=limit, lease=10)
    track = client.register_script(TRACK_MAX)
    fences: dict[str, list[list[int]]] = {k: [[] for _ in range(threads)] for k in keys}
    waits: list[float] = []
    errors: list[str] = []
    guard = threading.Lock()

    def work(index: int) -> None:
        for i in range(rounds):
            key = keys[(index + i) % len(keys)]
            now, _ = gauge_keys(namespace, key)
            try:
                with limiter.hold(key, blocking_timeout=60) as slot:
                    track(keys=gauge_keys(namespace, key))
                    time.sleep(hold)
                    client.decr(now)
                    fences[key][index].append(slot.fence)
                    with guard:
                        waits.append(slot.waited)
            except Exception as exc:  # noqa: BLE001 - reported to the test
                with guard:
                    errors.append(f"{type(exc).__name__}: {exc}")

    barrier.wait()
    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    out.put({"fences": fences, "waits": waits, "errors": errors})


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


def take_tokens(
    url: str, name: str, rate: float, burst: float, seconds: float, barrier: Any, out: Any
) -> None:
    """Call ``acquire()`` in a loop until a grant's turn falls ``seconds`` after this worker
    began (server time); put the server times of the grants and how late each sleeper woke."""
    client = redis_client(url)
    limiter = RateLimiter(client, name, rate=rate, burst=burst)
    barrier.wait()
    start_s, start_us = client.time()
    stop = start_s + start_us / 1e6 + seconds
    grants: list[float] = []
    late: list[float] = []
    while True:
        grant = limiter.acquire()
        if grant.waited > 0:
            now_s, now_us = client.time()
            late.append(now_s + now_us / 1e6 - grant.at)
        grants.append(grant.at)
        if grant.at > stop:
            break
    out.put({"grants": grants, "late": late})
