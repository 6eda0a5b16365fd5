"""A run worker SIGKILLed in the middle of a job, then the job run again: no second effect.

The worker is a real process (``python tests/job_workers.py``) running the real Dagster job;
``SEKALI_CRASH_AT`` makes it kill itself with SIGKILL at the named point (see
``pipelines/jobs/base.py``). The retry runs after the dead worker's short lease has expired, so
it takes the key over and resumes from the last recovery point.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from sqlalchemy import text

from engine.attempts import AttemptRecorder
from pipelines import ops
from pipelines.domain.inventory import Inventory
from pipelines.jobs.payment import reference_for
from resources.idempotency import IdempotencyStore, Status
from resources.storage.db import Database
from sandbox.gateway import GatewayServer
from tests.job_workers import dagster_resources

pytestmark = pytest.mark.dagster

WORKER = Path(__file__).resolve().parent / "job_workers.py"
LEASE = 1.5


@pytest.fixture
def gateway_factory(tmp_path: Path) -> Iterator[Any]:
    started: list[GatewayServer] = []

    def make(honour_key: bool) -> GatewayServer:
        server = GatewayServer(
            f"sqlite:///{tmp_path / 'gateway.db'}", honour_idempotency_key=honour_key
        ).start()
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


def crash_run(job: str, payload: dict[str, Any], crash_at: str, spec: dict[str, Any]) -> int:
    """Run ``job`` in a fresh process that SIGKILLs itself at ``crash_at``; its return code."""
    body = {
        "job": job,
        "run_config": {"ops": {f"{job}_op": {"config": {"payload": payload}}}},
        "resources": spec,
    }
    env = {**os.environ, "SEKALI_CRASH_AT": crash_at}
    proc = subprocess.run(
        [sys.executable, str(WORKER), json.dumps(body)], env=env, capture_output=True,
        text=True, timeout=180,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.returncode


def wait_for_lease_expiry(db: Database, key: str) -> None:
    record = IdempotencyStore(db).get(key)
    assert record is not None and record.status is Status.IN_PROGRESS
    assert record.lease_expires_at is not None
    time.sleep(max(0.0, record.lease_expires_at - time.time()) + 0.2)


def rerun(job_def: dg.JobDefinition, payload: dict[str, Any], spec: dict[str, Any]) -> Any:
    with dg.DagsterInstance.ephemeral() as instance:
        return job_def.execute_in_process(
            run_config={"ops": {f"{job_def.name}_op": {"config": {"payload": payload}}}},
            resources=dagster_resources(**spec), instance=instance, raise_on_error=False,
        )


@pytest.mark.parametrize("key_support", [True, False], ids=["key-on", "key-off"])
def test_sigkill_after_charge_then_retry_makes_no_second_charge(
    db: Database, db_url: str, redis_url: str, namespace: str, redis_client: Any,
    gateway_factory: Any, key_support: bool,
) -> None:
    """Regression caught: the retry after a crash between "gateway charged" and "recorded"
    charges again: with key support on the key dedupes at the gateway; with it off the retry
    must find the charge by its deterministic reference."""
    gateway = gateway_factory(key_support)
    spec = {"db_url": db_url, "redis_url": redis_url, "namespace": namespace,
            "gateway_url": gateway.url, "lease_seconds": LEASE,
            "send_idempotency_key": key_support}
    payload = {"order_id": "o-k", "amount_cents": 4200, "currency": "EUR"}
    crash_run("charge_payment", payload, "after_charge", spec)

    reference = reference_for("payment:o-k")
    assert len(gateway.ledger.by_reference(reference)) == 1  # the charge did happen
    with db.statement() as conn:
        row = conn.execute(text("SELECT payment_status, charge_id FROM orders")).one()
    assert (row.payment_status, row.charge_id) == ("charged_not_confirmed", None)  # sent, unknown
    wait_for_lease_expiry(db, "payment:o-k")

    result = rerun(ops.charge_payment_job, payload, spec)
    assert result.success
    charges = gateway.ledger.by_reference(reference)
    assert len(charges) == 1
    with db.statement() as conn:
        row = conn.execute(text("SELECT payment_status, charge_id FROM orders")).one()
    assert (row.payment_status, row.charge_id) == ("paid", charges[0]["charge_id"])
    rows = AttemptRecorder(db).for_key("payment:o-k")
    # on a loaded machine the crash run's first attempt can lose its short lease before the
    # crash point and be retried there: such attempts ended, and the ledger shows one charge
    early, (crashed, done) = rows[:-2], rows[-2:]
    assert all(r["outcome"] in ("lease_lost", "in_progress_elsewhere") for r in early), rows
    assert (crashed["outcome"], crashed["ended_at"] is None) == ("started", True), rows
    assert (done["outcome"], done["ended_at"] is None) == ("completed", False), rows
    assert done["takeover"] and done["fence"] == crashed["fence"] + 1
    assert "gateway_lookup" in rows[1]["durations"]
    assert "gateway_charge" not in rows[1]["durations"]


def test_sigkill_after_recording_the_charge_resumes_without_calling_the_gateway(
    sqlite_url: str, redis_url: str, namespace: str, redis_client: Any, gateway_factory: Any,
) -> None:
    """Regression caught: a resumed attempt that ignores its recovery point."""
    db = Database.from_url(sqlite_url)
    from resources.storage.migrations import upgrade

    upgrade(db)
    gateway = gateway_factory(False)
    spec = {"db_url": sqlite_url, "redis_url": redis_url, "namespace": namespace,
            "gateway_url": gateway.url, "lease_seconds": LEASE, "send_idempotency_key": False}
    payload = {"order_id": "o-r", "amount_cents": 100}
    crash_run("charge_payment", payload, "after_record_charge", spec)
    wait_for_lease_expiry(db, "payment:o-r")
    assert rerun(ops.charge_payment_job, payload, spec).success
    assert len(gateway.charges()) == 1
    last = AttemptRecorder(db).for_key("payment:o-r")[-1]
    assert last["status_before"] == "charged_not_confirmed" and last["status_after"] == "paid"
    assert not {"gateway_lookup", "gateway_charge"} & set(last["durations"])
    db.dispose()


def test_sigkill_after_reservation_resumes_fulfilment_without_reserving_twice(
    db: Database, db_url: str, redis_url: str, namespace: str, redis_client: Any,
) -> None:
    """Regression caught: a fulfilment resumed from the start (double reservation, duplicate
    outbox events) instead of from its last recovery point."""
    inventory = Inventory(db)
    inventory.set_stock("box", 10)
    spec = {"db_url": db_url, "redis_url": redis_url, "namespace": namespace,
            "lease_seconds": LEASE}
    payload = {"order_id": "o-f", "items": [{"sku": "box", "quantity": 3}]}
    crash_run("fulfill_order", payload, "after_reserve", spec)
    assert inventory.stock("box") == (10, 3)
    wait_for_lease_expiry(db, "fulfil:o-f")
    assert rerun(ops.fulfill_order_job, payload, spec).success
    assert inventory.stock("box") == (7, 0)
    with db.statement() as conn:
        events = conn.execute(
            text("SELECT event_type FROM outbox WHERE aggregate_id = 'o-f' ORDER BY id")
        ).scalars().all()
        status = conn.execute(
            text("SELECT fulfilment_status FROM orders WHERE order_id = 'o-f'")
        ).scalar()
    assert events == ["order.fulfilment_started", "order.shipped"]
    assert status == "fulfilled"
    last = AttemptRecorder(db).for_key("fulfil:o-f")[-1]
    assert last["status_before"] == "resumed:reserved" and last["takeover"]


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def stall_and_take_over(
    job_def: dg.JobDefinition, payload: dict[str, Any], spec: dict[str, Any], db: Database,
    key: str, stop_at: str,
) -> int:
    """Freeze a worker of ``job_def`` (SIGSTOP) at ``stop_at``, let its lease expire, complete
    the key with a second run, then resume the frozen worker and wait for it to end. Returns the
    resumed worker's exit code (0 when its run succeeded)."""
    body = {"job": job_def.name, "resources": spec,
            "run_config": {"ops": {f"{job_def.name}_op": {"config": {"payload": payload}}}}}
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), json.dumps(body)],
        env={**os.environ, "SEKALI_STOP_AT": stop_at},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while _state(proc.pid) != "T":
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        wait_for_lease_expiry(db, key)
        assert rerun(job_def, payload, spec).success
        proc.send_signal(signal.SIGCONT)
        return proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_stalled_worker_resumed_after_takeover_cannot_write(
    sqlite_url: str, redis_url: str, namespace: str, redis_client: Any, gateway_factory: Any,
) -> None:
    """Regression caught (invariant 3): a worker frozen after charging (SIGSTOP) wakes after
    another worker took the key over and finished; its late writes must be rejected (fence /
    owner token), it must record lease_lost, and the order keeps the new owner's result."""
    from resources.storage.migrations import upgrade

    db = Database.from_url(sqlite_url)
    upgrade(db)
    gateway = gateway_factory(True)
    spec = {"db_url": sqlite_url, "redis_url": redis_url, "namespace": namespace,
            "gateway_url": gateway.url, "lease_seconds": LEASE}
    payload = {"order_id": "o-s", "amount_cents": 250}
    stall_and_take_over(ops.charge_payment_job, payload, spec, db, "payment:o-s", "after_charge")
    assert len(gateway.charges()) == 1
    rows = AttemptRecorder(db).for_key("payment:o-s")
    by_fence = {(r["fence"], r["outcome"]) for r in rows}
    assert (1, "lease_lost") in by_fence and (2, "completed") in by_fence
    assert not any(r["outcome"] == "completed" and r["fence"] == 1 for r in rows)
    with db.statement() as conn:
        row = conn.execute(text("SELECT payment_status, payment_fence FROM orders")).one()
    assert (row.payment_status, row.payment_fence) == ("paid", 2)
    db.dispose()


