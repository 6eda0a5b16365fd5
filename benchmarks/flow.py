"""Flow control benchmark: the shared rate's accuracy across processes, the concurrency limit
under contention, and what one acquire costs against a bare Redis round trip.

- rate: 4 processes call ``RateLimiter.acquire()`` flat out for T seconds; the grants whose
  turn fell within T of the first one, against ``burst + rate * T`` (target: within 5 %). Also
  counted by when the sleeper really woke, and how late it woke (p99).
- concurrency: 8 processes x 2 threads take slots of 2 keys (limit 2), hold 2 ms, for T
  seconds, counting themselves inside the slot; the most holders seen at once per key
  (checked: never above the limit), throughput, wait p50/p99, fewest and most grants per
  thread (0 would be a starved thread).
- cost: uncontended, interleaved rounds, median: ``RateLimiter.try_acquire`` (one script) and
  ``ConcurrencyLimiter.hold`` + release (two scripts) against ``PING``, the bare round trip,
  with ``RedisLock`` acquire + release (also two scripts) beside them.

    .venv/bin/python -m benchmarks.flow [--quick] [--json]
"""

from __future__ import annotations

import multiprocessing
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from benchmarks.backends import redis_url
from benchmarks.plotting import RESULTS, pyplot, save
from benchmarks.suite import module_main
from resources.flow import ConcurrencyLimiter, RateLimiter
from resources.locks import MemoryLockStats, RedisLock
from resources.storage.redis import redis_client

PROCESSES = 4
LIMIT = 2
KEYS = ["a", "b"]

# KEYS[1] - holders now of one key   KEYS[2] - the most holders seen at once
# returns the holders now, this one counted
COUNT_IN = """
local n = redis.call('INCR', KEYS[1])
if n > tonumber(redis.call('GET', KEYS[2]) or '0') then redis.call('SET', KEYS[2], n) end
return n
"""


def gauge_keys(tag: str, key: str) -> list[str]:
    """Where the holders of ``key`` count themselves: now, and the most at once (one hash tag).
    The tests use the same gauge."""
    return [f"{tag}:gauge:{{{key}}}:now", f"{tag}:gauge:{{{key}}}:max"]


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _ms(value: float | None) -> float | None:
    return None if value is None else round(1000 * value, 2)


