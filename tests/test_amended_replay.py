"""Amended replay (``sekali dlq replay ID --patch``): a new version of the intent, never the old.

A payment is dead-lettered because its amount is wrong (the order says 1300, the request 1200:
``OrderAmountMismatch``, permanent). The patch makes ``payment:o1#v2``; the real job code charges
the real sandbox gateway once under v2's reference and never under the original key's. A second
patch is refused until v2 failed for good; then it makes ``#v3``. Concurrent amendments of one
record from several processes make exactly one version. SQLite and Postgres.
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

from cli.main import main as cli
from engine.intake import enqueue
from engine.replay import AmendRefused, Versions, amend
from engine.requests import RequestStore
from engine.runtime import execute_request
from engine.services import Services
from pipelines.definitions import intake_sensor
from pipelines.jobs.payment import reference_for
from pipelines.ops import charge_payment_job
from pipelines.ops.dlq_ops import dlq_operations
from resources.dagster_resources import DlqResource
from resources.dlq import DlqRecord, DlqStatus, DlqStore, FailureInfo
from resources.idempotency import IdempotencyStore
from resources.storage.db import Database
from resources.storage.settings import Settings
from sandbox.gateway import GatewayServer
from sensors.dlq import dead_letter_failed_requests
from sensors.intake import RequestsResource
from tests.job_workers import dagster_resources

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[GatewayServer]:
    with GatewayServer(f"sqlite:///{tmp_path / 'gateway.db'}") as server:
        yield server


def _services(db_url: str, redis_url: str, namespace: str, gateway: GatewayServer) -> Services:
    settings = Settings(
        database_url=db_url, redis_url=redis_url, dagster_home=Path("/nonexistent"),
        gateway_url=gateway.url, smtp_host="127.0.0.1", smtp_port=9,
    )
    return Services.from_settings(
        settings, lease_seconds=5.0, budget_namespace=namespace, cache_namespace=namespace
    )


def _order(db: Database, order_id: str, amount: int) -> None:
    """The shop's order row: the amount the customer agreed to."""
    with db.transaction() as conn:
        conn.execute(
            text(
                "INSERT INTO orders (order_id, amount_cents, currency, payment_status,"
                " created_at, updated_at) VALUES (:o, :a, 'EUR', 'payment_pending', :t, :t)"
            ),
            {"o": order_id, "a": amount, "t": time.time()},
        )


def _run(services: Services, requests: RequestStore, key: str) -> Any:
    """Serve the pending request under ``key`` as the per-request op does (real job code)."""
    request = requests.get_by_key(key)
    assert request is not None
    requests.mark_running(request.id)
    try:
        return execute_request(
            request.job_type, request.payload, services=services, key=request.key,
            request_id=request.id, correlation_id=request.correlation_id,
        )
    except Exception as exc:  # noqa: BLE001 - the failure is what the test looks at
        requests.mark_failed(request.id, f"{type(exc).__name__}: {exc}", error_class="permanent")
        return exc


def _dead_letter(store: DlqStore, key: str) -> DlqRecord:
    """The record of ``key``: written where its failure was decided, or by the sweep for a
    request failed by hand."""
    dead_letter_failed_requests(store)
    for record in store.list_records():
        if record.idempotency_key == key:
            return record
    raise AssertionError(f"no DLQ record for {key}")


def _charges(gateway: GatewayServer, key: str) -> int:
    return len(gateway.ledger.by_reference(reference_for(key)))


