"""Intake throughput: jobs per second from ``enqueue`` to ``completed``, per mode and backend.

For each app-database backend (embedded SQLite, Postgres) it measures:

- ``floor``: the per-key handler loop without Dagster: ``enqueue`` each request, then for each
  one take it, :func:`engine.runtime.execute_request`, mark it completed (what the
  micro-batch step did before it was batched), on the same stores.
- ``batch_direct``: the same requests through :func:`pipelines.ops.batch.run_batch` without
  Dagster (keys claimed and completed in one statement each, attempts written together, one
  SMTP connection per batch).
- ``per_request``, ``fan_out``, ``micro_batch``: ``enqueue``, then ticks of the real
  ``intake_sensor`` (``build_sensor_context``), then each RunRequest executed with
  ``execute_in_process`` on one shared in-memory Dagster instance, then a last tick that
  reconciles; the clock stops when every request is ``completed``.

The job is ``send_email`` into the sandbox SMTP sink (a real effect per request), run in its own
process like any downstream: in this one it would share the interpreter lock with the code under
test and bill its parsing and its database to it. Ratios are against the floor measured in the
same run; the headline pair (floor, micro-batch) is measured three times alternating and the
median of the three ratios kept, with its spread (``benchmarks.spread``). Target: micro-batch
>= 2x the per-key loop (the batch beats the loop that bound it). The daemon's own launch cost (a
process per run, several seconds) is not included: it only makes per-request mode look worse.

``--quick`` keeps the headline pair's sizes (100 requests, two micro-batches, three alternating
repetitions per backend: the ratio's spread is in the report) and cuts the modes outside it to
4 per-request runs and a fan-out of 20: their rates, a few Dagster runs each, are rough
(one slow run of four weighs a quarter), the full run's are the figures.

    .venv/bin/python -m benchmarks.intake [--quick]
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dagster as dg

from benchmarks.backends import postgres_schema, postgres_url, redis_url
from benchmarks.spread import interleaved
from benchmarks.suite import module_main
from engine import tags as run_tags
from engine.dead_letters import Subject
from engine.failures import FailurePath
from engine.intake import enqueue
from engine.registry import downstreams
from engine.requests import RequestStore
from engine.runtime import execute_request
from engine.services import Services
from engine.step import run_batch
from pipelines.definitions import defs
from pipelines.ops import all_jobs
from pipelines.ops.batch import BATCH_JOBS
from pipelines.profile import DownstreamResource
from resources.dagster_resources import (
    CacheResource,
    ConcurrencyResource,
    DatabaseResource,
    IdempotencyResource,
    LockResource,
    RetryResource,
)
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from sandbox.redis_server import free_port
from sensors.intake import RequestsResource

BATCH_SIZE = 50
TARGET = 2.0  # micro-batch jobs/s over the per-key handler loop
QUIET = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}


@contextmanager
def backend(name: str, tmp: Path) -> Iterator[str]:
    if name == "sqlite":
        yield f"sqlite:///{tmp / f'bench-{uuid.uuid4().hex[:6]}.db'}"
        return
    with postgres_schema() as url:
        yield url


def each_backend(measure: Callable[[str], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """``measure(url)`` on a fresh SQLite file and a fresh Postgres schema; a backend that fails
    is reported as ``{"error": ...}`` without hiding the other's numbers."""
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("sqlite", "postgres"):
            try:
                with backend(name, Path(tmp)) as url:
                    results[name] = measure(url)
            except Exception as exc:  # noqa: BLE001 - report, do not hide the other numbers
                results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return results


def payloads(tag: str, n: int) -> list[dict[str, Any]]:
    return [
        {
            "template": "welcome",
            "user_id": f"{tag}-{i}",
            "date": "2026-11-29",
            "to": f"u{i}@example.com",
        }
        for i in range(n)
    ]


class SinkProcess:
    """The sandbox SMTP sink in its own process (``python -m sandbox.mailsink``), stopped by its
    own pid."""

    def __init__(self, db: Path) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sandbox.mailsink", "--port", str(self.port),
             "--db-url", f"sqlite:///{db}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the sandbox mail sink did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def per_key_loop(store: Any, ids: list[int], services: Any, run_id: str) -> int:
    """The floor: every request on its own, as the micro-batch step ran them before batching."""

    done = 0
    for request in store.get_many(ids):
        if not store.mark_running(request.id, run_id=run_id):
            continue
        path = FailurePath(attempt=0, retries_here=False)
        try:
            execute_request(
                request.job_type, request.payload, services=services, key=request.key,
                run_id=run_id, correlation_id=request.correlation_id or run_id,
                request_id=request.id, decide=path.outcome,
            )
        except Exception as exc:  # noqa: BLE001 - as the step did: recorded, the loop goes on
            path.settle(store, Subject(request.job_type, request.payload, request.key,
                                       request.id), exc, run_id=run_id, step="floor")
            continue
        store.mark_completed(request.id, run_id=run_id)
        done += 1
    return done