def _in_processes(
    processes: int, target: Callable[..., None], args: tuple[Any, ...], timeout: float
) -> list[Any]:
    """Run ``target(*args, barrier, out)`` in ``processes`` processes started together; return
    what each put on ``out``."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["resources.flow"])  # children fork with the imports done
    barrier = ctx.Barrier(processes)
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, barrier, out)) for _ in range(processes)]
    for p in procs:
        p.start()
    results = [out.get(timeout=timeout) for _ in procs]
    for p in procs:
        p.join(30)
    return results


def _cleanup(tag: str) -> None:
    client = redis_client(redis_url())
    for key in client.scan_iter(match=f"*{tag}*", count=1000):
        client.delete(key)


# -- rate accuracy -------------------------------------------------------------------------------


def take_tokens(
    url: str, name: str, rate: float, burst: float, seconds: float, barrier: Any, out: Any
) -> None:
    """One process of the rate run (the tests run it too): ``acquire()`` flat out until a turn
    falls ``seconds`` after this process began (server time); puts the turns and wake times."""
    client = redis_client(url)
    limiter = RateLimiter(client, name, rate=rate, burst=burst)
    barrier.wait()
    now_s, now_us = client.time()
    stop = now_s + now_us / 1e6 + seconds
    turns: list[float] = []
    woke: list[float] = []
    while True:
        grant = limiter.acquire()
        now_s, now_us = client.time()
        turns.append(grant.at)
        woke.append(now_s + now_us / 1e6)
        if grant.at > stop:
            break
    out.put({"turns": turns, "woke": woke})


def rate_accuracy(rate: float, burst: float, seconds: float) -> dict[str, Any]:
    name = f"bench:flow:rate:{uuid.uuid4().hex[:8]}"
    results = _in_processes(
        PROCESSES, take_tokens, (redis_url(), name, rate, burst, seconds + 1.0), seconds + 180
    )
    _cleanup(name)
    turns = sorted(t for r in results for t in r["turns"])
    woke = sorted(w for r in results for w in r["woke"])
    start = turns[0]
    expected = burst + rate * seconds
    by_turn = sum(1 for t in turns if t <= start + seconds)
    by_wake = sum(1 for w in woke if w <= start + seconds)
    late = [w - t for r in results for t, w in zip(r["turns"], r["woke"], strict=True)]
    _plot_rate(turns, start, rate, burst, seconds)
    return {
        "processes": PROCESSES,
        "rate_per_s": rate,
        "burst": burst,
        "seconds": seconds,
        "expected": expected,
        "granted_by_turn": by_turn,
        "granted_by_wake": by_wake,
        "ratio_by_turn": round(by_turn / expected, 4),
        "ratio_by_wake": round(by_wake / expected, 4),
        "late_wake_p50_ms": _ms(_percentile(late, 0.50)),
        "late_wake_p99_ms": _ms(_percentile(late, 0.99)),
    }


def _plot_rate(turns: list[float], start: float, rate: float, burst: float, seconds: float) -> None:
    plt = pyplot()
    if plt is None:
        return
    xs = [t - start for t in turns if t <= start + seconds]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.step(xs, range(1, len(xs) + 1), where="post", label="grants (4 processes)")
    ax.plot([0, seconds], [burst, burst + rate * seconds], "--", label="burst + rate x t")
    ax.set_xlabel("seconds (Redis server time)")
    ax.set_ylabel("tokens granted")
    ax.set_title(f"shared rate {rate:g}/s, burst {burst:g}")
    ax.legend()
    save(fig, RESULTS / "flow_rate.png")


# -- concurrency under contention ----------------------------------------------------------------


def take_slots(
    url: str,
    tag: str,
    limit: int,
    threads: int,
    rounds: int | None,
    seconds: float | None,
    hold: float,
    barrier: Any,
    out: Any,
) -> None:
    """One process of the contention run (the tests run it too): ``threads`` threads take
    slots of :data:`KEYS` in turn (``rounds`` each, or for ``seconds``), count themselves in
    the gauge inside the slot and hold it ``hold`` seconds. Puts per thread the grants as
    ``(key, fence, waited)`` and any errors."""
    client = redis_client(url)
    limiter = ConcurrencyLimiter(client, tag, limit=limit, lease=10)
    count_in = client.register_script(COUNT_IN)
    grants: list[list[tuple[str, int, float]]] = [[] for _ in range(threads)]
    errors: list[str] = []

    def work(index: int) -> None:
        deadline = None if seconds is None else time.monotonic() + seconds
        done = 0
        while (rounds is None or done < rounds) and (
            deadline is None or time.monotonic() < deadline
        ):
            key = KEYS[(index + done) % len(KEYS)]
            done += 1
            now, most = gauge_keys(tag, key)
            try:
                with limiter.hold(key, blocking_timeout=60) as slot:
                    count_in(keys=[now, most])
                    time.sleep(hold)
                    client.decr(now)
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            grants[index].append((key, slot.fence, slot.waited))

    barrier.wait()
    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    out.put({"grants": grants, "errors": errors})


def contention(processes: int, threads: int, seconds: float, hold: float = 0.002) -> dict[str, Any]:
    tag = f"bench:flow:slots:{uuid.uuid4().hex[:8]}"
    results = _in_processes(
        processes, take_slots, (redis_url(), tag, LIMIT, threads, None, seconds, hold),
        seconds + 180,
    )
    per_thread = [[w for _, _, w in grants] for r in results for grants in r["grants"]]
    client = redis_client(redis_url())
    most = {k: int(client.get(gauge_keys(tag, k)[1]) or 0) for k in KEYS}
    _cleanup(tag)
    waits = [w for ws in per_thread for w in ws]
    counts = sorted(len(ws) for ws in per_thread)
    return {
        "workers": f"{processes} processes x {threads} threads",
        "keys": len(KEYS),
        "limit": LIMIT,
        "hold_ms": hold * 1000,
        "most_holders_at_once": most,
        "never_exceeded": all(m <= LIMIT for m in most.values()),
        "errors": sum(len(r["errors"]) for r in results),
        "acquisitions": len(waits),
        "throughput_per_s": round(len(waits) / seconds, 1),
        "wait_p50_ms": _ms(_percentile(waits, 0.50)),
        "wait_p99_ms": _ms(_percentile(waits, 0.99)),
        "min_per_thread": counts[0],
        "max_per_thread": counts[-1],
        "starved_threads": sum(1 for c in counts if c == 0),
    }


# -- cost per acquire ----------------------------------------------------------------------------


def cost(quick: bool) -> dict[str, Any]:
    client = redis_client(redis_url())
    tag = f"bench:flow:cost:{uuid.uuid4().hex[:8]}"
    bucket = RateLimiter(client, tag, rate=1e9, burst=1e9)
    limiter = ConcurrencyLimiter(client, tag, limit=1)
    lock = RedisLock(client, tag, ttl=30, blocking_timeout=0, observer=MemoryLockStats())

    def hold_release() -> None:
        with limiter.hold("k", blocking_timeout=0):
            pass

    def lock_unlock() -> None:
        with lock:
            pass

    contenders: dict[str, Callable[[], Any]] = {
        "PING (bare round trip)": client.ping,
        "RateLimiter.try_acquire": bucket.try_acquire,
        "ConcurrencyLimiter.hold + release": hold_release,
        "RedisLock acquire + release (peer)": lock_unlock,
    }
    n, rounds = (500, 3) if quick else (2000, 7)
    for once in contenders.values():  # warm up: connection, script cache
        for _ in range(50):
            once()
    samples: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(rounds):
        for label, once in contenders.items():
            started = time.perf_counter()
            for _ in range(n):
                once()
            samples[label].append((time.perf_counter() - started) / n)
    _cleanup(tag)
    median = {k: statistics.median(v) for k, v in samples.items()}
    floor = median["PING (bare round trip)"]
    return {
        label: {"us_per_op": round(1e6 * sec, 1), "ratio_to_round_trip": round(sec / floor, 2)}
        for label, sec in median.items()
    }


# -- the suite -----------------------------------------------------------------------------------


def run(quick: bool = False) -> dict[str, Any]:
    rate, burst, seconds = (100.0, 10.0, 2.0) if quick else (200.0, 20.0, 5.0)
    result: dict[str, Any] = {
        "rate": rate_accuracy(rate, burst, seconds),
        "concurrency": contention(8, 2, 1.5 if quick else 4.0),
        "cost": cost(quick),
        "settings": {"quick": quick, "redis": redis_url()},
    }
    result["summary"] = summary(result)
    return result


def summary(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Headline rows for ``sekali bench``."""
    r, c = result["rate"], result["concurrency"]
    rows: list[dict[str, Any]] = [
        {"metric": f"rate accuracy, {r['processes']} processes at {r['rate_per_s']:g}/s burst "
         f"{r['burst']:g} for {r['seconds']:g} s (late wake p99 {r['late_wake_p99_ms']} ms)",
         "value": r["granted_by_turn"], "unit": "grants", "baseline": r["expected"],
         "ratio": r["ratio_by_turn"], "target": "0.95-1.05",
         "ok": 0.95 <= r["ratio_by_turn"] <= 1.05},
        {"metric": f"concurrency limit {c['limit']} on {c['keys']} keys, {c['workers']}: most "
         f"holders at once {max(c['most_holders_at_once'].values())}, min/max per thread "
         f"{c['min_per_thread']}/{c['max_per_thread']}",
         "value": c["wait_p99_ms"], "unit": "p99 wait ms",
         "baseline": f"p50 {c['wait_p50_ms']} ms", "ratio": None,
         "target": "never exceeded, none starved",
         "ok": c["never_exceeded"] and c["starved_threads"] == 0 and not c["errors"]},
    ]
    for label, target in (("RateLimiter.try_acquire", 3.0),
                          ("ConcurrencyLimiter.hold + release", 6.0)):
        row = result["cost"][label]
        rows.append({"metric": f"uncontended {label}", "value": row["us_per_op"], "unit": "us",
                     "baseline": "PING round trip", "ratio": row["ratio_to_round_trip"],
                     "target": f"<= {target:g}", "ok": row["ratio_to_round_trip"] <= target})
    return rows


def render(result: dict[str, Any]) -> None:
    r, c = result["rate"], result["concurrency"]
    print(f"rate {r['rate_per_s']:g}/s burst {r['burst']:g}, {r['processes']} processes, "
          f"{r['seconds']:g} s: expected {r['expected']:g}, granted {r['granted_by_turn']} by "
          f"turn ({r['ratio_by_turn']}), {r['granted_by_wake']} by wake ({r['ratio_by_wake']}); "
          f"late wake p50/p99 {r['late_wake_p50_ms']}/{r['late_wake_p99_ms']} ms")
    print(f"concurrency limit {c['limit']}, {c['workers']}, {c['keys']} keys: most at once "
          f"{c['most_holders_at_once']}, {c['throughput_per_s']} grants/s, wait p50/p99 "
          f"{c['wait_p50_ms']}/{c['wait_p99_ms']} ms, per thread {c['min_per_thread']}.."
          f"{c['max_per_thread']}")
    for label, row in result["cost"].items():
        print(f"  {label:36} {row['us_per_op']:>8} us  x{row['ratio_to_round_trip']} round trip")


def main() -> None:
    module_main(__doc__, run, render)


if __name__ == "__main__":
    main()
