"""Flow control wired into the job platform: concurrency slots around the side effects of the
job types, and the downstream clients at their shared rate, through ``execute_request`` with a
real app database, the real Redis and the sandbox HTTP gateway.

Each test's docstring names the regression it would catch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import text

from engine.attempts import AttemptRecorder
from engine.downstreams import Paced, paced
from engine.runtime import execute_request
from engine.services import Services
from pipelines.domain.inventory import Inventory
from pipelines.domain.mail import SmtpMailer
from pipelines.domain.payments import GATEWAY, GatewayUnavailable, HttpPaymentGateway
from resources.dagster_resources import ConcurrencyResource, RateLimitResource
from resources.flow import ConcurrencyLimits, LimitNotAcquired, RateLimited, RateLimits
from resources.idempotency import IdempotencyStore
from resources.retry import RetryBudget, RetryPolicy
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from resources.storage.settings import Settings
from sandbox.gateway import GatewayServer

CART = {"cart_id": "c-1", "items": [{"sku": "apple", "quantity": 2}]}


@pytest.fixture
def db(sqlite_url: str) -> Iterator[Database]:
    database = Database.from_url(sqlite_url)
    upgrade(database)
    yield database
    database.dispose()


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[GatewayServer]:
    server = GatewayServer(f"sqlite:///{tmp_path / 'gateway.db'}").start()
    yield server
    server.stop()


def services_with_limits(
    db: Database, client: redis.Redis, namespace: str, *, wait: float, **extra: Any
) -> Services:
    return Services(
        db=db,
        store=IdempotencyStore(db),
        attempts=AttemptRecorder(db),
        concurrency=ConcurrencyLimits(client, wait=wait, prefix=f"{namespace}:limit:"),
        **extra,
    )


def test_a_full_cart_slot_defers_the_reservation_and_spends_no_retry_budget(
    db: Database, redis_client: redis.Redis, namespace: str
) -> None:
    """While another worker holds the only slot of cart:c-1 the reservation is not made: the
    attempt fails with LimitNotAcquired (transient, key released), the retry decision spends
    no budget, and once the slot is free the job completes. Catches a handler that runs its
    side effect without the slot, and contention that drains the downstream's retry budget."""
    Inventory(db).set_stock("apple", 10)
    budget = RetryBudget(redis_client, capacity=5, namespace=namespace)
    services = services_with_limits(db, redis_client, namespace, wait=0.3)
    assert services.concurrency is not None
    other = services.concurrency.limiter("reserve_inventory", 1).acquire("cart:c-1")
    with pytest.raises(LimitNotAcquired) as info:
        execute_request("reserve_inventory", CART, services=services)
    with db.statement() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM reservations")).scalar() == 0
    decision = RetryPolicy().decide(
        info.value, attempt=0, elapsed=1.0, budget=budget, downstream="payment_gateway"
    )
    assert decision.retry and budget.level("payment_gateway") == 5
    other.release()
    outcome = execute_request("reserve_inventory", CART, services=services)
    assert outcome.status == "completed"
    attempts = AttemptRecorder(db).for_key("inventory-reserve:c-1")
    assert [a["outcome"] for a in attempts] == ["retried", "completed"]
    assert "concurrency_wait" in attempts[-1]["durations"]


def test_a_charge_holds_its_order_slot_while_the_gateway_works(
    db: Database, redis_client: redis.Redis, namespace: str, gateway: GatewayServer
) -> None:
    """The gateway takes 0.6 s per request; during the charge the order's slot is held, and
    it is free again after. Catches the slot taken and dropped before the call, or kept."""
    gateway.set_faults(latency_ms=600)
    services = services_with_limits(
        db, redis_client, namespace, wait=5,
        clients={"payment_gateway": HttpPaymentGateway(gateway.url)},
    )
    assert services.concurrency is not None
    limiter = services.concurrency.limiter("charge_payment", 1)
    seen: list[int] = []
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.append(execute_request(
        "charge_payment", {"order_id": "o-1", "amount_cents": 500}, services=services)))
    worker.start()
    while worker.is_alive():
        seen.append(limiter.holders("order:o-1"))
        time.sleep(0.02)
    worker.join()
    assert result[0].status == "completed" and len(gateway.charges()) == 1
    assert max(seen) == 1 and limiter.holders("order:o-1") == 0


