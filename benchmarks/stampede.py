"""Stampede benchmark: naive get-or-load-then-set, dogpile.cache (Redis backend, distributed lock)
and sekali's StampedeCache, side by side in one run on a real Redis.

1. cold expiry of one hot key, 4 processes x 50 threads, 200 ms loader: loader calls, latency;
2. the same with a stale value present (plus a fresh-hit baseline to compare with);
3. 1,000 keys loaded together with one TTL, read uniformly: loader calls over time, peak / mean,
   with the cache's defaults (spread first refresh, +/-10% jitter, XFetch) against no jitter and
   +/-10% / +/-50% jitter alone (PNG in benchmarks/results/stampede_jitter.png);
4. hit path rate against a raw GET.

``--quick``: one extra cold run and one thread-floor run instead of two
and three (the cold waiters' p99 is then the median of two runs, and swings by some ms with the
machine's scheduling), a 5 s cohort window instead of 10 s, only the defaults and no jitter in
(3) (the headline is the defaults' peak/mean; the +/-10% and +/-50% rows are the full run's),
and the hit path's rounds of 100 calls instead of 250 (three interleaved repetitions either
way, the spread in the report). A fresh interpreter per scenario is kept: the tail is what is
measured.

Run: ``.venv/bin/python -m benchmarks.stampede [--quick]`` (REDIS_URL, default 127.0.0.1:6379).
"""

from __future__ import annotations

import json
import multiprocessing
import random
import statistics
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import redis

from benchmarks.backends import optional_peer, redis_url
from benchmarks.plotting import RESULTS, pyplot, save
from benchmarks.spread import REPETITIONS, Spread
from benchmarks.suite import module_main
from resources.cache.core import StampedeCache

LOADER_SECONDS = 0.2
PROCESSES = 4
THREADS = 50


def _redis_url() -> str:
    return redis_url()


# -- scenario workers (module level: started from a forkserver) ----------------------------------


def _make_getter(impl: str, url: str, ns: str, scenario: str, client: redis.Redis) -> Any:
    """The implementation's get; its ``warm()`` (when it has one) opens its connection first."""
    counter = f"bench:{ns}:loads"

    def loader() -> dict[str, int]:
        n = int(client.incr(counter))
        time.sleep(LOADER_SECONDS)
        return {"v": n}

    if impl == "floor":  # no cache: every caller runs the loader's wait itself, uncounted
        return lambda: time.sleep(LOADER_SECONDS)
    if impl == "naive":
        key = f"bench:{ns}:naive"

        def naive() -> Any:
            raw = client.get(key)
            if raw is not None:
                return json.loads(raw)
            value = loader()
            client.set(key, json.dumps(value), px=60_000)
            return value

        return naive
    if impl == "dogpile":
        from dogpile.cache import make_region  # noqa: PLC0415 - only the benchmark needs it

        region = make_region().configure(
            "dogpile.cache.redis",
            expiration_time=1 if scenario == "stale" else 60,
            arguments={
                "url": url,
                "distributed_lock": True,
                "thread_local_lock": False,
                "lock_timeout": 30,
                "redis_expiration_time": 600,
            },
        )
        def get_dogpile() -> Any:
            return region.get_or_create(f"bench:{ns}:dogpile", loader)

        get_dogpile.warm = lambda: region.get(f"bench:{ns}:warm")  # type: ignore[attr-defined]
        return get_dogpile
    cache = StampedeCache.from_url(url, namespace=f"bench{ns}", wait_timeout=60, lock_ttl=30)

    def get() -> Any:
        return cache.get_or_load("hot", loader, ttl=60, stale_ttl=600)

    get.warm = lambda: cache.get_or_load(  # type: ignore[attr-defined]
        "warm", lambda: {"v": 0}, ttl=60
    )
    return get