def measure_direct(db: Any, n: int, tag: str, *, batched: bool) -> float:
    """Jobs per second from ``enqueue`` to completed without Dagster: the per-key loop (the
    floor), or ``run_batch`` in batches of ``BATCH_SIZE``."""

    services = Services.from_settings(budget_namespace=tag, cache_namespace=tag)
    store = RequestStore(db)
    started = time.perf_counter()
    ids = [enqueue("send_email", p, db=db).id for p in payloads(tag, n)]
    if batched:
        done = sum(
            run_batch(store, ids[i : i + BATCH_SIZE], services=services, run_id="direct")[
                "completed"
            ]
            for i in range(0, n, BATCH_SIZE)
        )
    else:
        done = per_key_loop(store, ids, services, "floor")
    elapsed = time.perf_counter() - started
    assert done == n, (done, n)
    return n / elapsed


def intake_sensor() -> dg.SensorDefinition:
    """The definitions' ``intake_sensor`` as defined (its resources come with each tick)."""
    return next(s for s in defs.sensors or [] if s.name == "intake_sensor")


def intake_tick(
    instance: Any, resources: dict[str, Any], cursor: str | None
) -> tuple[str | None, list[dict[str, Any]]]:
    """One tick of the real ``intake_sensor`` (what Dagster's sensor daemon runs): its new
    cursor and the runs it asked for, as plain dicts (``job_name``, ``run_config``, ``tags``,
    ``run_key``) that :func:`execute_run` takes, in this process or another."""


    ctx = dg.build_sensor_context(
        instance=instance, cursor=cursor, resources={"requests": resources["requests"]}
    )
    result = intake_sensor()(ctx)
    assert isinstance(result, dg.SensorResult)
    runs = [
        {"job_name": str(rr.job_name), "run_config": rr.run_config, "tags": dict(rr.tags),
         "run_key": rr.run_key or ""}
        for rr in result.run_requests or []
    ]
    return result.cursor, runs


def execute_run(run: dict[str, Any], instance: Any, resources: dict[str, Any]) -> bool:
    """Execute one run the intake asked for, as a run worker does: the job the sensor named,
    its run config and tags, in process (Dagster's own launch cost left out). True when the
    run succeeded."""

    jobs = {j.name: j for j in [*all_jobs, *BATCH_JOBS]}
    result = jobs[run["job_name"]].execute_in_process(
        run_config={**run["run_config"], **QUIET},
        instance=instance,
        resources=resources,
        tags={**run["tags"], run_tags.RUN_KEY: run["run_key"]},
        raise_on_error=False,
    )
    return bool(result.success)


def measure_mode(db: Any, mode: str, n: int, tag: str, instance: Any, resources: dict) -> float:
    os.environ["SEKALI_INTAKE_MODE"] = mode
    store = RequestStore(db)
    before = store.counts()["completed"]
    started = time.perf_counter()
    for p in payloads(tag, n):
        enqueue("send_email", p, db=db)
    cursor = None
    while True:
        cursor, runs = intake_tick(instance, resources, cursor)
        if not runs:
            break
        for run in runs:
            execute_run(run, instance, resources)
    elapsed = time.perf_counter() - started
    counts = store.counts()
    done = counts["completed"] - before
    assert done == n and counts["pending"] == 0, (mode, n, counts)
    return done / elapsed


def run_resources(
    db_url: str, smtp_port: int, tag: str, *, redis: str | None = None,
    lease_seconds: float = 60.0,
) -> dict[str, Any]:
    """The resources a run of the intake jobs needs, on these stores (``redis`` defaults to the
    benchmarks' Redis) and this mail sink."""
    redis = redis or redis_url()
    unused = {  # every other declared downstream: a run of these jobs never calls it
        name: DownstreamResource(downstream=name, address="http://127.0.0.1:9")
        for name in downstreams()
    }
    return unused | {
        "idempotency": IdempotencyResource(database_url=db_url, lease_seconds=lease_seconds),
        "app_db": DatabaseResource(database_url=db_url),
        "locks": LockResource(backend="db", database_url=db_url),
        "cache": CacheResource(redis_url=redis, namespace=tag),
        "smtp": DownstreamResource(downstream="smtp", address=f"127.0.0.1:{smtp_port}"),
        "retry": RetryResource(redis_url=redis, budget_namespace=tag),
        "concurrency": ConcurrencyResource(redis_url=redis, prefix=f"{tag}:flow:limit:"),
        "requests": RequestsResource(database_url=db_url),
    }


