"""Metrics match what a scripted workload did, on SQLite and Postgres; the Prometheus endpoint
and the Dagster asset serve the same numbers; counts stay exact when threads in several
processes write the records at once."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import dagster as dg
import pytest
import redis
from prometheus_client import CollectorRegistry

from engine.health.diagnosis import CHECKS
from engine.health.metrics import MetricsCollector, MetricsSnapshot, SnapshotCollector, percentile
from resources.cache.core import StampedeCache
from resources.dlq import DlqStore, FailureClass, FailureInfo
from resources.errors import LockNotAcquired, TransientJobError
from resources.locks import RedisLockStats, lock_stats
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from tests.metrics_support import FakeClock, World, record_attempts_worker

ROOT = Path(__file__).resolve().parents[1]

DURATIONS = {
    "charge_payment": [0.2, 0.4, 0.4, 0.9, 1.5, 2.5, 0.3, 0.35, 0.5, 7.0],
    "send_email": [0.05, 0.06, 0.07, 0.08, 0.1],
}


def nearest_rank(values: list[float], q: float) -> float:
    """Independent of engine.health.metrics: sort, take the ceil(q*n)-th value."""
    ordered = sorted(values)
    return ordered[math.ceil(q * len(ordered)) - 1]


def scripted_workload(db: Database, clock: FakeClock, redis_client: redis.Redis, ns: str) -> dict:
    """Runs a known workload through the real stores; returns the expected numbers."""
    world = World(db, clock)
    expected: dict = {"depth": {}, "oldest": {}}
    # queue: 4 pending charge requests, 2 pending email requests, 2 completed
    for i in range(4):
        world.enqueue("charge_payment", f"pay-q{i}", correlation_id=f"c{i}")
        clock.advance(10)
    for i in range(2):
        world.enqueue("send_email", f"mail-q{i}", correlation_id=f"m{i}")
        clock.advance(5)
    first_charge = world.requests.get_by_key("pay-q0")
    assert first_charge is not None
    for i in range(2):
        rid = world.enqueue("send_email", f"mail-done{i}", correlation_id=None)
        world.requests.mark_completed(rid)
    expected["pending_oldest"] = {"charge_payment": first_charge.created_at}
    expected["depth"] = {"charge_payment": 4, "send_email": 2}

    # attempts: completed durations, duplicates, retries by reason, takeovers, lock waits
    lock_waits = []
    for job_type, durations in DURATIONS.items():
        for i, d in enumerate(durations):
            wait = 0.01 * (i + 1) if job_type == "charge_payment" else None
            if wait is not None:
                lock_waits.append(wait)
            world.run(job_type, f"{job_type}:{i}", duration=d, lock_wait=wait)
    for i in range(3):  # three duplicate deliveries of charges, one of an email
        world.run("charge_payment", f"charge_payment:{i}")
    world.run("send_email", "send_email:0")
    world.run("charge_payment", "retry:a", fail_with=TransientJobError("gateway 503"))
    world.run("charge_payment", "retry:b", fail_with=TransientJobError("gateway 503"))
    world.run("send_email", "retry:c", fail_with=LockNotAcquired("order:1", 2.0))
    # a takeover: a claim whose worker died (never finished) and a second worker after the lease
    dead = world.start("charge_payment", idempotency_key="takeover:1")
    world.store.begin("takeover:1", payload={"key": "takeover:1"})
    clock.advance(world.lease_seconds + 1)
    world.run("charge_payment", "takeover:1", duration=0.5, attempt=1)
    assert dead.ended_at is None

    expected["durations"] = {
        "charge_payment": DURATIONS["charge_payment"] + [0.5],
        "send_email": DURATIONS["send_email"],
    }
    expected["executed"] = len(DURATIONS["charge_payment"]) + len(DURATIONS["send_email"]) + 1
    expected["suppressed"] = 4
    expected["suppressed_by_type"] = {"charge_payment": 3, "send_email": 1}
    expected["executed_by_type"] = {"charge_payment": 11, "send_email": 5}
    expected["retries"] = {"TransientJobError": 2, "LockNotAcquired": 1}
    expected["takeovers"] = 1
    expected["attempt_rows"] = expected["executed"] + 4 + 3 + 1
    expected["lock_waits"] = lock_waits
    expected["lock_failed"] = 1

    # DLQ: 3 permanent and 2 transient records
    dlq = DlqStore(db, clock=clock)
    for i in range(5):
        cls = FailureClass.PERMANENT if i < 3 else FailureClass.TRANSIENT
        dlq.record_failure(FailureInfo(
            job_type="charge_payment", dedupe_key=f"dlq:{i}", error_type="GatewayRejected",
            message=f"declined {i}", run_id=f"run{i}", error_class=cls, failed_at=clock(),
        ))
    expected["dlq"] = {"permanent": 3, "transient": 2}

    # cache: 4 keys loaded once (4 misses, 4 loads), then read 3 times each (12 hits)
    cache = StampedeCache(redis_client, namespace=ns, clock=clock)
    for _ in range(4):
        for k in range(4):
            cache.get_or_load(f"report:{k}", lambda k=k: {"k": k}, ttl=3600)
    cache.recorder.flush()  # what the cache does every second; other processes then see it
    expected["cache"] = {"hits": 12, "misses": 4, "loads": 4}
    expected["cache_obj"] = cache
    return expected


def collector_for(db: Database, clock: FakeClock, cache: StampedeCache, locks_key: str,
                  client: redis.Redis) -> MetricsCollector:
    return MetricsCollector(
        db, cache_stats=cache.stats, lock_stats=lambda: lock_stats(client, key=locks_key),
        window_seconds=3600, clock=clock,
    )


def assert_matches(snap: MetricsSnapshot, expected: dict, now: float) -> None:
    assert snap.missing == []
    for job_type, depth in expected["depth"].items():
        assert snap.get("sekali_queue_depth", job_type=job_type) == depth
    assert snap.get("sekali_queue_depth_total") == sum(expected["depth"].values())
    lag = now - expected["pending_oldest"]["charge_payment"]
    assert snap.get("sekali_queue_lag_seconds", job_type="charge_payment") == pytest.approx(lag)
    for job_type, values in expected["durations"].items():
        for q in (0.5, 0.95, 0.99):
            got = snap.get("sekali_processing_seconds", job_type=job_type, quantile=str(q))
            assert got == pytest.approx(nearest_rank(values, q), abs=1e-6), (job_type, q)
        assert snap.get("sekali_processing_seconds_count", job_type=job_type) == len(values)
    assert snap.get("sekali_jobs_executed") == expected["executed"]
    assert snap.get("sekali_duplicates_suppressed") == expected["suppressed"]
    assert snap.get("sekali_duplicate_detection_rate_total") == pytest.approx(
        expected["suppressed"] / expected["executed"])
    for job_type, n in expected["suppressed_by_type"].items():
        assert snap.get("sekali_duplicate_detection_rate", job_type=job_type) == pytest.approx(
            n / expected["executed_by_type"][job_type])
    for reason, n in expected["retries"].items():
        assert snap.get("sekali_retries", reason=reason) == n
    assert snap.get("sekali_retries_total") == sum(expected["retries"].values())
    assert snap.get("sekali_lease_takeovers") == expected["takeovers"]
    assert snap.get("sekali_lease_takeover_rate") == pytest.approx(
        expected["takeovers"] / expected["attempt_rows"])
    assert snap.get("sekali_lock_acquired") == len(expected["lock_waits"])
    assert snap.get("sekali_lock_failed") == expected["lock_failed"]
    assert snap.get("sekali_lock_wait_seconds", quantile="0.99") == pytest.approx(
        nearest_rank(expected["lock_waits"], 0.99))
    for cls, n in expected["dlq"].items():
        assert snap.get("sekali_dlq_inflow", error_class=cls) == n
        assert snap.get("sekali_dlq_open", error_class=cls) == n
    c = expected["cache"]
    assert snap.get("sekali_cache_reads", pattern="report:*", result="hit") == c["hits"]
    assert snap.get("sekali_cache_reads", pattern="report:*", result="miss") == c["misses"]
    assert snap.get("sekali_cache_rebuilds", pattern="report:*") == c["loads"]
    assert snap.get("sekali_cache_rate", pattern="report:*", result="hit") == pytest.approx(
        c["hits"] / (c["hits"] + c["misses"]))


def test_percentile_is_nearest_rank() -> None:
    """Catches a switch to interpolation (SQLite and Postgres would then disagree with docs)."""
    assert percentile([1, 2, 3, 4], 0.5) == 2
    assert percentile([5.0], 0.99) == 5.0
    assert percentile(list(range(1, 101)), 0.95) == 95
    assert math.isnan(percentile([], 0.5))


def test_metrics_match_scripted_workload(
    db: Database, redis_client: redis.Redis, namespace: str
) -> None:
    """Every metric equals the count computed here from the script, on both backends."""
    clock = FakeClock(time.time() - 1800)
    expected = scripted_workload(db, clock, redis_client, namespace)
    locks_key = f"{namespace}:lockstats"
    stats = RedisLockStats(redis_client, key=locks_key)
    for _ in range(3):
        stats.record("acquired", "order:1")
    stats.record("acquire_failed", "order:2")
    stats.flush()
    snap = collector_for(db, clock, expected["cache_obj"], locks_key, redis_client).collect()
    assert_matches(snap, expected, clock())
    assert snap.get("sekali_lock_stat", lock="order:*", stat="acquired") == 3
    assert snap.get("sekali_lock_stat", lock="order:*", stat="acquire_failed") == 1
    # the window bounds the evidence: an hour later nothing of the attempts is counted
    clock.advance(3 * 3600)
    later = collector_for(db, clock, expected["cache_obj"], locks_key, redis_client).collect()
    assert later.get("sekali_jobs_executed") == 0
    assert later.get("sekali_dlq_inflow_total") == 0
    assert later.get("sekali_dlq_open_total") == 5  # open records stay visible


def test_missing_sources_are_named_not_fatal(sqlite_url: str) -> None:
    """An unmigrated database gives a snapshot that names what is missing."""
    db = Database.from_url(sqlite_url)
    snap = MetricsCollector(db).collect()
    assert set(snap.missing) == {"job_requests", "job_attempts", "dlq_records"}
    registry = CollectorRegistry()
    registry.register(SnapshotCollector(lambda: snap))
    assert registry.get_sample_value("sekali_metrics_missing_sources") == 3


def test_counts_exact_under_threads_and_processes(db_url: str) -> None:
    """3 spawned processes x 4 threads write attempts at once (each job delivered twice): the
    metrics count every execution once and every duplicate as suppressed."""
    db = Database.from_url(db_url)
    upgrade(db)
    base = time.time() - 600
    args = [(db_url, f"p{p}", 4, 5, base) for p in range(3)]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(3) as pool:
        results = pool.map(record_attempts_worker, args)
    executed = sum(r["completed"] for r in results)
    suppressed = sum(r["duplicate_suppressed"] for r in results)
    assert executed == 3 * 4 * 5 and suppressed == executed  # one effect per key, one dup each
    snap = MetricsCollector(db, window_seconds=3600).collect()
    assert snap.get("sekali_jobs_executed") == executed
    assert snap.get("sekali_duplicates_suppressed") == suppressed
    assert snap.get("sekali_duplicate_detection_rate_total") == pytest.approx(1.0)
    assert snap.get("sekali_attempts", job_type="send_email", outcome="completed") == executed
    db.dispose()


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        body = response.read().decode()
    values = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def test_prometheus_endpoint_serves_the_numbers(
    sqlite_url: str, redis_client: redis.Redis, namespace: str
) -> None:
    """A real HTTP GET of /metrics returns the workload's numbers in the text format."""
    from cli.commands.metrics import MetricsServer

    db = Database.from_url(sqlite_url)
    upgrade(db)
    clock = FakeClock(time.time() - 1800)
    expected = scripted_workload(db, clock, redis_client, namespace)
    collector = collector_for(db, clock, expected["cache_obj"], f"{namespace}:l", redis_client)
    server = MetricsServer(collector, port=0, min_interval=0.0).start()
    try:
        values = _scrape(server.url)
        assert values['sekali_queue_depth{job_type="charge_payment"}'] == 4
        assert values["sekali_jobs_executed"] == expected["executed"]
        assert values['sekali_retries{reason="TransientJobError"}'] == 2
        p99 = nearest_rank(expected["durations"]["charge_payment"], 0.99)
        assert values['sekali_processing_seconds{job_type="charge_payment",quantile="0.99"}'] \
            == pytest.approx(p99)
        assert values['sekali_cache_reads{pattern="report:*",result="hit"}'] == 12
        assert values['sekali_dlq_inflow{error_class="permanent"}'] == 3
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(server.url.replace("/metrics", "/other"), timeout=30)
        assert info.value.code == 404
    finally:
        server.stop()
    db.dispose()