def test_a_patched_payment_charges_once_under_its_new_version_never_under_the_old(
    db: Database, db_url: str, redis_url: str, namespace: str, gateway: GatewayServer,
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Catches: a patch replayed under the original key (its effect could repeat), a version
    made while the previous one is still alive, a refused patch that changed something, a
    patch accepted after the key completed."""
    services = _services(db_url, redis_url, namespace, gateway)
    requests, store = RequestStore(db), DlqStore(db)
    _order(db, "o1", 1300)
    enqueue("charge_payment", {"order_id": "o1", "amount_cents": 1200}, db=db)
    failed = _run(services, requests, "payment:o1")
    assert type(failed).__name__ == "OrderAmountMismatch"
    record = _dead_letter(store, "payment:o1")
    url = ["--url", db_url]

    # A patch the boundary refuses: exit 2 naming the field, nothing changed.
    assert cli(["dlq", "replay", str(record.id), "--patch", '{"amount_cents": -5}', *url]) == 2
    assert "amount_cents" in capsys.readouterr().err
    assert cli(["dlq", "replay", str(record.id), "--patch", "{not json", *url]) == 2
    assert "patch" in capsys.readouterr().err
    assert store.get(record.id).status is DlqStatus.OPEN
    assert requests.get_by_key("payment:o1#v2") is None
    assert requests.rejections(source="dlq_patch")

    # The dry run says what it would make and makes nothing.
    assert cli(["dlq", "replay", str(record.id), "--patch", '{"amount_cents": 1250}',
                "--dry-run", *url]) == 0
    assert "would make payment:o1#v2" in capsys.readouterr().out
    assert requests.get_by_key("payment:o1#v2") is None

    # v2 with another wrong amount (from a file), by a named actor.
    patch_file = tmp_path / "patch.json"
    patch_file.write_text('{"amount_cents": 1250}')
    assert cli(["dlq", "replay", str(record.id), "--patch", f"@{patch_file}",
                "--actor", "ops@test", "--reason", "customer called", *url]) == 0
    assert "made payment:o1#v2 (version 2" in capsys.readouterr().out
    closed = store.get(record.id)
    assert closed.status is DlqStatus.DISCARDED
    assert store.audit(record.id)[-1]["action"] == "superseded"
    assert requests.superseded_by(record.request_id or 0) == "payment:o1#v2"
    assert not requests.requeue(record.request_id or 0)  # closed for good
    version = Versions(db).of_key("payment:o1#v2")
    assert version is not None and version.previous_key == "payment:o1"
    assert version.actor == "ops@test" and version.reason == "customer called"
    assert version.diff == [{"path": "amount_cents", "from": 1200, "to": 1250}]

    # The superseded record refuses a second patch, naming its successor; so does v2 before
    # it failed (it has no record yet).
    assert cli(["dlq", "replay", str(record.id), "--patch", '{"amount_cents": 1300}', *url]) == 1
    assert "superseded by payment:o1#v2" in capsys.readouterr().err

    assert type(_run(services, requests, "payment:o1#v2")).__name__ == "OrderAmountMismatch"
    record2 = _dead_letter(store, "payment:o1#v2")
    assert cli(["dlq", "replay", str(record2.id), "--patch", '{"amount_cents": 1300}', *url]) == 0
    assert "made payment:o1#v3 (version 3" in capsys.readouterr().out

    outcome = _run(services, requests, "payment:o1#v3")
    assert not isinstance(outcome, Exception), outcome
    assert _charges(gateway, "payment:o1#v3") == 1
    assert _charges(gateway, "payment:o1") == 0 and _charges(gateway, "payment:o1#v2") == 0
    assert len(gateway.charges()) == 1
    assert IdempotencyStore(db).get("payment:o1").status == "failed"  # never run again
    assert [v.key for v in Versions(db).chain("payment:o1#v3")] == [
        "payment:o1#v2", "payment:o1#v3",
    ]
    # both closed records say what their newest version did, not merely "discarded"
    v3 = requests.get_by_key("payment:o1#v3")
    assert v3 is not None and requests.mark_completed(v3.id)
    capsys.readouterr()
    assert cli(["dlq", "show", str(record.id), "--json", *url]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["status"], shown["outcome"]) == (
        "discarded", "superseded by payment:o1#v3: completed")
    assert cli(["dlq", "list", "--status", "all", "--json", *url]) == 0
    listed = {r["id"]: r.get("outcome") for r in json.loads(capsys.readouterr().out)}
    assert listed[record.id] == listed[record2.id] == "superseded by payment:o1#v3: completed"
    assert cli(["dlq", "list", "--status", "all", *url]) == 0
    assert "superseded by payment:o1#v3: completed" in capsys.readouterr().out

    # A record whose key completed (the effect happened) is refused, saying so.
    late = store.record_failure(
        FailureInfo(
            job_type="charge_payment", dedupe_key="late:o1", error_type="Late",
            message="recorded after the key completed", run_id="r-late",
            idempotency_key="payment:o1#v3", payload={"order_id": "o1", "amount_cents": 1300},
        )
    ).record
    assert cli(["dlq", "replay", str(late.id), "--patch", '{"amount_cents": 1400}', *url]) == 1
    assert "completed" in capsys.readouterr().err
    assert store.get(late.id).status is DlqStatus.OPEN
    assert len(gateway.charges()) == 1


def test_a_key_that_reached_a_recovery_point_is_not_amended(db: Database) -> None:
    """Catches: a new version made while the original's effect may have gone out (a send
    recorded before an unanswered charge): a second reference would charge twice."""
    store, ledger = DlqStore(db), IdempotencyStore(db)
    claim = ledger.begin("payment:o9")
    ledger.checkpoint(claim, "charge_sent", {"sent_at": 1.0})
    ledger.fail(claim, "no answer", "permanent")
    record = store.record_failure(
        FailureInfo(
            job_type="charge_payment", dedupe_key="key:o9", error_type="GatewayUnavailable",
            message="timeout", run_id="r9", idempotency_key="payment:o9",
            payload={"order_id": "o9", "amount_cents": 100},
        )
    ).record
    with pytest.raises(AmendRefused, match="charge_sent"):
        amend(store, record.id, {"amount_cents": 200}, actor="t")
    assert store.get(record.id).status is DlqStatus.OPEN
    assert Versions(db).chain("payment:o9") == []


_WORKER = """
import sys
from engine.replay import AmendRefused, amend
from resources.dlq import DlqStore
from resources.storage.db import Database
store = DlqStore(Database.from_url(sys.argv[1]))
try:
    print(amend(store, int(sys.argv[2]), {"amount_cents": int(sys.argv[3])}, actor="w").key)