def run(quick: bool = False) -> dict[str, Any]:
    sizes = (
        {"floor": 100, "batch_direct": 100, "per_request": 4, "fan_out": 20, "micro_batch": 100}
        if quick
        else {"floor": 500, "batch_direct": 500, "per_request": 40, "fan_out": 200,
              "micro_batch": 500}
    )
    results: dict[str, Any] = {"sizes": sizes, "batch_size": BATCH_SIZE, "backends": {}}
    os.environ["SEKALI_INTAKE_BATCH_SIZE"] = str(BATCH_SIZE)
    os.environ["SEKALI_INTAKE_MAX_PER_TICK"] = "500"
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        sink = SinkProcess(tmp / "sink.db")
        try:
            for name in ("sqlite", "postgres"):
                if name == "postgres" and postgres_url() is None:
                    results["skipped"] = {name: "PostgreSQL is not available"}
                    continue
                with backend(name, tmp) as url, dg.DagsterInstance.ephemeral() as instance:
                    tag = "bi" + uuid.uuid4().hex[:8]
                    os.environ.update(
                        {
                            "DATABASE_URL": url,
                            "REDIS_URL": redis_url(),
                            "SEKALI_SMTP_PORT": str(sink.port),
                        }
                    )
                    db = Database.from_url(url)
                    upgrade(db)
                    resources = run_resources(url, sink.port, tag)
                    # warm-up (pools, SMTP, Redis, imports, Dagster's first run): not measured
                    measure_direct(db, 10, tag + "wf", batched=False)
                    measure_direct(db, 10, tag + "wb", batched=True)
                    measure_mode(db, "micro_batch", 2, tag + "wm", instance, resources)
                    # the headline pair, floor and micro-batch alternating (benchmarks.spread)
                    pair = interleaved(
                        lambda n, db=db, tag=tag: measure_direct(
                            db, sizes["floor"], f"{tag}f{n}", batched=False
                        ),
                        lambda n, db=db, tag=tag, instance=instance, resources=resources: (
                            measure_mode(db, "micro_batch", sizes["micro_batch"], f"{tag}mi{n}",
                                         instance, resources)
                        ),
                    )
                    rates = {
                        "floor": statistics.median(pair.floor),
                        "batch_direct": measure_direct(
                            db, sizes["batch_direct"], tag + "bd", batched=True
                        ),
                    }
                    for mode in ("per_request", "fan_out"):
                        rates[mode] = measure_mode(
                            db, mode, sizes[mode], f"{tag}{mode[:2]}", instance, resources
                        )
                    rates["micro_batch"] = statistics.median(pair.subject)
                    db.dispose()
                    ratios = {k: round(v / rates["floor"], 3) for k, v in rates.items()}
                    ratios["micro_batch"] = round(pair.ratio.median, 3)
                    results["backends"][name] = {
                        "jobs_per_second": {k: round(v, 1) for k, v in rates.items()},
                        "ratio_to_floor": ratios,
                        "micro_batch_repetitions": pair.as_dict(),
                    }
        finally:
            sink.stop()
    results["target_micro_batch_ratio"] = TARGET
    results["micro_batch_meets_target"] = all(
        b["ratio_to_floor"]["micro_batch"] >= TARGET for b in results["backends"].values()
    )
    results["summary"] = [
        {"metric": f"{backend} {mode}, enqueue to completed",
         "value": b["jobs_per_second"][mode], "unit": "jobs/s",
         "baseline": f"per-key loop {b['jobs_per_second']['floor']}/s",
         "ratio": b["ratio_to_floor"][mode],
         "target": TARGET if mode == "micro_batch" else None,
         "ok": b["ratio_to_floor"][mode] >= TARGET if mode == "micro_batch" else None}
        for backend, b in results["backends"].items()
        for mode in ("batch_direct", "per_request", "fan_out", "micro_batch")
    ]
    spreads = {name: b["micro_batch_repetitions"]["ratio"]
               for name, b in results["backends"].items()}
    lower = min(spreads, key=lambda name: spreads[name]["median"])
    results["headline"] = {
        "intake_micro_batch_ratio": spreads[lower]["median"],
        **{f"intake_micro_batch_ratio_{name}": s["median"] for name, s in spreads.items()},
    }
    results["headline_spread"] = {
        "intake_micro_batch_ratio": spreads[lower],
        **{f"intake_micro_batch_ratio_{name}": s for name, s in spreads.items()},
    }
    return results


def render(results: dict[str, Any]) -> None:
    print(f"intake throughput, enqueue -> completed (send_email; batch size {BATCH_SIZE})")
    print(f"{'backend':<10}{'mode':<14}{'n':>6}{'jobs/s':>10}{'x floor':>10}")
    for name, data in results["backends"].items():
        for mode, rate in data["jobs_per_second"].items():
            ratio = data["ratio_to_floor"][mode]
            print(f"{name:<10}{mode:<14}{results['sizes'][mode]:>6}{rate:>10.1f}{ratio:>10.3f}")
    verdict = "meets" if results["micro_batch_meets_target"] else "MISSES"
    print(f"micro-batch {verdict} the target of {TARGET} x the per-key loop on every backend")



def main() -> None:
    module_main(__doc__, run, render)


if __name__ == "__main__":
    main()
