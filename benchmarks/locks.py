"""Lock benchmark: sekali's RedisLock against the raw floor, redis-py Lock and python-redis-lock.

Uncontended: acquire+release pairs per second on one name, against the two-round-trip floor
(``SET NX PX`` + a Lua compare-and-delete), all measured in the same run, interleaved in rounds
so machine noise hits every contender alike; the median round counts.

Contended: 8 and 32 client processes loop acquire / hold 2 ms / release on one name for a few
seconds: throughput, wait p50/p99, and min/max acquisitions per client (a client with 0 starved).

``--quick``: 600 pairs per contender in three rounds (full: 3,000 in seven), and 1 s of
contention instead of 6 s. The uncontended ratios are medians of three
interleaved rounds, as in the full run; the contended throughput ratio is noisier (a second of
32 processes on two cores is mostly scheduling): read the contended rows of a quick run as a
smoke test, not a figure.

    .venv/bin/python -m benchmarks.locks [--quick] [--json]
"""

from __future__ import annotations

import json
import multiprocessing
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis

from benchmarks.backends import optional_peer, redis_url
from benchmarks.spread import REPETITIONS
from resources.locks import MemoryLockStats, RedisLock

_DELETE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def _floor(client: redis.Redis, name: str) -> Callable[[], None]:
    delete = client.register_script(_DELETE)
    key = f"bench:floor:{{{name}}}"

    def once() -> None:
        token = uuid.uuid4().hex
        if not client.set(key, token, nx=True, px=30_000):
            raise RuntimeError("floor lock unexpectedly held")
        delete(keys=[key], args=[token])

    return once


def _sekali(client: redis.Redis, name: str, auto_renew: bool, stats: bool) -> Callable[[], None]:
    observer = None if stats else MemoryLockStats()
    lock = RedisLock(
        client, name, ttl=30, auto_renew=auto_renew, blocking_timeout=0, observer=observer
    )

    def once() -> None:
        lock.acquire()
        lock.release()

    return once


def _redis_py(client: redis.Redis, name: str) -> Callable[[], None]:
    lock = client.lock(f"bench:redispy:{name}", timeout=30, blocking=False)

    def once() -> None:
        if not lock.acquire():
            raise RuntimeError("redis-py lock unexpectedly held")
        lock.release()

    return once


def _python_redis_lock(
    redis_lock: Any, client: redis.Redis, name: str
) -> Callable[[], None]:
    lock = redis_lock.Lock(client, f"bench:prl:{name}", expire=30)

    def once() -> None:
        if not lock.acquire(blocking=False):
            raise RuntimeError("python-redis-lock unexpectedly held")
        lock.release()

    return once


def uncontended(quick: bool) -> dict[str, Any]:
    client = redis.Redis.from_url(redis_url())
    run_id = uuid.uuid4().hex[:8]
    contenders: dict[str, Callable[[], None]] = {
        "floor (SET NX PX + Lua DEL)": _floor(client, run_id),
        "sekali RedisLock (no renewal)": _sekali(client, f"bench:a:{run_id}", False, False),
        "sekali RedisLock (renewal + Redis stats)": _sekali(
            client, f"bench:b:{run_id}", True, True
        ),
        "redis-py Lock": _redis_py(client, run_id),
    }
    redis_lock = optional_peer("redis_lock", package="python-redis-lock", suite="locks")
    if redis_lock is not None:
        contenders["python-redis-lock"] = _python_redis_lock(redis_lock, client, run_id)
    n, rounds = (600, REPETITIONS) if quick else (3000, 7)
    for once in contenders.values():  # warm up: connections, script cache
        for _ in range(50):
            once()
    samples: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(rounds):
        for label, once in contenders.items():
            start = time.perf_counter()
            for _ in range(n):
                once()
            samples[label].append(n / (time.perf_counter() - start))
    median = {k: statistics.median(v) for k, v in samples.items()}
    floor = median["floor (SET NX PX + Lua DEL)"]
    for key in client.scan_iter(match=f"*{run_id}*"):
        client.delete(key)
    return {
        label: {"ops_per_s": round(ops, 1), "ratio_to_floor": round(ops / floor, 3)}
        for label, ops in median.items()
    }