def test_the_gateway_takes_a_token_per_call_and_a_retry_after_slows_every_worker(
    redis_client: redis.Redis, namespace: str, gateway: GatewayServer
) -> None:
    """Burst 2, almost no refill: two calls reach the gateway, the third is refused here with
    retry_after. Then a 503 with Retry-After: 2 pauses the shared bucket for everyone.
    Catches a client that bypasses the bucket, and a Retry-After that only delays one job."""
    limits = RateLimits(
        redis_client, {GATEWAY.name: "1/h,burst=2,wait=0"}, prefix=f"{namespace}:rate:"
    )
    client = paced(GATEWAY, HttpPaymentGateway(gateway.url), limits)
    for order in ("o-1", "o-2"):
        client.charge(reference=order, amount_cents=100, currency="EUR", idempotency_key=order)
    with pytest.raises(RateLimited) as refused:
        client.find_charges("o-1")
    assert refused.value.retry_after > 60
    assert len(gateway.charges()) == 2

    limiter = limits.limiter(GATEWAY.name)
    assert limiter is not None
    limiter.reset()
    gateway.set_faults(error_rate=1.0, retry_after_s=2)
    with pytest.raises(GatewayUnavailable):
        client.charge(reference="o-3", amount_cents=100, currency="EUR", idempotency_key="o-3")
    assert limiter.state().throttled_for > 1.5
    other_worker = paced(GATEWAY, HttpPaymentGateway(gateway.url), limits)
    with pytest.raises(RateLimited):
        other_worker.find_charges("o-3")


def test_services_from_settings_pace_only_the_downstreams_with_a_rate(sqlite_url: str) -> None:
    """Catches a rate in settings that never reaches the client (or one applied to all)."""
    base: dict[str, Any] = {
        "database_url": sqlite_url, "redis_url": "redis://127.0.0.1:1/0",
        "dagster_home": Path("/nonexistent"), "gateway_url": "http://127.0.0.1:9",
        "smtp_host": "127.0.0.1", "smtp_port": 9,
    }
    paced_services = Services.from_settings(Settings(**base, rates={GATEWAY.name: "50/s"}))
    assert isinstance(paced_services.client(GATEWAY.name), Paced)
    assert isinstance(paced_services.client("smtp"), SmtpMailer)
    plain = Services.from_settings(Settings(**base), lease_seconds=5)
    assert isinstance(plain.client(GATEWAY.name), HttpPaymentGateway)
    assert plain.concurrency is not None and plain.concurrency.lease == 5


def test_resources_read_settings_late_and_connect_on_first_use(
    redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches a resource that dials Redis or reads the environment when it is built."""
    monkeypatch.setenv("REDIS_URL", "redis://127.0.0.1:1/0")  # nothing listens: never dialled
    monkeypatch.setenv("SEKALI_RATE_SMTP", "5/s")
    limits = ConcurrencyResource(wait_seconds=0).get_limits()
    assert limits.limiter("job", 2).limit == 2
    rates = RateLimitResource(rates={"gateway": "7/s,burst=2"}).get_limits()
    assert rates.settings["smtp"].rate == 5.0 and rates.settings["gateway"].burst == 2
    assert Settings.from_env().rates == {"smtp": "5/s"}
    live = ConcurrencyResource(redis_url=redis_url, prefix=f"{namespace}:limit:").get_limits()
    with live.hold("job", "k", 1) as slot:
        assert slot.fence > 0