def test_mail_worker_resumed_after_takeover_does_not_send(
    sqlite_url: str, redis_url: str, namespace: str, redis_client: Any, tmp_path: Path,
) -> None:
    """Regression caught (invariant 3): no fence guards an SMTP send, and the background
    heartbeat of a worker just resumed from a pause has not yet seen that its key was taken
    over. The job confirms its lease in the store right before sending, so the frozen worker
    records lease_lost and sends nothing; the new owner's mail is the only one."""
    from pipelines.domain.mail import message_id_for
    from resources.storage.migrations import upgrade
    from sandbox.mailsink import MailSink

    db = Database.from_url(sqlite_url)
    upgrade(db)
    sink = MailSink(f"sqlite:///{tmp_path / 'sink.db'}").start()
    spec = {"db_url": sqlite_url, "redis_url": redis_url, "namespace": namespace,
            "smtp_port": sink.port, "lease_seconds": LEASE}
    payload = {"template": "welcome", "user_id": "u-s", "date": "2026-11-29", "to": "s@x.test"}
    key = "email:welcome:u-s:2026-11-29"
    try:
        stall_and_take_over(ops.send_email_job, payload, spec, db, key, "before_send")
        assert [m["message_id"] for m in sink.messages()] == [message_id_for(key)]
    finally:
        sink.stop()
    outcomes = {(r["fence"], r["outcome"]) for r in AttemptRecorder(db).for_key(key)}
    assert (1, "lease_lost") in outcomes and (2, "completed") in outcomes
    db.dispose()


