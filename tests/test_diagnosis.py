"""The diagnosis checklist: a healthy world passes every check on SQLite and Postgres; for each
item a deliberately bad set-up, written through the real stores, the real sandbox gateway and
a real Redis, makes exactly that check fail with its explanation and fix.

Each bad set-up starts from the healthy world and adds one defect, and the test asserts that
the other checks still pass: a check that fires for the wrong reason is caught too."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import text

from engine.health.diagnosis import (
    CHECKS,
    ERROR,
    WARN,
    DiagnosisSetup,
    EffectLedger,
    Finding,
    diagnose,
    has_errors,
)
from engine.registry import JOB_TYPES
from pipelines.domain.payments import HttpPaymentGateway
from resources.cache.core import StampedeCache
from resources.dlq import DlqStore, FailureClass, FailureInfo
from resources.errors import TransientJobError
from resources.retry import retry_delay
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from sandbox.gateway import GatewayServer
from tests.metrics_support import FakeClock, World

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Env:
    world: World
    clock: FakeClock
    db: Database
    gateway: GatewayServer
    gateway_url: str
    client: redis.Redis
    namespace: str
    caches: list[StampedeCache]

    def setup(self, **overrides: Any) -> DiagnosisSetup:
        values: dict[str, Any] = {
            "db": self.db, "job_types": JOB_TYPES, "lease_seconds": 60.0,
            "lock_ttl_seconds": 30.0, "lock_auto_renew": True, "caches": self.caches,
            "effect_ledgers": [EffectLedger(
                "gateway_charges", Database.from_url(self.gateway_url), "gateway_charges",
                intent_column="reference", correlation_column="correlation_id",
                time_column="created_at",
            )],
            "clock": self.clock,
        }
        values.update(overrides)
        return DiagnosisSetup(**values)

    def request(self, job_type: str, key: str, cid: str | None) -> int:
        return self.world.enqueue(job_type, key, correlation_id=cid)


def healthy_workload(env: Env) -> None:
    """Realistic, healthy traffic: keyed charges through the gateway with correlation ids,
    duplicate deliveries suppressed, a cohort of transient failures retried with full jitter,
    spread cache TTLs, an old and small DLQ."""
    world, clock = env.world, env.clock
    for i in range(12):
        key, cid = f"payment:order-{i}", f"corr-{i}"
        rid = env.request("charge_payment", key, cid)
        world.run("charge_payment", key, duration=0.5 + 0.2 * i, correlation_id=cid,
                  request_id=rid, charge=True, lock_wait=0.01, critical=0.3,
                  reference=f"order-{i}")
        if i % 3 == 0:  # a duplicate delivery: suppressed, no second effect
            world.run("charge_payment", key, correlation_id=cid, request_id=rid)
    retry_cohort(env, "payment:retry", jitter="full", rounds=1)
    cache = env.caches[0]
    for k in range(12):
        cache.get_or_load(f"report:{k}", lambda k=k: {"k": k}, ttl=3600, jitter=0.1)
        cache.get(f"report:{k}")
    for _ in range(3):
        for k in range(12):
            cache.get_or_load(f"report:{k}", lambda k=k: {"k": k}, ttl=3600, jitter=0.1)
    cache.recorder.flush()
    dlq = DlqStore(env.db, clock=clock)
    for i in range(2):
        dlq.record_failure(FailureInfo(
            job_type="charge_payment", dedupe_key=f"old:{i}", error_type="GatewayRejected",
            message="card declined", run_id=f"r{i}", error_class=FailureClass.PERMANENT,
            failed_at=clock() - 20 * 3600,
        ))


def retry_cohort(env: Env, prefix: str, *, jitter: str, rounds: int, n: int = 12) -> None:
    """``n`` jobs fail at the same instant (a sick downstream), then retry after
    ``retry_delay`` with the given jitter, ``rounds`` times, then succeed."""
    world, clock = env.world, env.clock
    rng = random.Random(7)
    keys = []
    for i in range(n):
        key, cid = f"{prefix}:{i}", f"{prefix}-c{i}"
        keys.append((key, cid, env.request("charge_payment", key, cid)))
    t0 = clock()
    for key, cid, rid in keys:
        world.run("charge_payment", key, duration=0.0, correlation_id=cid, request_id=rid,
                  fail_with=TransientJobError("gateway answered 503"))
    for attempt in range(1, rounds + 1):
        plan = sorted(
            (t0 + retry_delay(attempt - 1, base=1.0, cap=30.0, jitter=jitter, rng=rng), k)
            for k in keys
        )
        last = t0
        for at, (key, cid, rid) in plan:
            clock.now = max(clock.now, at)
            final = attempt == rounds
            world.run(
                "charge_payment", key, duration=0.0, correlation_id=cid, request_id=rid,
                attempt=attempt, charge=final, reference=key,
                fail_with=None if final else TransientJobError("gateway answered 503"),
            )
            last = clock()
        t0 = last if jitter != "none" else plan[-1][0]


@pytest.fixture
def env_factory(
    tmp_path: Path, redis_client: redis.Redis, namespace: str
) -> Iterator[Any]:
    made: list[Env] = []

    def make(db: Database) -> Env:
        gateway_url = f"sqlite:///{tmp_path / f'gateway{len(made)}.db'}"
        server = GatewayServer(gateway_url).start()
        clock = FakeClock(time.time() - 3600)
        world = World(db, clock, gateway=HttpPaymentGateway(server.url))
        cache = StampedeCache(redis_client, namespace=namespace)
        env = Env(world, clock, db, server, gateway_url, redis_client, namespace, [cache])
        made.append(env)
        healthy_workload(env)
        return env

    yield make
    for env in made:
        env.gateway.stop()
        for cache in env.caches:
            cache.close()


@pytest.fixture
def env(env_factory: Any, sqlite_url: str) -> Env:
    db = Database.from_url(sqlite_url)
    upgrade(db)
    return env_factory(db)


def by_name(findings: list[Finding]) -> dict[str, Finding]:
    return {f.check: f for f in findings}


def only_failing(env: Env, check: str, **overrides: Any) -> Finding:
    """Run every check; assert ``check`` fails and every other one passes."""
    findings = by_name(diagnose(env.setup(**overrides)))
    others = {n: f.found for n, f in findings.items() if n != check and not f.passed}
    assert others == {}, others
    finding = findings[check]
    assert not finding.passed, finding
    assert finding.found and finding.fix and "Nothing to change" not in finding.fix
    return finding


def test_healthy_world_passes_every_check(env_factory: Any, db: Database) -> None:
    """On both backends the healthy traffic passes all ten, and says why (not just 'ok')."""
    env = env_factory(db)
    findings = diagnose(env.setup())
    assert [f.check for f in findings] == [c.name for c in CHECKS]
    failed = {f.check: f.found for f in findings if not f.passed}
    assert failed == {}
    found = by_name(findings)
    assert "duplicate logs, not duplicate effects" in found["real_duplicates"].found
    assert found["real_duplicates"].evidence["duplicates_suppressed"] == 4
    assert "jittered" in found["retry_synchronisation"].found
    assert found["correlation"].evidence["effects"] == 24
    assert not has_errors(findings)


def test_1_real_duplicate_effect(env: Env) -> None:
    """Keys named after the message, not the intent: two deliveries, two charges."""
    for msg in ("msg-1", "msg-2"):
        key = f"payment:order-dup:{msg}"
        rid = env.request("charge_payment", key, "corr-dup")
        env.world.run("charge_payment", key, correlation_id="corr-dup", request_id=rid,
                      charge=True, reference="order-dup")
    finding = only_failing(env, "real_duplicates")
    assert finding.severity == ERROR
    assert "REAL duplicate effects" in finding.found and "gateway_charges" in finding.found
    assert finding.evidence["duplicate_effects"] == {"gateway_charges": 1}


def test_2_lease_shorter_than_the_job(env: Env) -> None:
    """Jobs of 75 s under a 60 s lease: p99 is past 0.8 x lease."""
    for i in range(3):
        key = f"payment:slow-{i}"
        rid = env.request("charge_payment", key, f"slow-{i}")
        env.world.run("charge_payment", key, duration=75.0, correlation_id=f"slow-{i}",
                      request_id=rid, critical=0.3)
    finding = only_failing(env, "lease_vs_duration")
    assert finding.severity == ERROR
    assert "charge_payment p99=75.000s" in finding.found
    assert "lease_seconds to at least 150s" in finding.fix


def test_3_side_effecting_job_type_without_a_key(env: Env) -> None:
    """A new side-effecting job type registered without key_for, its attempts keyless."""

    @dataclass(frozen=True)
    class RefundType:
        name: str = "refund_payment"
        side_effect: bool = True
        key_for: Any = None
        max_runtime_seconds: float = 60.0

    job_types = {**JOB_TYPES, "refund_payment": RefundType()}
    env.world.run("refund_payment", "refund:1", record_key=False, correlation_id="r1")
    finding = only_failing(env, "idempotency_coverage", job_types=job_types)
    assert finding.severity == ERROR
    assert "no key_for: ['refund_payment']" in finding.found
    assert "{'refund_payment': 1}" in finding.found


def test_4_lock_ttl_shorter_than_critical_section(env: Env) -> None:
    """Critical sections of 5 s under a 2 s lock TTL: ERROR without renewal, WARN with it."""
    for i in range(3):
        key = f"payment:locked-{i}"
        rid = env.request("charge_payment", key, f"l{i}")
        env.world.run("charge_payment", key, duration=5.5, critical=5.0, lock_wait=0.1,
                      correlation_id=f"l{i}", request_id=rid)
    finding = only_failing(env, "lock_ttl", lock_ttl_seconds=2.0, lock_auto_renew=False)
    assert finding.severity == ERROR
    assert "renewal off" in finding.found and "5.000s" in finding.found
    renewed = only_failing(env, "lock_ttl", lock_ttl_seconds=2.0, lock_auto_renew=True)
    assert renewed.severity == WARN and "only renewal keeps" in renewed.found


def test_4_no_lock_backend_fails_the_job_types_that_declare_a_resource_exclusive(
    env: Env,
) -> None:
    """Catches: a doctor that calls a missing lock backend harmless while a job type holds a
    lock around its handler (``rebuild_report_cache``): its requests would all fail."""
    finding = only_failing(env, "lock_ttl", lock_ttl_seconds=None)
    assert finding.severity == ERROR and "rebuild_report_cache" in finding.found
    assert "running.exclusive" in finding.found and "write_fence" in finding.fix
    healthy = by_name(diagnose(env.setup()))["lock_ttl"]
    assert healthy.passed and "rebuild_report_cache" in healthy.found


def test_5_retries_without_jitter(env: Env) -> None:
    """A cohort failing together and retrying with jitter='none' retries in lockstep."""
    retry_cohort(env, "payment:storm", jitter="none", rounds=2)
    finding = only_failing(env, "retry_synchronisation")
    assert finding.severity == WARN
    assert "retries without jitter" in finding.found
    assert "attempt 2: 0.000" in finding.found
    assert "jitter='full'" in finding.fix


def test_6_hot_keys_with_uniform_ttls(env: Env) -> None:
    """Twelve hot keys written together with jitter=0 and the first-refresh spread turned off
    expire in the same second."""
    cache = StampedeCache(env.client, namespace=env.namespace + "u", spread_first_refresh=False)
    env.caches.append(cache)
    for _ in range(3):
        for k in range(12):
            cache.get_or_load(f"report:{k}", lambda k=k: {"k": k}, ttl=3600, jitter=0.0)
    cache.recorder.flush()
    finding = only_failing(env, "cache_expiry_clusters")
    assert finding.severity == WARN
    assert f"namespace {env.namespace}u: 100% of 12 hot keys" in finding.found
    assert "(1 distinct TTLs)" in finding.found
    assert "jitter" in finding.fix
    try:
        for k in range(12):
            cache.invalidate(f"report:{k}")
    finally:
        cache.close()


def test_7_ack_before_the_result_is_stored(env: Env) -> None:
    """The step reports success, and only later (or never) is the result stored."""
    for i in range(2):
        key = f"payment:early-ack-{i}"
        rid = env.request("charge_payment", key, f"a{i}")
        env.world.run("charge_payment", key, correlation_id=f"a{i}", request_id=rid,
                      ack_before_complete=True, skip_complete=(i == 1))
    finding = only_failing(env, "ack_timing")
    assert finding.severity == ERROR
    assert "1 attempts ended completed while their key is not completed" in finding.found
    assert "1 stored their result after the step had already succeeded" in finding.found


def test_8_dlq_growing_with_a_dominant_class(env: Env) -> None:
    """Fifteen data-bug failures in the last hours against two old ones: growing."""
    dlq = DlqStore(env.db, clock=env.clock)
    for i in range(15):
        dlq.record_failure(FailureInfo(
            job_type="reserve_inventory", dedupe_key=f"bug:{i}", error_type="KeyError",
            message="'sku'", run_id=f"b{i}", error_class=FailureClass.DATA_BUG,
            failed_at=env.clock() - 60 * i,
        ))
    finding = only_failing(env, "dlq")
    assert finding.severity == WARN
    assert "17 open records, 88% data_bug" in finding.found and "growing" in finding.found
    assert "bug" in finding.fix


def test_9_table_without_its_unique_key(env_factory: Any, db: Database) -> None:
    """job_requests recreated by hand without its unique key, on both backends."""
    env = env_factory(db)
    with db.transaction() as conn:
        conn.execute(text("CREATE TABLE job_requests_copy AS SELECT * FROM job_requests"))
        conn.execute(text("DROP TABLE job_requests"))
        conn.execute(text("ALTER TABLE job_requests_copy RENAME TO job_requests"))
    finding = only_failing(env, "unique_constraints")
    assert finding.severity == ERROR
    assert "no unique constraint on job_requests(key)" in finding.found
    assert "UNIQUE" in finding.fix


def test_10_missing_correlation_ids(env: Env) -> None:
    """A producer that sends no correlation id, and a job that does not pass one on."""
    for i in range(3):
        key = f"payment:anon-{i}"
        rid = env.world.requests.enqueue(
            "charge_payment", key, {"key": key}, queue="heavy"
        ).id
        env.world.run("charge_payment", key, request_id=rid, charge=True, reference=f"anon-{i}")
    finding = only_failing(env, "correlation")
    assert finding.severity == WARN
    assert "3/" in finding.found and "requests have no correlation id" in finding.found
    assert "3/3" not in finding.found or "downstream effects arrived without one" in finding.found
    assert finding.evidence["effects_without_id"] == 3
    assert "X-Correlation-Id" in finding.fix


def test_broken_probe_fails_instead_of_passing(tmp_path: Path) -> None:
    """A database without the schema: the checks that need it fail and say what to do."""
    db = Database.from_url(f"sqlite:///{tmp_path / 'empty.db'}")
    findings = by_name(diagnose(DiagnosisSetup(db=db, job_types=JOB_TYPES, lease_seconds=60)))
    assert not findings["idempotency_coverage"].passed
    assert not findings["unique_constraints"].passed
    assert not findings["ack_timing"].passed
    assert "could not read the evidence" in findings["ack_timing"].found


def _doctor(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli.main", "doctor", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
    )


def test_sekali_doctor_table_json_and_exit_status(
    env: Env, tmp_path: Path, redis_url: str
) -> None:
    """`sekali doctor` prints a table with verdicts and fixes, exits 0 on the healthy world and
    non-zero once an ERROR check fails; `--json` carries the same findings."""
    url = str(env.db.engine.url.render_as_string(hide_password=False))
    environ = {**os.environ, "DATABASE_URL": url, "REDIS_URL": redis_url,
               "SEKALI_STATE_DIR": str(tmp_path / "state")}
    common = ["--gateway-ledger-url", env.gateway_url, "--cache-namespace", env.namespace]
    healthy = _doctor(environ, *common)
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    assert f"{len(CHECKS)} passed, 0 failed at ERROR" in healthy.stdout
    assert "2. Lease against p99 duration per job type" in healthy.stdout
    sick = _doctor(environ, *common, "--json", "--lease-seconds", "2")
    assert sick.returncode == 1, sick.stdout + sick.stderr
    findings = {f["check"]: f for f in json.loads(sick.stdout)}
    assert len(findings) == len(CHECKS)
    lease = findings["lease_vs_duration"]
    assert lease["verdict"] == "FAIL (ERROR)" and "against its lease 2s" in lease["found"]
    assert "lease_seconds" in lease["fix"]
