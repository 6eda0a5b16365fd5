"""Retries of the per-request jobs in a real Dagster run: transient errors come back after our
capped, jittered, growing delays; attempts and the shared retry budget stop them; the key is
left retryable for the DLQ replay."""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from engine.attempts import AttemptRecorder
from engine.launch import request_run_config
from engine.requests import RequestStatus, RequestStore
from pipelines import ops
from pipelines.jobs.payment import reference_for
from resources.idempotency import IdempotencyStore, Status
from resources.retry import BUDGET_UNAVAILABLE
from resources.storage.db import Database
from sandbox.gateway import GatewayServer
from sandbox.redis_server import RedisServer, free_port
from tests.job_workers import dagster_resources

pytestmark = pytest.mark.dagster

BASE, CAP = 0.05, 0.4


@pytest.fixture
def failing_gateway(tmp_path: Path) -> Iterator[GatewayServer]:
    gateway = GatewayServer(f"sqlite:///{tmp_path / 'gateway.db'}", error_rate=1.0).start()
    try:
        yield gateway
    finally:
        gateway.stop()


def run_payment(
    db_url: str, redis_url: str, namespace: str, gateway: GatewayServer, order_id: str,
    retry: dict[str, Any],
) -> dg.ExecuteInProcessResult:
    resources = dagster_resources(
        db_url=db_url, redis_url=redis_url, namespace=namespace, gateway_url=gateway.url,
        retry=retry,
    )
    with dg.DagsterInstance.ephemeral() as instance:
        return ops.charge_payment_job.execute_in_process(
            run_config={"ops": {"charge_payment_op": {"config": {
                "payload": {"order_id": order_id, "amount_cents": 900}}}}},
            resources=resources, instance=instance, raise_on_error=False,
        )


def waits(result: dg.ExecuteInProcessResult) -> list[float]:
    return [
        float(e.event_specific_data.seconds_to_wait)  # type: ignore[union-attr]
        for e in result.all_events
        if e.event_type_value == "STEP_UP_FOR_RETRY"
    ]


def test_transient_error_is_retried_with_growing_jittered_capped_delays(
    db: Database, db_url: str, redis_url: str, namespace: str, redis_client: Any,
    failing_gateway: GatewayServer,
) -> None:
    """Regression caught: no cap, no jitter, delays that do not grow, or retries that go on
    past max_attempts. With equal jitter each delay lies in [ceiling/2, ceiling], ceilings
    double up to the cap, so the sequence must grow and never pass the cap."""
    result = run_payment(
        db_url, redis_url, namespace, failing_gateway, "o-t",
        {"max_attempts": 5, "base_delay": BASE, "max_delay": CAP, "jitter": "equal",
         "budget_enabled": False},
    )
    assert not result.success
    delays = waits(result)
    ceilings = [min(CAP, BASE * 2**n) for n in range(4)]
    assert len(delays) == 4
    for delay, ceiling in zip(delays, ceilings, strict=True):
        assert ceiling / 2 <= delay <= ceiling <= CAP
    assert delays == sorted(delays)
    assert any(d != c for d, c in zip(delays, ceilings, strict=True))  # jittered, not exact
    rows = AttemptRecorder(db).for_key("payment:o-t")
    assert [r["outcome"] for r in rows] == ["retried"] * 4 + ["dead_lettered"]
    assert [r["attempt"] for r in rows] == [0, 1, 2, 3, 4]
    assert {r["error_class"] for r in rows} == {"GatewayUnavailable"}
    record = IdempotencyStore(db).get("payment:o-t")
    assert record is not None and record.status is Status.RETRYABLE  # replayable from the DLQ
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert "attempts exhausted" in str(failure.event_specific_data)


def test_exhausted_retry_budget_stops_retries(
    db: Database, db_url: str, redis_url: str, namespace: str, redis_client: Any,
    failing_gateway: GatewayServer,
) -> None:
    """Regression caught: retries that keep multiplying load on a sick downstream after the
    shared budget ran dry. One token: one retry, then give up with that reason."""
    result = run_payment(
        db_url, redis_url, namespace, failing_gateway, "o-b",
        {"max_attempts": 10, "base_delay": 0.01, "max_delay": 0.05, "budget_capacity": 1.0},
    )
    assert not result.success
    assert len(waits(result)) == 1
    rows = AttemptRecorder(db).for_key("payment:o-b")
    assert [r["outcome"] for r in rows] == ["retried", "dead_lettered"]
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert "retry budget exhausted" in str(failure.event_specific_data)