def test_stalled_fulfilment_resumed_after_takeover_is_not_dead_lettered(
    db: Database, db_url: str, redis_url: str, namespace: str, redis_client: Any,
) -> None:
    """Regression caught: a fulfilment worker frozen after reserving wakes after another worker
    took its key over and shipped the order. Its own error (the reservations it held are gone) is
    a stale holder's, not a failure of the work: it raises LeaseLost, its retry finds the key
    completed, and nothing lands in the DLQ as "place the order again" or marks the fulfilled
    order for compensation."""
    inventory = Inventory(db)
    inventory.set_stock("box", 10)
    spec = {"db_url": db_url, "redis_url": redis_url, "namespace": namespace,
            "lease_seconds": LEASE}
    payload = {"order_id": "o-t", "items": [{"sku": "box", "quantity": 3}]}
    key = "fulfil:o-t"
    code = stall_and_take_over(ops.fulfill_order_job, payload, spec, db, key, "after_reserve")
    outcomes = [r["outcome"] for r in AttemptRecorder(db).for_key(key)]
    assert "failed_permanent" not in outcomes and "dead_lettered" not in outcomes, outcomes
    assert "lease_lost" in outcomes and "duplicate_suppressed" in outcomes, outcomes
    assert code == 0
    assert inventory.stock("box") == (7, 0)
    with db.statement() as conn:
        status = conn.execute(
            text("SELECT fulfilment_status FROM orders WHERE order_id = 'o-t'")
        ).scalar()
    assert status == "fulfilled"
