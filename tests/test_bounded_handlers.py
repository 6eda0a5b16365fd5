"""Bounded handlers: a handler that hangs (a downstream that never answers, a client without a
timeout) is abandoned at its job type's ``max_runtime_seconds``, in every path that runs it,
and its request is dead-lettered ``timed_out``; its key passes on once its last lease has run
out (a takeover, counted towards the crash-loop bound), never held for as long as the process
lives. The hung handler is ``tests/hang_jobs.py``: it waits on an event nobody sets.

The tests never assert how long anything took: a guard only stops a test that would otherwise
hang for ever (what a handler without a bound did). The bound itself is checked on the ledger's
own record: the lease of the abandoned holder never reaches past its claim + bound + lease.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from sqlalchemy import text

from engine.attempts import AttemptRecorder
from engine.intake import enqueue
from engine.registry import JOB_TYPES
from engine.requests import RequestStatus, RequestStore
from engine.runtime import execute_request
from engine.services import Services
from pipelines.ops.request_job import request_job
from resources.dlq import DlqStore, FailureClass
from resources.idempotency import Claim, IdempotencyStore, Status
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from tests import hang_jobs
from tests.job_workers import dagster_resources

ROOT = Path(__file__).resolve().parent.parent
LEASE = 2.0
GUARD = 60.0  # only ends a test that would hang for ever; never a measurement


@pytest.fixture
def hang_type(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setitem(JOB_TYPES, "hang_probe", hang_jobs.JOB_TYPE)
    yield hang_jobs.JOB_TYPE
    for event in hang_jobs.HOLDS.values():  # let this process's hung threads end
        event.set()
    hang_jobs.HOLDS.clear()


def _services(db: Database) -> Services:
    return Services(db=db, store=IdempotencyStore(db, lease_seconds=LEASE),
                    attempts=AttemptRecorder(db))


def _payload(tmp_path: Path, n: str) -> dict[str, Any]:
    return {"folder": str(tmp_path), "n": n}


def _assert_bounded_and_dead_lettered(
    db: Database, key: str, request_id: int, started: float | None = None
) -> None:
    """The request is failed with one ``timed_out`` dead letter naming the bound; the key is
    still in progress under the abandoned holder, whose lease reaches no further than its
    claim + bound + lease (a fresh key's claim is its ``created_at``); a batch member's bound
    starts with its handler (``started``: when the handler entered, later still), so its lease
    reaches no further than that + bound + lease."""
    records = DlqStore(db).list_records(request_id=request_id)
    assert len(records) == 1, records
    assert records[0].error_class == FailureClass.TIMED_OUT
    assert records[0].request_id == request_id
    assert f"{hang_jobs.BOUND:g}" in (records[0].last_error or "")
    request = RequestStore(db).get(request_id)
    assert request is not None and request.status is RequestStatus.FAILED
    record = IdempotencyStore(db).get(key)
    assert record is not None and record.status is Status.IN_PROGRESS
    assert record.lease_expires_at is not None
    since = record.created_at if started is None else started
    assert record.lease_expires_at <= since + hang_jobs.BOUND + LEASE + 1e-6


def _after_expiry(db: Database, key: str) -> None:
    record = IdempotencyStore(db).get(key)
    assert record is not None and record.lease_expires_at is not None
    time.sleep(max(0.0, record.lease_expires_at - time.time()) + 0.2)


def _redelivered(db: Database, payload: dict[str, Any], key: str) -> None:
    """A redelivery after the abandoned lease ran out takes the key over (not
    ``AlreadyInProgress``), and the abandoned holder counts towards the crash-loop bound."""
    _after_expiry(db, key)
    outcome = execute_request("hang_probe", payload, services=_services(db))
    assert outcome.status == "completed" and outcome.result["takeover"] is True
    record = IdempotencyStore(db).get(key)
    assert record is not None and record.status is Status.COMPLETED and record.crashes == 1


def test_a_hung_handler_run_by_the_engine_alone_is_dead_lettered_timed_out(
    db_url: str, tmp_path: Path, hang_type: Any
) -> None:
    """Catches: a lease keeper that renews for as long as the process lives (the step never
    returns, the key is held for ever and every redelivery is ``AlreadyInProgress``), a bound
    read only by Dagster, and a process kept alive by its hung thread. The step entry (through
    ``execute_request``) runs in a process of its own, outside Dagster."""
    db = Database.from_url(db_url)
    upgrade(db)
    payload = _payload(tmp_path, "alone")
    request = enqueue("hang_probe", payload, db=db)
    spec = {"db_url": db_url, "lease": LEASE, "request_id": request.id, "payload": payload}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.hang_jobs", json.dumps(spec)], cwd=ROOT,
        capture_output=True, text=True, timeout=GUARD,
        env={**os.environ, "PYTHONPATH": str(ROOT), "SEKALI_JOB_MODULES": "tests.hang_jobs"},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ok"] is False and out["error_class"] == "timed_out" and out["dead_letter"]
    assert "tests/hang_jobs.py" in out["error"]  # the error says where the handler hung
    _assert_bounded_and_dead_lettered(db, "hang-probe:alone", request.id)
    assert not (tmp_path / "alone.sent").exists()
    _redelivered(db, payload, "hang-probe:alone")
    assert len((tmp_path / "alone").read_text().splitlines()) == 2
    db.dispose()


def test_a_hung_handler_in_a_dagster_run_is_dead_lettered_timed_out_and_its_late_send_refused(
    db_url: str, redis_url: str, namespace: str, tmp_path: Path, hang_type: Any
) -> None:
    """Catches: the per-request op waiting on its handler for ever (the run never ends, the
    request is never decided), a bound that is only Dagster's run tag, and a hung thread that
    sends once it wakes after its bound: its ``confirm_lease()`` must refuse. A real Dagster
    instance runs the job type's own job."""
    db = Database.from_url(db_url)
    upgrade(db)
    payload = _payload(tmp_path, "dagster")
    request = enqueue("hang_probe", payload, db=db)
    job = request_job(hang_type)
    done: dict[str, Any] = {}

    def launch() -> None:
        with dg.DagsterInstance.ephemeral() as instance:
            done["result"] = job.execute_in_process(
                run_config={"ops": {hang_type.op_name: {"config": {"request_id": request.id}}}},
                resources=dagster_resources(db_url=db_url, redis_url=redis_url,
                                            namespace=namespace, lease_seconds=LEASE),
                instance=instance, raise_on_error=False)

    runner = threading.Thread(target=launch, daemon=True)
    runner.start()
    runner.join(timeout=GUARD)
    assert not runner.is_alive(), "the run waited on its hung handler"
    assert not done["result"].success
    _assert_bounded_and_dead_lettered(db, "hang-probe:dagster", request.id)
    hang_jobs.HOLDS["dagster"].set()  # the hung thread wakes, late, and tries to send
    deadline = time.monotonic() + GUARD
    while not (tmp_path / "dagster.refused").exists():
        assert time.monotonic() < deadline, "the released handler neither sent nor was refused"
        time.sleep(0.05)
    assert (tmp_path / "dagster.refused").read_text() == "HandlerTimedOut"
    assert not (tmp_path / "dagster.sent").exists()
    _redelivered(db, payload, "hang-probe:dagster")
    db.dispose()


def test_a_resident_worker_abandons_a_hung_handler_runs_the_rest_and_ends_itself(
    db_url: str, tmp_path: Path, hang_type: Any
) -> None:
    """Catches: a resident worker stuck for ever behind one hung handler (every other request
    of its batch and queue waiting with it), and a worker that goes on claiming while a hung
    thread of its process may hold a transaction or a slot: it ends itself after the batch, so
    its supervisor starts a fresh process. The hung request is dead-lettered ``timed_out``;
    its neighbour in the batch completes."""
    from engine.delivery import DeliveryPolicy
    from engine.worker import ResidentWorker, WorkerPolicy
    from resources.wakeup import PollWakeup

    db = Database.from_url(db_url)
    upgrade(db)
    hung = enqueue("hang_probe", _payload(tmp_path, "resident"), db=db)
    fine = enqueue("hang_probe", {**_payload(tmp_path, "neighbour"), "quick": True}, db=db)
    stop = threading.Event()
    worker = ResidentWorker(
        _services(db), WorkerPolicy(queue="light", batch_size=10, poll_seconds=0.1,
                                    idle_seconds=GUARD),
        owner="worker-hang", wakeup=PollWakeup(stop), stop=stop,
        delivery=DeliveryPolicy.from_env({}))
    stats: dict[str, Any] = {}
    runner = threading.Thread(target=lambda: stats.update(done=worker.run()), daemon=True)
    runner.start()
    runner.join(timeout=GUARD)
    stop.set()
    assert not runner.is_alive(), "the worker waited on its hung handler"
    assert "timed out" in stats["done"].reason
    _assert_bounded_and_dead_lettered(db, "hang-probe:resident", hung.id,
                                      started=hang_jobs.entered(tmp_path, "resident"))
    neighbour = RequestStore(db).get(fine.id)
    assert neighbour is not None and neighbour.status is RequestStatus.COMPLETED
    with db.statement() as conn:
        crashes = conn.execute(text("SELECT crashes FROM idempotency_records WHERE key = :k"),
                               {"k": "hang-probe:resident"}).scalar()
    assert crashes == 0  # counted by the takeover, not before
    _redelivered(db, _payload(tmp_path, "resident"), "hang-probe:resident")  # ran alone: counted
    db.dispose()



def test_the_chaos_worker_reports_a_hung_handler_timed_out_and_exits(
    tmp_path: Path, hang_type: Any
) -> None:
    """Catches: the chaos harness's worker stuck for ever on a hung delivery (the coordinator
    waits, the key is held), or going on with a hung thread inside: it reports the delivery
    failed ``timed_out`` and its process exits, so the coordinator starts a fresh one."""
    from proof.chaos_worker import CONFIG_ENV, TIMED_OUT_EXIT, WorkerConfig
    from sandbox.gateway import GatewayServer
    from sandbox.mailsink import MailSink
    from sandbox.redis_server import RedisServer, free_port

    redis = RedisServer(tmp_path / "redis", port=free_port()).start()
    gateway = GatewayServer(f"sqlite:///{tmp_path / 'gateway.db'}").start()
    sink = MailSink(f"sqlite:///{tmp_path / 'mail.db'}").start()
    url = f"sqlite:///{tmp_path / 'app.db'}"
    db = Database.from_url(url)
    upgrade(db)
    config = WorkerConfig(
        worker_id=0, database_url=url, redis_url=redis.url, gateway_url=gateway.url,
        smtp_host=sink.host, smtp_port=sink.port, lease_seconds=LEASE, naive=False,
        job_types=("hang_probe",),
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "proof.chaos_worker"], cwd=ROOT,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, CONFIG_ENV: config.to_json(), "PYTHONPATH": str(ROOT),
             "SEKALI_JOB_MODULES": "tests.hang_jobs"},
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        assert json.loads(proc.stdout.readline())["t"] == "ready"
        msg = {"tok": "1.1", "req": 1, "request_id": 1, "job_type": "hang_probe",
               "payload": _payload(tmp_path, "chaos"), "attempt": 0}
        proc.stdin.write(json.dumps(msg) + "\n")
        proc.stdin.flush()
        while (line := json.loads(proc.stdout.readline()))["t"] not in ("done", "fail"):
            pass
        assert line["t"] == "fail" and line["dlq_class"] == "timed_out", line
        assert line["retry"] is False
        assert proc.wait(GUARD) == TIMED_OUT_EXIT  # no "exit" was sent: it ended itself
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        db.dispose()
        for part in (sink, gateway, redis):
            part.stop()


