"""Many threads and several processes racing on the same intents: one effect per intent.

Every racer calls :func:`engine.runtime.execute_request` (the code path of every op) with its
own ``Services``; spawned processes build theirs from settings, as a separate run worker would.
They all wait for one "go" file so the race is real, not sequential.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from engine.attempts import AttemptRecorder
from pipelines.domain.inventory import Inventory
from pipelines.jobs.payment import reference_for
from resources.storage.db import Database
from sandbox.gateway import GatewayServer
from tests.job_workers import request_loop

PROCESSES = 3
THREADS = 8


@pytest.fixture
def slow_keyless_gateway(tmp_path: Path) -> Iterator[GatewayServer]:
    """No key support and some latency: only sekali's claim can stop a double charge."""
    gateway = GatewayServer(
        f"sqlite:///{tmp_path / 'gateway.db'}", honour_idempotency_key=False, latency_ms=30
    ).start()
    try:
        yield gateway
    finally:
        gateway.stop()


def race(
    base: dict[str, Any], per_racer: list[list[dict[str, Any]]], folder: Path
) -> list[dict[str, Any]]:
    """Run ``per_racer[i]`` payload lists: the first PROCESSES in spawned processes, the rest in
    threads of this process; start them together; return every result."""
    folder.mkdir()
    ctx = multiprocessing.get_context("spawn")
    args = [{**base, "payloads": p, "ready_dir": str(folder)} for p in per_racer]
    results: list[dict[str, Any]] = []
    with ctx.Pool(PROCESSES) as pool, ThreadPoolExecutor(len(args) - PROCESSES) as threads:
        async_results = [pool.apply_async(request_loop, (a,)) for a in args[:PROCESSES]]
        futures = [threads.submit(request_loop, a) for a in args[PROCESSES:]]
        deadline = time.monotonic() + 120
        while len(list(folder.glob("ready-*"))) < len(args):
            assert time.monotonic() < deadline, "racers did not get ready"
            time.sleep(0.02)
        (folder / "go").touch()
        for r in async_results:
            results.extend(r.get(timeout=180))
        for f in futures:
            results.extend(f.result(timeout=180))
    return results


def test_racing_charges_of_one_order_charge_once(
    db: Database, db_url: str, redis_url: str, namespace: str, redis_client: Any,
    slow_keyless_gateway: GatewayServer, tmp_path: Path,
) -> None:
    """Regression caught: two workers both charging one order (no claim, a claim that is not
    atomic, or a completion that a concurrent worker can overtake)."""
    base = {"job_type": "charge_payment", "db_url": db_url, "redis_url": redis_url,
            "namespace": namespace, "gateway_url": slow_keyless_gateway.url,
            "send_idempotency_key": False}
    payload = {"order_id": "o-race", "amount_cents": 777}
    results = race(base, [[payload, payload]] * (PROCESSES + THREADS), tmp_path / "go1")

    charges = slow_keyless_gateway.ledger.by_reference(reference_for("payment:o-race"))
    assert len(charges) == 1
    statuses = [r["status"] for r in results]
    assert statuses.count("completed") == 1
    assert statuses.count("duplicate") == len(results) - 1
    assert {r["result"]["charge_id"] for r in results} == {charges[0]["charge_id"]}
    outcomes = [a["outcome"] for a in AttemptRecorder(db).for_key("payment:o-race")]
    assert outcomes.count("completed") == 1
    assert outcomes.count("duplicate_suppressed") == len(results) - 1


def test_racing_reservations_never_oversell_and_reserve_each_cart_once(
    db: Database, db_url: str, redis_url: str, namespace: str, redis_client: Any,
    tmp_path: Path,
) -> None:
    """Regression caught: oversell under concurrent carts, or one cart reserved twice when its
    request is delivered twice to different workers."""
    Inventory(db).set_stock("widget", 10)
    carts = [{"cart_id": f"c{i}", "items": [{"sku": "widget", "quantity": 1}]} for i in range(16)]
    racers = PROCESSES + THREADS
    # every cart is delivered twice, to two different racers
    per_racer: list[list[dict[str, Any]]] = [[] for _ in range(racers)]
    for i, cart in enumerate(carts):
        per_racer[i % racers].append(cart)
        per_racer[(i + 5) % racers].append(cart)
    base = {"job_type": "reserve_inventory", "db_url": db_url, "redis_url": redis_url,
            "namespace": namespace}
    results = race(base, per_racer, tmp_path / "go2")

    assert Inventory(db).stock("widget") == (10, 10)
    with db.statement() as conn:
        from sqlalchemy import text

        rows = conn.execute(text("SELECT cart_id, quantity FROM reservations")).all()
    assert len(rows) == 10 and {r.quantity for r in rows} == {1}
    assert len({r.cart_id for r in rows}) == 10
    statuses = [r["status"] for r in results]
    assert statuses.count("completed") == 10
    assert set(statuses) <= {"completed", "duplicate", "InsufficientStock", "StoredFailure"}


def test_a_step_longer_than_its_lease_keeps_it_by_heartbeating(
    db: Database, db_url: str, redis_url: str, namespace: str, redis_client: Any,
    tmp_path: Path,
) -> None:
    """Regression caught: a long step without heartbeats loses its lease mid-charge, so a
    redelivered request takes the key over and charges again. The gateway call here lasts
    2.5 leases; the duplicate arrives after 1.5 leases and must find the key still held."""
    lease = 1.5  # the gateway call (2.5 leases) stays under the client timeout (5 s)
    gateway = GatewayServer(
        f"sqlite:///{tmp_path / 'gw.db'}", honour_idempotency_key=False, latency_ms=lease * 2500
    ).start()
    try:
        base = {"job_type": "charge_payment", "db_url": db_url, "redis_url": redis_url,
                "namespace": namespace, "gateway_url": gateway.url, "lease_seconds": lease,
                "send_idempotency_key": False}
        payload = {"order_id": "o-long", "amount_cents": 10}
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(request_loop, {**base, "payloads": [payload]})
            time.sleep(lease * 1.5)
            second = pool.submit(request_loop, {**base, "payloads": [payload]})
            results = first.result(timeout=120) + second.result(timeout=120)
        charges = gateway.ledger.by_reference(reference_for("payment:o-long"))
    finally:
        gateway.stop()
    assert len(charges) == 1
    assert sorted(r["status"] for r in results) == ["completed", "duplicate"]
    rows = AttemptRecorder(db).for_key("payment:o-long")
    assert not any(r["takeover"] for r in rows)
    outcomes = [r["outcome"] for r in rows]
    assert outcomes.count("completed") == 1 and outcomes.count("duplicate_suppressed") == 1
    assert outcomes.count("in_progress_elsewhere") >= 1  # the duplicate found the lease alive