def scenario_worker(
    impl: str, url: str, ns: str, scenario: str, threads: int, ready: Any, go: Any, out: Any
) -> None:
    client = redis.Redis.from_url(url)
    get = _make_getter(impl, url, ns, scenario, client)
    # The scenarios are about a cold (or stale) key, not a cold client: open the connection
    # and load the scripts first, for every implementation alike, as a long-lived worker has.
    client.ping()
    warm = getattr(get, "warm", None)
    if warm is not None:
        warm()
    barrier = threading.Barrier(threads + 1)
    latencies: list[float] = []
    lock = threading.Lock()

    def call() -> None:
        barrier.wait(timeout=120)
        start = time.perf_counter()
        get()
        elapsed = time.perf_counter() - start
        with lock:
            latencies.append(elapsed)

    workers = [threading.Thread(target=call) for _ in range(threads)]
    for worker in workers:
        worker.start()
    ready.put(1)
    go.wait(120)
    barrier.wait(timeout=120)
    for worker in workers:
        worker.join()
    out.put(latencies)
    if scenario == "stale":  # a background refresh may be under way: let it finish
        time.sleep(LOADER_SECONDS * 3)


def _seed(impl: str, url: str, ns: str, scenario: str) -> None:
    """Put the key in the state the scenario starts from: absent (cold) or stale/fresh."""
    client = redis.Redis.from_url(url)
    if impl == "naive" or scenario == "cold":
        return  # absent: naive has no notion of stale, so its 'stale' run is a cold expiry
    if impl == "dogpile":
        from dogpile.cache import make_region  # noqa: PLC0415

        region = make_region().configure(
            "dogpile.cache.redis",
            expiration_time=1,
            arguments={"url": url, "redis_expiration_time": 600},
        )
        region.set(f"bench:{ns}:dogpile", {"v": 0})
        time.sleep(1.05)
        return
    cache = StampedeCache.from_url(url, namespace=f"bench{ns}")
    ttl = 60 if scenario == "hit" else 0.3
    cache.get_or_load("hot", lambda: {"v": 0}, ttl=ttl, stale_ttl=600, jitter=0)
    if scenario != "hit":
        time.sleep(0.35)
    cache.close()
    client.close()


def run_scenario(impl: str, scenario: str) -> dict[str, Any]:
    url = _redis_url()
    ns = uuid.uuid4().hex[:8]
    ctx = multiprocessing.get_context("forkserver")  # a fresh interpreter per scenario was
    ctx.set_forkserver_preload(["redis", "resources.cache", "benchmarks.stampede"])  # most of it
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(target=scenario_worker, args=(impl, url, ns, scenario, THREADS, ready, go, out))
        for _ in range(PROCESSES)
    ]
    for proc in procs:
        proc.start()
    for _ in procs:
        ready.get(timeout=120)
    _seed(impl, url, ns, scenario)
    go.set()
    latencies: list[float] = []
    for _ in procs:
        latencies.extend(out.get(timeout=120))
    for proc in procs:
        proc.join(timeout=60)
    client = redis.Redis.from_url(url)
    loads = int(client.get(f"bench:{ns}:loads") or 0)
    for key in client.scan_iter(match=f"*{ns}*"):
        client.delete(key)
    latencies.sort()
    return {
        "impl": impl,
        "scenario": scenario,
        "callers": len(latencies),
        "loader_calls": loads,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[int(len(latencies) * 0.99) - 1],
        "max_ms": 1000 * latencies[-1],
    }


# -- (3) jitter -----------------------------------------------------------------------------------


COHORT_CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "none": {"jitter": 0.0, "spread_first_refresh": False, "beta": 0.0},
    "jitter_10pct_unspread": {"jitter": 0.1, "spread_first_refresh": False, "beta": 0.0},
    "jitter_50pct_unspread": {"jitter": 0.5, "spread_first_refresh": False, "beta": 0.0},
}
"""The cache's defaults against what came before them: no jitter, and +/-10% (the old default)
or +/-50% jitter without the spread first refresh or XFetch."""
QUICK_COHORT_CONFIGS = ("default", "none")
"""The cohort configurations ``--quick`` runs: the headline's and the one it is read against."""