def test_a_resident_worker_run_in_dagster_ends_after_abandoning_a_hung_handler(
    db_url: str, redis_url: str, namespace: str, tmp_path: Path, hang_type: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Catches: a worker run that stays STARTED behind a hung handler (its slot never served
    again, its requests held): the run of the shipped worker job on a real Dagster instance
    ends, saying why, with the hung request dead-lettered ``timed_out``."""
    from pipelines.ops.worker import sekali_worker

    monkeypatch.setenv("SEKALI_WAKEUP", "poll")
    monkeypatch.setenv("SEKALI_WORKER_POLL", "0.1")
    monkeypatch.setenv("SEKALI_WORKER_IDLE", str(GUARD))
    monkeypatch.delenv("SEKALI_INTAKE_MODE", raising=False)
    monkeypatch.delenv("SEKALI_INTAKE_MODES", raising=False)
    db = Database.from_url(db_url)
    upgrade(db)
    request = enqueue("hang_probe", _payload(tmp_path, "worker-run"), db=db)
    done: dict[str, Any] = {}

    def launch() -> None:
        with dg.DagsterInstance.ephemeral() as instance:
            done["result"] = sekali_worker.execute_in_process(
                run_config={"ops": {"resident_worker": {"config": {"queue": "light"}}}},
                resources=dagster_resources(db_url=db_url, redis_url=redis_url,
                                            namespace=namespace, lease_seconds=LEASE),
                instance=instance, raise_on_error=False)

    runner = threading.Thread(target=launch, daemon=True)
    runner.start()
    runner.join(timeout=GUARD)
    assert not runner.is_alive(), "the worker run waited on its hung handler"
    result = done["result"]
    assert result.success
    assert result.output_for_node("resident_worker")["ended"].startswith("timed out")
    _assert_bounded_and_dead_lettered(db, "hang-probe:worker-run", request.id,
                                      started=hang_jobs.entered(tmp_path, "worker-run"))
    db.dispose()


def test_the_keeper_renews_until_the_bound_only_and_then_refuses(db: Database) -> None:
    """Catches: a keeper that renews past the bound (the key held as long as the process
    lives), a renewal that carries the lease beyond claim + bound, and a ``confirm()`` (the
    send bound) that still passes after the bound."""
    from resources.errors import HandlerTimedOut

    store = IdempotencyStore(db, lease_seconds=1.0)
    claim = store.begin("bounded:keeper", payload={})
    assert isinstance(claim, Claim)
    with store.keep_alive(claim, interval=0.05, runtime=0.3) as keeper:
        keeper.confirm()  # within the bound: the lease is ours
        assert keeper.until is not None
        while time.monotonic() < keeper.until + 0.1:
            time.sleep(0.02)
        with pytest.raises(HandlerTimedOut):
            keeper.check()
        with pytest.raises(HandlerTimedOut):
            keeper.confirm()
        beats = keeper.beats
        time.sleep(0.2)
        assert keeper.beats == beats  # renewed no more
    record = store.get("bounded:keeper")
    assert record is not None and record.status is Status.IN_PROGRESS
    assert record.lease_expires_at is not None
    assert record.lease_expires_at <= claim.lease_expires_at + 0.3 + 1e-6