except AmendRefused as exc:
    print(f"refused: {exc}")
"""


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_concurrent_amendments_of_one_record_make_exactly_one_version(
    db: Database, db_url: str
) -> None:
    """Catches: two processes amending the same record at once each making a version (two
    requests, two effects) or leaving the record half-closed. Each worker is stopped (SIGSTOP)
    after every check passed and before it writes, so all of them saw the record open; then
    all are resumed at once."""
    store, requests = DlqStore(db), RequestStore(db)
    enqueued = enqueue("charge_payment", {"order_id": "o5", "amount_cents": 100}, db=db)
    requests.mark_failed(enqueued.id, "OrderAmountMismatch: wrong", error_class="permanent")
    record = _dead_letter(store, "payment:o5")
    env = {**os.environ, "SEKALI_STOP_AT": "amend_checked", "PYTHONPATH": str(ROOT)}
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, db_url, str(record.id), str(200 + i)],
            env=env, stdout=subprocess.PIPE, text=True,
        )
        for i in range(4)
    ]
    try:
        deadline = time.monotonic() + 120
        while not all(_state(w.pid) == "T" for w in workers):
            assert time.monotonic() < deadline, "the workers never reached their checks"
            time.sleep(0.05)
        for w in workers:
            os.kill(w.pid, signal.SIGCONT)
        results = [w.communicate(timeout=120)[0].strip() for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
    made = [r for r in results if not r.startswith("refused")]
    assert made == ["payment:o5#v2"], results
    assert all("already amended" in r or "changed meanwhile" in r
               for r in results if r.startswith("refused")), results
    with db.statement() as conn:
        assert conn.execute(
            text("SELECT COUNT(*) FROM job_requests WHERE key LIKE 'payment:o5#%'")
        ).scalar() == 1
        assert conn.execute(text("SELECT COUNT(*) FROM request_versions")).scalar() == 1
    assert store.get(record.id).status is DlqStatus.DISCARDED
    assert [a["action"] for a in store.audit(record.id)].count("superseded") == 1


def test_dlq_operations_amends_and_shows_versions_and_audit(db: Database, db_url: str) -> None:
    """Catches: the UI job unable to amend, or an output that hides the new version and who
    made it."""
    store, requests = DlqStore(db), RequestStore(db)
    enqueued = enqueue("charge_payment", {"order_id": "o7", "amount_cents": 100}, db=db)
    requests.mark_failed(enqueued.id, "OrderAmountMismatch: wrong", error_class="permanent")
    record = _dead_letter(store, "payment:o7")

    def run(**config: Any) -> dg.ExecuteInProcessResult:
        return dlq_operations.execute_in_process(
            run_config={"ops": {"dlq_operation": {"config": config}}},
            resources={"dlq": DlqResource(database_url=db_url)},
            instance=dg.DagsterInstance.ephemeral(),
            raise_on_error=False,
        )

    bad = run(action="replay", ids=[record.id], patch='{"amount_cents": "lots"}', dry_run=False)
    assert not bad.success and "amount_cents" in str(bad.all_events)
    assert store.get(record.id).status is DlqStatus.OPEN
    dry = run(action="replay", ids=[record.id], patch='{"amount_cents": 150}')
    assert dry.success and requests.get_by_key("payment:o7#v2") is None
    done = run(action="replay", ids=[record.id], patch='{"amount_cents": 150}', dry_run=False,
               actor="alice")
    assert done.success
    assert requests.get_by_key("payment:o7#v2") is not None
    metadata = next(
        e.event_specific_data.metadata
        for e in done.all_events
        if e.event_type_value == "STEP_OUTPUT"
    )
    versions = metadata["versions"].value.records
    assert [(r.data["key"], r.data["version"], r.data["actor"]) for r in versions] == [
        ("payment:o7#v2", 2, "alice")
    ]
    assert json.loads(versions[0].data["diff"]) == [
        {"path": "amount_cents", "from": 100, "to": 150}
    ]
    actions = [r.data["action"] for r in metadata["audit"].value.records]
    assert actions == ["dead_lettered", "superseded"]


def test_a_version_writes_rows_the_original_key_fenced(
    db: Database, db_url: str, redis_url: str, namespace: str, gateway: GatewayServer,
) -> None:
    """Catches: a new key's fences restarting at 1 under rows the original key fenced higher
    (the order's ``payment_fence``): the version would be refused by the fence, forever."""
    services = _services(db_url, redis_url, namespace, gateway)
    requests, store, ledger = RequestStore(db), DlqStore(db), IdempotencyStore(db)
    _order(db, "o3", 1300)
    enqueued = enqueue("charge_payment", {"order_id": "o3", "amount_cents": 1200}, db=db)
    for _ in range(3):  # three claims of the original key, the last one fenced the order
        claim = ledger.begin("payment:o3", payload={"order_id": "o3", "amount_cents": 1200,
                                                    "currency": "EUR"})
        ledger.fail(claim, "LimitNotAcquired: busy", "transient")
    assert claim.fence == 3
    with db.transaction() as conn:
        conn.execute(text("UPDATE orders SET payment_fence = 3 WHERE order_id = 'o3'"))
    claim = ledger.begin("payment:o3", payload={"order_id": "o3", "amount_cents": 1200,
                                                "currency": "EUR"})
    ledger.fail(claim, "wrong amount", "permanent")
    requests.mark_failed(enqueued.id, "OrderAmountMismatch: wrong", error_class="permanent")
    record = _dead_letter(store, "payment:o3")

    # a request enqueued by hand under the version's key with another payload: refused whole
    enqueue("charge_payment", {"order_id": "o3", "amount_cents": 9}, key="payment:o3#v2", db=db)
    with pytest.raises(AmendRefused, match="exists already"):
        amend(store, record.id, {"amount_cents": 1300}, actor="t")
    assert store.get(record.id).status is DlqStatus.OPEN
    assert Versions(db).chain("payment:o3") == []
    with db.transaction() as conn:
        conn.execute(text("DELETE FROM job_requests WHERE key = 'payment:o3#v2'"))

    made = amend(store, record.id, {"amount_cents": 1300}, actor="t")
    outcome = _run(services, requests, made.key)
    assert not isinstance(outcome, Exception), outcome
    assert outcome.fence == 5
    assert _charges(gateway, "payment:o3#v2") == 1 and _charges(gateway, "payment:o3") == 0


def test_the_version_runs_through_intake_and_dagster_under_its_own_key(
    db: Database, db_url: str, redis_url: str, namespace: str, gateway: GatewayServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Catches: a version the intake sensor or the per-request job cannot run (the derived key
    in run keys and tags), or a run that charges under the original key."""
    monkeypatch.setenv("SEKALI_INTAKE_MODE", "per_request")
    resources = dagster_resources(
        db_url=db_url, redis_url=redis_url, namespace=namespace, gateway_url=gateway.url
    )
    resources["requests"] = RequestsResource(database_url=db_url)
    requests, store = RequestStore(db), DlqStore(db)
    _order(db, "o8", 1300)
    enqueue("charge_payment", {"order_id": "o8", "amount_cents": 1200}, db=db)
    with dg.DagsterInstance.ephemeral() as instance:

        def launch() -> tuple[dg.RunRequest, dg.ExecuteInProcessResult]:
            tick = intake_sensor(
                dg.build_sensor_context(
                    instance=instance, resources={"requests": resources["requests"]}
                )
            )
            assert isinstance(tick, dg.SensorResult)
            (request,) = tick.run_requests or []
            return request, charge_payment_job.execute_in_process(
                run_config=request.run_config, instance=instance,
                tags={**request.tags, "dagster/run_key": request.run_key or ""},
                resources=resources, raise_on_error=False,
            )

        first, failed = launch()
        assert not failed.success
        request = requests.get_by_key("payment:o8")
        assert request is not None and request.status == "failed"  # the op's failure path
        record = _dead_letter(store, "payment:o8")
        made = amend(store, record.id, {"amount_cents": 1300}, actor="t")
        second, done = launch()
    assert done.success
    assert second.run_key == "intake:payment:o8#v2"
    assert second.tags["sekali/key"] == "payment:o8#v2"
    assert second.tags["sekali/amends"] == "payment:o8"  # the UI links the version to its origin
    assert "sekali/amends" not in first.tags
    assert done.dagster_run.tags["sekali/outcome"] == "effect"
    assert requests.get(made.request_id or 0).status == "completed"
    assert _charges(gateway, "payment:o8#v2") == 1 and _charges(gateway, "payment:o8") == 0