def run_jitter(
    label: str, seconds: float, *, ttl: float, bucket: float, reads_per_s: int = 5000
) -> dict[str, Any]:
    """1,000 keys written at one instant with one TTL, then read uniformly at ``reads_per_s``,
    on a cache built with ``COHORT_CONFIGS[label]`` (the defaults for ``"default"``).

    Runs on the cache's injected clock: each read advances it by ``1 / reads_per_s``, so the
    read rate (and with it the expiry schedule) does not depend on how loaded this machine is.
    Everything else is real: the Redis, the scripts, the loads. Values are served stale while
    one refresh runs (``stale_ttl``), which also keeps Redis from deleting keys on its own
    (real-time) TTL before the cache clock reaches their expiry.
    """
    url = _redis_url()
    ns = "bench" + uuid.uuid4().hex[:8]
    now = [time.time()]
    config = COHORT_CONFIGS[label]
    jitter = float(config.get("jitter", 0.1))
    cache = StampedeCache.from_url(
        url, namespace=ns, stats_flush_interval=5, clock=lambda: now[0], **config
    )
    loads: list[float] = []

    def loader_for(i: int) -> Any:
        def load() -> int:
            loads.append(now[0])
            return i

        return load

    keys = [f"k:{i}" for i in range(1000)]
    for i, key in enumerate(keys):
        cache.get_or_load(key, loader_for(i), ttl=ttl, stale_ttl=3600)
    start = now[0]
    loads.clear()
    rng = random.Random(5)
    step = 1.0 / reads_per_s
    for _ in range(int(seconds * reads_per_s)):
        now[0] += step
        i = rng.randrange(1000)
        cache.get_or_load(keys[i], loader_for(i), ttl=ttl, stale_ttl=3600)
    cache.close()
    client = redis.Redis.from_url(url)
    for key in client.scan_iter(match=f"*{ns}*", count=1000):
        client.delete(key)
    n_buckets = int(seconds / bucket)
    counts = [0] * n_buckets
    for t in loads:
        index = int((t - start) / bucket)
        if 0 <= index < n_buckets:
            counts[index] += 1
    # Judge from just before the first expiry of the unspread configurations (until then they
    # load nothing); the same window for every configuration.
    settled = counts[int(ttl * (1 - max(jitter, 0.05)) / bucket) :]
    mean = statistics.mean(settled) if settled else 0.0
    return {
        "label": label,
        "config": config,
        "jitter": jitter,
        "ttl_s": ttl,
        "bucket_s": bucket,
        "reads_per_s": reads_per_s,
        "loader_calls": len(loads),
        "calls_per_s": [c / bucket for c in counts],
        "peak_over_mean": (max(settled) / mean) if mean else 0.0,
    }


