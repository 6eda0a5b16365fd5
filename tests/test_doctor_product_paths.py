"""``sekali doctor`` counts what the product itself does as healthy: each test runs, through a
real Dagster run of the real job code, a path that used to raise a false alarm, then asks the
check. SQLite and Postgres.

- A Launchpad run with a bad amount is refused at the validation boundary: its attempt has no
  key because the payload never got one, and nothing happened downstream. The idempotency
  coverage check used to fail on it (ERROR, doctor exit 1, the UI check red).
- A Launchpad run (no correlation id given) dead-lettered and amended with ``--patch``: the new
  version's request used to have no correlation id (the correlation check's WARN).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from sqlalchemy import text

from engine.attempts import AttemptRecorder
from engine.health.diagnosis import DiagnosisSetup, check_correlation, check_idempotency_coverage
from engine.registry import JOB_TYPES
from engine.replay import amend
from engine.requests import RequestStore
from pipelines.ops import charge_payment_job
from resources.dlq import DlqStore
from resources.storage.db import Database
from sandbox.gateway import GatewayServer
from sensors.dlq import dead_letter_run
from tests.job_workers import dagster_resources

pytestmark = [pytest.mark.dagster]


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[GatewayServer]:
    with GatewayServer(f"sqlite:///{tmp_path / 'gateway.db'}") as server:
        yield server


@pytest.fixture
def launchpad(
    db_url: str, redis_url: str, namespace: str, gateway: GatewayServer
) -> Iterator[Any]:
    """Launch ``charge_payment`` as the Launchpad does: op config only, no sekali tags."""
    resources = dagster_resources(
        db_url=db_url, redis_url=redis_url, namespace=namespace, gateway_url=gateway.url
    )
    with dg.DagsterInstance.ephemeral() as instance:

        def launch(payload: dict[str, Any]) -> dg.ExecuteInProcessResult:
            return charge_payment_job.execute_in_process(
                run_config={"ops": {"charge_payment_op": {"config": {"payload": payload}}}},
                instance=instance, resources=resources, raise_on_error=False,
            )

        launch.instance = instance  # type: ignore[attr-defined]
        yield launch


def _setup(db: Database) -> DiagnosisSetup:
    return DiagnosisSetup(db=db, job_types=JOB_TYPES, lease_seconds=30.0)


def test_a_launchpad_run_with_a_bad_amount_is_not_an_attempt_without_a_key(
    db: Database, launchpad: Any, gateway: GatewayServer
) -> None:
    """Catches: 'attempts of side-effecting job types without a key: {charge_payment: 1}' for
    a payload the boundary refused."""
    run = launchpad({"order_id": "o-neg", "amount_cents": -5, "currency": "EUR"})
    assert not run.success
    (attempt,) = AttemptRecorder(db).since(0)
    assert attempt["idempotency_key"] is None and attempt["error_class"] == "ValidationError"
    assert gateway.ledger.by_reference("o-neg") == []
    finding = check_idempotency_coverage(_setup(db))
    assert finding.passed, finding.found
    assert finding.evidence["refused_inputs"] == {"charge_payment": 1}
    assert finding.evidence["keyless_attempts"] == {}


def test_a_patched_replay_of_a_launchpad_run_keeps_a_correlation_id(
    db: Database, launchpad: Any
) -> None:
    """Catches: the amended version's request enqueued with no correlation id because the
    Launchpad run's DLQ record had none (the correlation check's WARN)."""
    with db.transaction() as conn:  # the shop's order says 1300; the Launchpad asks 1200
        conn.execute(
            text(
                "INSERT INTO orders (order_id, amount_cents, currency, payment_status,"
                " created_at, updated_at) VALUES ('o-lp', 1300, 'EUR', 'payment_pending', :t, :t)"
            ),
            {"t": time.time()},
        )
    failed = launchpad({"order_id": "o-lp", "amount_cents": 1200, "currency": "EUR"})
    assert not failed.success
    store = DlqStore(db)
    (recorded,) = dead_letter_run(launchpad.instance, failed.dagster_run, store, actor="test")
    assert recorded.record.correlation_id == failed.run_id  # the id the op's attempt carried
    made = amend(store, recorded.record.id, {"amount_cents": 1300}, actor="test")
    version = RequestStore(db).get(made.request_id or 0)
    assert version is not None and version.correlation_id == failed.run_id
    finding = check_correlation(_setup(db))
    assert finding.evidence["requests_without_id"] == 0, finding.found
    assert finding.passed, finding.found