def _client_loop(
    kind: str, name: str, barrier: Any, duration: float, hold: float, out: Any
) -> None:
    client = redis.Redis.from_url(redis_url())
    lock: Any
    if kind == "sekali":
        lock = RedisLock(client, name, ttl=10, blocking_timeout=60, observer=MemoryLockStats())
    else:
        lock = client.lock(name, timeout=10, blocking_timeout=60)  # redis-py default sleep 0.1
    barrier.wait()
    waits: list[float] = []
    deadline = time.monotonic() + duration
    while time.monotonic() < deadline:
        started = time.monotonic()
        if lock.acquire() is False:
            continue
        waits.append(time.monotonic() - started)
        time.sleep(hold)
        lock.release()
    out.put(waits)


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def contended(kind: str, clients: int, duration: float, hold: float = 0.002) -> dict[str, Any]:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["resources.locks"])  # children fork with imports done
    barrier = ctx.Barrier(clients)
    out = ctx.Queue()
    name = f"bench:contended:{kind}:{uuid.uuid4().hex[:8]}"
    procs = [
        ctx.Process(target=_client_loop, args=(kind, name, barrier, duration, hold, out))
        for _ in range(clients)
    ]
    for p in procs:
        p.start()
    per_client = [out.get(timeout=duration + 180) for _ in procs]
    for p in procs:
        p.join(30)
    counts = sorted(len(w) for w in per_client)
    waits = [w for ws in per_client for w in ws]
    return {
        "clients": clients,
        "acquisitions": sum(counts),
        "throughput_per_s": round(sum(counts) / duration, 1),
        "wait_p50_ms": None if not waits else round(1000 * _percentile(waits, 0.50), 2),  # type: ignore[operator]
        "wait_p99_ms": None if not waits else round(1000 * _percentile(waits, 0.99), 2),  # type: ignore[operator]
        "min_per_client": counts[0],
        "max_per_client": counts[-1],
        "starved_clients": sum(1 for c in counts if c == 0),
    }


def run(quick: bool = False) -> dict[str, Any]:
    duration = 1.0 if quick else 6.0
    result: dict[str, Any] = {"uncontended": uncontended(quick), "contended": {}}
    for clients in (8, 32):
        for kind in ("sekali", "redis-py"):
            result["contended"][f"{kind} x{clients}"] = contended(kind, clients, duration)
    for clients in (8, 32):
        ours = result["contended"][f"sekali x{clients}"]
        theirs = result["contended"][f"redis-py x{clients}"]
        ours["throughput_ratio_vs_redis_py"] = (
            round(ours["throughput_per_s"] / theirs["throughput_per_s"], 2)
            if theirs["throughput_per_s"]
            else None
        )
    result["settings"] = {
        "quick": quick, "duration_s": duration, "hold_ms": 2, "redis": redis_url()
    }
    result["summary"] = summary(result)
    return result


def summary(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Headline rows for ``sekali bench``: ratios against the floor and redis-py's lock."""
    un = result["uncontended"]
    rows: list[dict[str, Any]] = []
    for name, target in (("sekali RedisLock (no renewal)", 0.8),
                         ("sekali RedisLock (renewal + Redis stats)", 0.8),
                         ("redis-py Lock", None), ("python-redis-lock", None)):
        if name not in un:  # a peer that is not installed
            continue
        ratio = un[name]["ratio_to_floor"]
        rows.append({"metric": f"uncontended acquire+release, {name}",
                     "value": un[name]["ops_per_s"], "unit": "ops/s",
                     "baseline": "SET NX PX + Lua DEL", "ratio": ratio, "target": target,
                     "ok": None if target is None else ratio >= target})
    for clients in (8, 32):
        ours = result["contended"][f"sekali x{clients}"]
        theirs = result["contended"][f"redis-py x{clients}"]
        rows.append({"metric": f"contended x{clients}: min/max acquisitions per client "
                     f"(sekali {ours['min_per_client']}/{ours['max_per_client']}, redis-py "
                     f"{theirs['min_per_client']}/{theirs['max_per_client']})",
                     "value": ours["wait_p99_ms"], "unit": "p99 wait ms",
                     "baseline": f"redis-py p99 {theirs['wait_p99_ms']} ms",
                     "ratio": ours["throughput_ratio_vs_redis_py"], "target": "no starved client",
                     "ok": ours["starved_clients"] == 0})
    return rows


def main() -> None:
    quick = "--quick" in sys.argv
    result = run(quick=quick)
    print("uncontended acquire+release (median of rounds)")
    print(f"  {'contender':44} {'ops/s':>10} {'x floor':>8}")
    for label, row in result["uncontended"].items():
        print(f"  {label:44} {row['ops_per_s']:>10.0f} {row['ratio_to_floor']:>8.2f}")
    print(f"\ncontended: hold 2 ms, {result['settings']['duration_s']} s per run")
    header = ("acq/s", "p50 ms", "p99 ms")
    print(f"  {'lock':16} " + " ".join(f"{h:>8}" for h in header) + "   min   max  starved")
    for label, row in result["contended"].items():
        print(
            f"  {label:16} {row['throughput_per_s']:>8.1f} {row['wait_p50_ms']:>8} "
            f"{row['wait_p99_ms']:>8} {row['min_per_client']:>5} {row['max_per_client']:>5} "
            f"{row['starved_clients']:>8}"
        )
    if "--json" in sys.argv:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