def test_cli_metrics_serve_and_show(tmp_path: Path, redis_url: str) -> None:
    """`sekali metrics serve --port N` answers a real GET on 127.0.0.1; `show --json` agrees."""
    url = f"sqlite:///{tmp_path / 'app.db'}"
    db = Database.from_url(url)
    upgrade(db)
    world = World(db, FakeClock(time.time() - 60))
    for i in range(3):
        world.run("send_email", f"email:x:{i}", duration=0.2)
    world.run("send_email", "email:x:0")
    env = {**os.environ, "DATABASE_URL": url, "REDIS_URL": redis_url,
           "SEKALI_STATE_DIR": str(tmp_path / "state")}
    shown = subprocess.run(
        [sys.executable, "-m", "cli.main", "metrics", "show", "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    metrics = json.loads(shown.stdout)["metrics"]
    assert metrics["sekali_jobs_executed"] == 3
    assert metrics["sekali_duplicates_suppressed"] == 1
    from sandbox.redis_server import free_port

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "metrics", "serve", "--port", str(port)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                values = _scrape(f"http://127.0.0.1:{port}/metrics")
                break
            except (urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.2)
        assert values["sekali_jobs_executed"] == 3
        assert values['sekali_attempts{job_type="send_email",outcome="duplicate_suppressed"}'] == 1
    finally:
        proc.send_signal(2)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    db.dispose()


def test_metrics_asset_metadata_matches_workload(
    tmp_path: Path, redis_url: str, redis_client: redis.Redis, namespace: str
) -> None:
    """Materialising sekali_metrics in Dagster records the workload's numbers as float metadata
    (what the UI plots), and the checklist runs as asset checks with severities."""
    from pipelines.assets.observability import sekali_health, sekali_metrics
    from pipelines.profile import ObservabilityResource
    from resources.dagster_resources import (
        CacheResource,
        DatabaseResource,
        IdempotencyResource,
        LockResource,
    )

    url = f"sqlite:///{tmp_path / 'app.db'}"
    db = Database.from_url(url)
    upgrade(db)
    clock = FakeClock(time.time() - 1800)
    expected = scripted_workload(db, clock, redis_client, namespace)
    result = dg.materialize(
        [sekali_metrics, sekali_health],
        resources={
            "app_db": DatabaseResource(database_url=url),
            "idempotency": IdempotencyResource(database_url=url, lease_seconds=60),
            "locks": LockResource(redis_url=redis_url),
            "cache": CacheResource(redis_url=redis_url, namespace=namespace),
            "observability": ObservabilityResource(),
        },
        instance=dg.DagsterInstance.ephemeral(),
    )
    assert result.success
    [mat] = result.asset_materializations_for_node("sekali_metrics")
    meta = {k: v.value for k, v in mat.metadata.items()}
    # short keys that fit the UI; labels as table columns; no key repeats the prefix
    assert all(len(k) <= 40 and not k.startswith("sekali_") for k in meta)

    def row(name: str, **labels: str) -> float:
        (value,) = [
            r.data["value"] for r in meta[name].records
            if all(r.data[k] == v for k, v in labels.items())
        ]
        return float(value)

    assert row("queue_depth", job_type="charge_payment") == 4
    assert meta["jobs_executed"] == expected["executed"]
    assert meta["duplicates_suppressed"] == expected["suppressed"]
    assert row("retries", reason="LockNotAcquired") == 1
    assert meta["lease_takeovers"] == 1
    assert row("dlq_inflow", error_class="transient") == 2
    assert row("cache_reads", pattern=f"{namespace}/report:*", result="hit") == 12
    p95 = nearest_rank(expected["durations"]["send_email"], 0.95)
    assert row("processing_seconds", job_type="send_email", quantile="0.95") == \
        pytest.approx(p95)
    evaluations = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert len(evaluations) == len(CHECKS)
    # the workload's single 7 s charge is far under the 60 s lease; ack timing is right
    assert evaluations["lease_vs_duration"].passed
    assert evaluations["ack_timing"].passed
    # the requests marked completed were enqueued without a correlation id: a WARN failure
    corr = evaluations["correlation"]
    assert not corr.passed and corr.severity == dg.AssetCheckSeverity.WARN
    db.dispose()