def test_transient_error_then_recovery_charges_once(
    db: Database, db_url: str, redis_url: str, namespace: str, redis_client: Any,
    tmp_path: Path,
) -> None:
    """Regression caught: a retry after "charged, then the response was dropped" that charges
    again. The gateway ignores keys and drops every answer after charging: the retry must find
    the charge by its reference instead of charging a second time."""
    gateway = GatewayServer(
        f"sqlite:///{tmp_path / 'gw.db'}", drop_after_charge_rate=1.0,
        honour_idempotency_key=False,
    ).start()
    try:
        resources = dagster_resources(
            db_url=db_url, redis_url=redis_url, namespace=namespace, gateway_url=gateway.url,
            send_idempotency_key=False,
            retry={"max_attempts": 4, "base_delay": 0.01, "max_delay": 0.05},
        )

        with dg.DagsterInstance.ephemeral() as instance:
            result = ops.charge_payment_job.execute_in_process(
                run_config={"ops": {"charge_payment_op": {"config": {
                    "payload": {"order_id": "o-d", "amount_cents": 300}}}}},
                resources=resources, instance=instance, raise_on_error=False,
            )
        charges = [c for c in gateway.charges() if c["reference"] == reference_for("payment:o-d")]
    finally:
        gateway.stop()
    assert result.success
    assert len(charges) == 1
    outcomes = [r["outcome"] for r in AttemptRecorder(db).for_key("payment:o-d")]
    assert outcomes == ["retried", "completed"]


def test_a_retry_decision_ends_when_the_budgets_redis_is_down(
    db: Database, db_url: str, redis_url: str, namespace: str, tmp_path: Path,
    failing_gateway: GatewayServer, caplog: pytest.LogCaptureFixture,
) -> None:
    """Catches: with the Redis of the retry budget killed, a transient failure that is not
    retried (the budget's ConnectionError escaped ``RetryPolicy.decide`` and, again,
    ``FailurePath.settle_request``), the DLQ class ``unknown``, the attempt row left
    ``started`` and the request ``running``. The stated fallback: the decision retries without
    spending (the attempt is not budgeted; attempts and the time budget still bound it) and
    says why."""
    budget_redis = RedisServer(tmp_path / "budget", port=free_port()).start()
    assert budget_redis.process is not None
    budget_redis.process.send_signal(signal.SIGKILL)  # a real death, not a clean shutdown
    budget_redis.process.wait(10)
    requests = RequestStore(db)
    payload = {"order_id": "o-budget-down", "amount_cents": 900, "currency": "EUR"}
    request = requests.enqueue("charge_payment", "payment:o-budget-down", payload, queue="heavy")
    resources = dagster_resources(
        db_url=db_url, redis_url=redis_url, namespace=namespace, gateway_url=failing_gateway.url,
        retry={"max_attempts": 3, "base_delay": 0.01, "max_delay": 0.02,
               "redis_url": budget_redis.url},
    )
    (tmp_path / "dagster").mkdir()
    caplog.set_level(logging.WARNING, logger="resources.retry.policy")
    with dg.DagsterInstance.local_temp(str(tmp_path / "dagster")) as instance:
        result = ops.charge_payment_job.execute_in_process(
            run_config=request_run_config("charge_payment", payload, request_id=request.id),
            resources=resources, instance=instance, raise_on_error=False,
        )
    assert not result.success
    assert len(waits(result)) == 2, "retried without spending, until attempts ran out"
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    meta = failure.step_failure_data.user_failure_data.metadata  # type: ignore[union-attr]
    assert meta["error_class"].value == "transient"
    assert meta["reason"].value == "attempts exhausted"
    said = [r.getMessage() for r in caplog.records if r.name == "resources.retry.policy"]
    assert len(said) == 2 and all(BUDGET_UNAVAILABLE in m for m in said), said
    rows = AttemptRecorder(db).for_key("payment:o-budget-down")
    assert [r["outcome"] for r in rows] == ["retried", "retried", "dead_lettered"]
    assert {r["error_kind"] for r in rows} == {"transient"}
    stored = requests.get(request.id)
    assert stored is not None and stored.status is RequestStatus.FAILED
    assert stored.error_class == "transient"