def plot_jitter(rows: list[dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(9, 4))
    for row in rows:
        xs = [i * row["bucket_s"] for i in range(len(row["calls_per_s"]))]
        label = f"{row['label']} (peak/mean {row['peak_over_mean']:.2f})"
        ax.plot(xs, row["calls_per_s"], label=label)
    ax.set_xlabel("seconds")
    ax.set_ylabel("loader calls / s")
    ax.set_title(f"1,000 keys, one TTL ({rows[0]['ttl_s']} s), read uniformly")
    ax.legend()
    save(fig, path, dpi=100)


# -- (4) hit path ----------------------------------------------------------------------------------


def run_hit_path(n: int, repetitions: int = REPETITIONS) -> dict[str, Any]:
    """Hits per second of ``get_or_load`` on a fresh key against a raw ``GET`` plus
    ``json.loads`` of the same value on the same client (the cache's own), in one run.

    Each repetition alternates short rounds of both (raw, hit, raw, hit, ...) and takes the
    median of the adjacent pairs' ratios: on a shared machine a round that lost the CPU says
    nothing about the code, and its neighbour of the other side mostly lost it too (the best
    round of each side, kept before, swung by 0.2 between repetitions here). The headline is the
    median of the repetitions' ratios (``benchmarks.spread``)."""
    url = _redis_url()
    ns = "bench" + uuid.uuid4().hex[:8]
    cache = StampedeCache.from_url(url, namespace=ns)
    client = cache.client
    value = {"id": 1, "name": "x" * 100}
    client.set(f"{ns}:raw", json.dumps(value))
    cache.get_or_load("hit", lambda: value, ttl=600)
    for _ in range(200):  # warm the connection
        client.get(f"{ns}:raw")
        cache.get_or_load("hit", lambda: None, ttl=600)
    fns = {
        "raw_get": lambda: json.loads(client.get(f"{ns}:raw") or b"null"),
        "sekali_hit": lambda: cache.get_or_load("hit", lambda: None, ttl=600),
    }
    rounds, per_round = 60, max(100, n // 40)
    rates: dict[str, list[float]] = {"raw_get": [], "sekali_hit": []}
    ratios: list[float] = []
    for _ in range(repetitions):
        pairs = []
        for _ in range(rounds):
            pair = {}
            for name, fn in fns.items():
                start = time.perf_counter()
                for _ in range(per_round):
                    fn()
                pair[name] = per_round / (time.perf_counter() - start)
            pairs.append(pair)
        ratios.append(statistics.median(p["sekali_hit"] / p["raw_get"] for p in pairs))
        for name in fns:
            rates[name].append(statistics.median(p[name] for p in pairs))
    cache.close()
    cleanup = redis.Redis.from_url(url)
    for key in cleanup.scan_iter(match=f"*{ns}*"):
        cleanup.delete(key)
    cleanup.close()
    spread = Spread.of(ratios)
    return {
        "raw_get_per_s": statistics.median(rates["raw_get"]),
        "sekali_hit_per_s": statistics.median(rates["sekali_hit"]),
        "ratio": spread.median,
        "repetitions": {"raw_get_runs": [round(r, 1) for r in rates["raw_get"]],
                        "sekali_hit_runs": [round(r, 1) for r in rates["sekali_hit"]],
                        "ratio": spread.as_dict()},
    }


# -- driver ---------------------------------------------------------------------------------------


def run(quick: bool = False) -> dict[str, Any]:
    dogpile = optional_peer("dogpile.cache", package="dogpile.cache", suite="stampede")
    impls = ("naive", "dogpile", "sekali") if dogpile is not None else ("naive", "sekali")
    scenarios = [
        run_scenario(impl, scenario)
        for scenario in ("cold", "stale")
        for impl in impls
    ]
    # The cold waiters' tail is the scheduling of 200 threads on a shared machine: take the
    # median of a few runs' p99 rather than one run's.
    extra_cold = [run_scenario("sekali", "cold") for _ in range(1 if quick else 2)]
    # The same 200 threads doing only the loader's wait: what scheduling them costs here.
    floor_p99s = [run_scenario("floor", "cold")["p99_ms"] for _ in range(1 if quick else 3)]
    hit = run_scenario("sekali", "hit")
    seconds = 5.0 if quick else 10.0
    labels = QUICK_COHORT_CONFIGS if quick else tuple(COHORT_CONFIGS)
    jitter_rows = [run_jitter(label, seconds, ttl=2.0, bucket=0.1) for label in labels]
    png = RESULTS / "stampede_jitter.png"
    plot_jitter(jitter_rows, png)
    hit_path = run_hit_path(4000 if quick else 10000)
    by = {(r["impl"], r["scenario"]): r for r in scenarios}
    sek_stale = by[("sekali", "stale")]
    cold_p99s = [r["p99_ms"] for r in [by[("sekali", "cold")], *extra_cold]]
    cohort = {r["label"]: r["peak_over_mean"] for r in jitter_rows}
    ratios = {
        "sekali_cold_p99_minus_loader_ms": statistics.median(cold_p99s) - 1000 * LOADER_SECONDS,
        "thread_floor_p99_minus_loader_ms": statistics.median(floor_p99s)
        - 1000 * LOADER_SECONDS,
        "dogpile_cold_p99_minus_loader_ms": by[("dogpile", "cold")]["p99_ms"]
        - 1000 * LOADER_SECONDS if ("dogpile", "cold") in by else None,
        "sekali_stale_p99_over_hit_p99": sek_stale["p99_ms"] / hit["p99_ms"],
        "hit_path_over_raw_get": hit_path["ratio"],
        **{f"peak_over_mean_{label}": value for label, value in cohort.items()},
    }
    return {
        "quick": quick,
        "scenarios": scenarios,
        "cold_p99_ms_runs": cold_p99s,
        "thread_floor_p99_ms_runs": floor_p99s,
        "hit_baseline": hit,
        "jitter": [{k: v for k, v in r.items() if k != "calls_per_s"} for r in jitter_rows],
        "jitter_plot": str(png),
        "hit_path": hit_path,
        "ratios": ratios,
        "summary": summary(by, hit, hit_path, ratios),
        "headline_spread": {"cache_hit_ratio_vs_get": hit_path["repetitions"]["ratio"]},
        "headline": {
            "stampede_cohort_peak_over_mean_default": round(cohort["default"], 3),
            "cache_hit_ratio_vs_get": round(hit_path["ratio"], 3),
            "cold_waiter_p99_past_loader_ms": round(
                ratios["sekali_cold_p99_minus_loader_ms"], 1
            ),
            "cold_waiter_p99_past_thread_floor_ms": round(
                ratios["sekali_cold_p99_minus_loader_ms"]
                - ratios["thread_floor_p99_minus_loader_ms"], 1
            ),
        },
    }


def summary(
    by: dict[tuple[str, str], dict[str, Any]],
    hit: dict[str, Any],
    hit_path: dict[str, Any],
    ratios: dict[str, float],
) -> list[dict[str, Any]]:
    """Headline rows for ``sekali bench``."""
    rows: list[dict[str, Any]] = []
    for scenario in ("cold", "stale"):
        for impl in ("naive", "dogpile", "sekali"):
            if (impl, scenario) not in by:  # a peer that is not installed
                continue
            r = by[(impl, scenario)]
            rows.append({"metric": f"{scenario} expiry, {PROCESSES}x{THREADS} callers: {impl} "
                         "loader calls", "value": r["loader_calls"], "unit": "calls",
                         "baseline": f"p99 {r['p99_ms']:.0f} ms", "ratio": None,
                         "target": 1 if impl == "sekali" else None,
                         "ok": r["loader_calls"] == 1 if impl == "sekali" else None})
    cold = ratios["sekali_cold_p99_minus_loader_ms"]
    theirs = ratios["dogpile_cold_p99_minus_loader_ms"]
    peer = "not installed" if theirs is None else f"{theirs:.0f} ms"
    rows.append({"metric": "cold waiters p99 past the loader time, median of runs (dogpile: "
                 f"{peer})", "value": round(cold, 1),
                 "unit": "ms", "baseline": "loader time", "ratio": None, "target": "<= 10 ms",
                 "ok": cold <= 10})
    stale = ratios["sekali_stale_p99_over_hit_p99"]
    rows.append({"metric": "stale-window p99 over a fresh hit's p99", "value": round(stale, 2),
                 "unit": "x", "baseline": f"hit p99 {hit['p99_ms']:.1f} ms", "ratio": stale,
                 "target": "<= 2", "ok": stale <= 2})
    rows.append({"metric": "hit path rate", "value": round(hit_path["sekali_hit_per_s"]),
                 "unit": "gets/s", "baseline": "raw GET", "ratio": round(hit_path["ratio"], 3),
                 "target": 0.9, "ok": hit_path["ratio"] >= 0.9})
    for label in COHORT_CONFIGS:
        if f"peak_over_mean_{label}" not in ratios:  # left out of a --quick run
            continue
        value = ratios[f"peak_over_mean_{label}"]
        rows.append({"metric": f"1,000 keys loaded together, loader peak/mean, {label}",
                     "value": round(value, 2), "unit": "x", "baseline": "mean rate",
                     "ratio": None, "target": "<= 1.5" if label == "default" else None,
                     "ok": value <= 1.5 if label == "default" else None})
    return rows


def render(results: dict[str, Any]) -> None:
    print(
        f"(1)/(2) {PROCESSES} processes x {THREADS} threads, {LOADER_SECONDS * 1000:.0f} ms loader"
    )
    print(f"{'scenario':8} {'impl':8} {'loads':>5} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for r in [*results["scenarios"], results["hit_baseline"]]:
        print(
            f"{r['scenario']:8} {r['impl']:8} {r['loader_calls']:>5} {r['p50_ms']:>8.1f} "
            f"{r['p99_ms']:>8.1f} {r['max_ms']:>8.1f}"
        )
    print("\n(3) 1,000 keys, one TTL, read uniformly (5,000 reads per second of cache clock)")
    for r in results["jitter"]:
        print(
            f"{r['label']} {r['config']}: {r['loader_calls']} loads, "
            f"peak/mean {r['peak_over_mean']:.2f} ({r['bucket_s']} s buckets)"
        )
    print(f"plot: {results['jitter_plot']}")
    h = results["hit_path"]
    print(
        f"\n(4) hit path {h['sekali_hit_per_s']:.0f}/s vs raw GET {h['raw_get_per_s']:.0f}/s "
        f"= {h['ratio']:.2f}"
    )
    print("\nratios / targets")
    for name, value in results["ratios"].items():
        print(f"  {name:36} {'-' if value is None else f'{value:8.2f}':>8}")



def main() -> None:
    module_main(__doc__, run, render)


if __name__ == "__main__":
    main()
