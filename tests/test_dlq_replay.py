"""DLQ replay: safe after a crash that followed the effect, and bounded in rate.

- A payment run is SIGKILLed (a real subprocess) right after the gateway charged; run monitoring
  marks the run failed; the sweep dead-letters it; a replay completes it with no second charge,
  because it reuses the original idempotency key.
- 500 requested replays: the replay sensor, evaluated tick after tick with a controlled clock,
  never emits more than ``max_per_tick`` per tick nor more than ``burst + per_second * elapsed``
  in total, and emits each record exactly once.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest
from sqlalchemy import text

from cli.main import main as cli
from pipelines.ops import charge_payment_job
from resources.dagster_resources import DlqResource
from resources.dlq import DlqStatus, DlqStore, FailureInfo
from resources.storage.db import Database
from sandbox.gateway import GatewayServer
from sensors.dlq import sweep
from tests.job_workers import dagster_resources, replay_sensor

ROOT = Path(__file__).resolve().parent.parent

_CHILD = """
import json, sys
import dagster as dg
from dagster._core.instance.ref import InstanceRef
from pipelines.ops import charge_payment_job
from tests.job_workers import dagster_resources
spec = json.loads(sys.argv[1])
instance = dg.DagsterInstance.from_ref(InstanceRef.from_dir(spec["home"]))
charge_payment_job.execute_in_process(
    run_config=spec["run_config"], tags=spec["tags"], instance=instance,
    resources=dagster_resources(**spec["resources"]), raise_on_error=False)
"""


def test_replay_after_a_crash_after_the_charge_makes_no_second_charge(
    db: Database,
    db_url: str,
    redis_url: str,
    namespace: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Catches: a replay under a new key (a second charge), a crashed run never dead-lettered."""
    gateway = GatewayServer(f"sqlite:///{tmp_path / 'gateway.db'}").start()
    home = tmp_path / "dagster_home"
    home.mkdir()
    instance = dg.DagsterInstance.local_temp(str(home))
    try:
        res = {
            "db_url": db_url,
            "redis_url": redis_url,
            "namespace": namespace,
            "gateway_url": gateway.url,
            "lease_seconds": 1.0,
        }
        payload = {"order_id": "o-crash", "amount_cents": 1250, "currency": "EUR"}
        spec = {
            "home": str(home),
            "run_config": {"ops": {"charge_payment_op": {"config": {"payload": payload}}}},
            "tags": {"sekali/key": "payment:o-crash", "sekali/correlation_id": "c-crash"},
            "resources": res,
        }
        env = {**os.environ, "SEKALI_CRASH_AT": "after_charge", "PYTHONPATH": str(ROOT)}
        child = subprocess.run(
            [sys.executable, "-c", _CHILD, json.dumps(spec)],
            env=env,
            cwd=ROOT,
            timeout=120,
            capture_output=True,
        )
        assert child.returncode == -9, child.stderr.decode()[-2000:]
        assert len(gateway.charges()) == 1  # the effect happened; the run never recorded it

        (run,) = instance.get_runs()
        assert run.status == dg.DagsterRunStatus.STARTED
        instance.report_run_failed(run, "run worker died (run monitoring)")
        store = DlqStore(db)
        sweep(instance, store, None)
        (record,) = store.list_records()
        assert record.idempotency_key == "payment:o-crash"
        assert record.error_class == "transient"

        # the charge is at the gateway, so the guard wants it named; the ledger keeps it single
        assert cli(["dlq", "replay", str(record.id), "--allow-repeat", str(record.id),
                    "--url", db_url]) == 0
        time.sleep(1.2)  # the dead worker's 1 s lease runs out; the replay takes the key over
        dlq = DlqResource(database_url=db_url)
        sensor = replay_sensor(name="replay_test", per_second=10.0, max_per_tick=10)
        context = dg.build_sensor_context(instance=instance, resources={"dlq": dlq})
        (request,) = sensor.evaluate_tick(context).run_requests or []
        assert request.tags["sekali/key"] == "payment:o-crash"
        result = charge_payment_job.execute_in_process(
            run_config=request.run_config,
            tags=request.tags,
            instance=instance,
            resources=dagster_resources(**{**res, "lease_seconds": 30.0}),
            raise_on_error=False,
        )
        assert result.success
        sensor.evaluate_tick(
            dg.build_sensor_context(
                instance=instance, cursor=context.cursor, resources={"dlq": dlq}
            )
        )
        assert store.get(record.id).status is DlqStatus.RESOLVED
        assert len(gateway.charges()) == 1
        with db.statement() as conn:
            status = conn.execute(
                text("SELECT payment_status FROM orders WHERE order_id = 'o-crash'")
            ).scalar()
        assert status == "paid"
    finally:
        gateway.stop()
        instance.dispose()


def test_replay_of_500_records_respects_the_rate_bound(db: Database, db_url: str) -> None:
    """Catches: a replay sensor that launches every requested record at once (a replay storm
    against a downstream that just recovered), or one that emits a record twice."""
    store = DlqStore(db)
    for i in range(500):
        store.record_failure(
            FailureInfo(
                job_type="send_email",
                dedupe_key=f"request:{i}",
                error_type="SMTPServerDisconnected",
                message="gone",
                run_id=f"r{i}",
                request_id=i + 1,
                idempotency_key=f"email:welcome:u{i}:2026-11-29",
                payload={"template": "welcome", "user_id": f"u{i}", "date": "2026-11-29",
                         "to": f"u{i}@a.example"},
            )
        )
    ids = [r.id for r in store.list_records()]
    decisions = store.request_replay(ids, actor="test")
    assert sum(d.replay for d in decisions) == 500

    now = [1_000_000.0]
    per_second, burst, max_per_tick = 5.0, 12.0, 8
    sensor = replay_sensor(
        name="replay_rate",
        per_second=per_second,
        burst=burst,
        max_per_tick=max_per_tick,
        clock=lambda: now[0],
    )
    dlq = DlqResource(database_url=db_url)
    instance = dg.DagsterInstance.ephemeral()
    rng = random.Random(6)
    start, cursor, emitted, ticks, step = now[0], None, [], 0, 0.0
    while len(emitted) < 500:
        ticks += 1
        assert ticks < 1000, "replays stalled"
        context = dg.build_sensor_context(instance=instance, cursor=cursor, resources={"dlq": dlq})
        result = sensor.evaluate_tick(context)
        cursor = result.cursor
        batch = [r.run_key for r in result.run_requests or []]
        assert len(batch) <= max_per_tick
        if step >= 2.5 and 500 - len(emitted) >= max_per_tick:
            assert len(batch) == max_per_tick  # the bound is reached, not only respected
        emitted += batch
        assert len(emitted) <= burst + per_second * (now[0] - start) + 1e-9
        step = rng.choice([0.1, 0.4, 1.0, 2.5, 4.0])
        now[0] += step
    assert len(set(emitted)) == 500
    assert sorted(emitted) == sorted(f"dlq-replay:{i}:1" for i in ids)
    assert store.counts()["replaying"] == 500
