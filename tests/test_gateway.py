"""The sandbox payment gateway and its HTTP client, over real HTTP and real databases.

The gateway is the instrument that counts charges for every other test, so these tests check
that it counts right: one charge per key under concurrent duplicates (threads and processes, on
SQLite and Postgres), a charge per POST when key support is off (the harder case exists), and
that its faults fail the way a real provider does, especially "charged, then no answer".
"""

from __future__ import annotations

import email.utils
import http.server
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import urllib3

from pipelines.domain.payments import (
    Charge,
    GatewayRejected,
    GatewayUnavailable,
    HttpPaymentGateway,
    PaymentGateway,
)
from pipelines.profile import DownstreamResource
from resources.retry import ErrorClass, classify
from sandbox.gateway import GatewayServer
from sandbox.redis_server import free_port


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[GatewayServer]:
    server = GatewayServer(f"sqlite:///{tmp_path / 'gateway.db'}", seed=7).start()
    try:
        yield server
    finally:
        server.stop()


def _charge_many(base_url: str, key: str | None, reference: str, n: int) -> list[str]:
    """Worker (threads inside a spawned process): n concurrent charges; returns charge ids."""
    client = HttpPaymentGateway(base_url, timeout=30)

    def one(_: int) -> str:
        return client.charge(
            reference=reference, amount_cents=500, currency="EUR", idempotency_key=key
        ).charge_id

    with ThreadPoolExecutor(max_workers=n) as pool:
        return list(pool.map(one, range(n)))


def test_concurrent_duplicates_with_one_key_charge_once(db_url: str) -> None:
    """Regression: a check-then-insert gateway charges twice when duplicates race.

    16 threads here and 2 spawned processes x 8 threads send the same key at once; the unique
    index must leave exactly one charge, and every caller must get that same charge back.
    """
    server = GatewayServer(db_url).start()
    try:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(2) as procs:
            remote = procs.starmap_async(
                _charge_many, [(server.url, "payment:o-1", "o-1", 8)] * 2
            )
            local = _charge_many(server.url, "payment:o-1", "o-1", 16)
            remote_ids = [cid for chunk in remote.get(timeout=120) for cid in chunk]
        charges = server.charges()
        assert len(charges) == 1, charges
        assert set(local + remote_ids) == {charges[0]["charge_id"]}
        assert len(local + remote_ids) == 32
    finally:
        server.stop()


def test_key_support_off_duplicates_charge_every_time(gateway: GatewayServer) -> None:
    """The harder case exists: without key support every duplicate is a new charge."""
    gateway.set_faults(honour_idempotency_key=False)
    ids = _charge_many(gateway.url, "payment:o-2", "o-2", 6)
    assert len(set(ids)) == 6
    assert len(gateway.charges()) == 6
    # and the client can also refuse to send the key, with the gateway's support on
    gateway.set_faults(honour_idempotency_key=True)
    client = HttpPaymentGateway(gateway.url, send_idempotency_key=False)
    for _ in range(2):
        client.charge(reference="o-3", amount_cents=1, currency="EUR", idempotency_key="k")
    assert len(client.find_charges("o-3")) == 2


def test_same_key_other_body_is_rejected_permanently(gateway: GatewayServer) -> None:
    client = HttpPaymentGateway(gateway.url)
    first = client.charge(reference="o-4", amount_cents=100, currency="EUR", idempotency_key="k4")
    again = client.charge(reference="o-4", amount_cents=100, currency="eur", idempotency_key="k4")
    assert again == first
    with pytest.raises(GatewayRejected) as info:
        client.charge(reference="o-4", amount_cents=999, currency="EUR", idempotency_key="k4")
    assert info.value.status == 422
    assert classify(info.value) is ErrorClass.PERMANENT
    assert len(gateway.charges()) == 1


def test_lookup_by_reference(gateway: GatewayServer) -> None:
    client: PaymentGateway = HttpPaymentGateway(gateway.url)
    a = client.charge(reference="ord/1 &x", amount_cents=10, currency="EUR", idempotency_key="a")
    client.charge(reference="other", amount_cents=20, currency="EUR", idempotency_key="b")
    c = client.charge(reference="ord/1 &x", amount_cents=30, currency="EUR", idempotency_key="c")
    found = client.find_charges("ord/1 &x")
    assert [ch.charge_id for ch in found] == [a.charge_id, c.charge_id]
    assert all(isinstance(ch, Charge) for ch in found)
    assert client.find_charges("nothing") == []


def test_bad_request_is_permanent(gateway: GatewayServer) -> None:
    client = HttpPaymentGateway(gateway.url)
    with pytest.raises(GatewayRejected) as info:
        client.charge(reference="o-5", amount_cents=-3, currency="EUR", idempotency_key="k5")
    assert info.value.status == 400 and "amount_cents" in info.value.detail
    assert gateway.charges() == []


def test_error_rate_fails_before_charging_and_is_changeable_at_run_time(
    gateway: GatewayServer,
) -> None:
    """503 comes before the charge (nothing recorded) and carries Retry-After; the admin
    endpoint changes faults on a running server."""
    http = urllib3.PoolManager()
    admin = {"Authorization": f"Bearer {gateway.admin_token}"}
    http.request("POST", gateway.url + "/_admin/faults",
                 json={"error_rate": 1.0, "retry_after_s": 3}, headers=admin)
    client = HttpPaymentGateway(gateway.url)
    with pytest.raises(GatewayUnavailable) as info:
        client.charge(reference="o-6", amount_cents=1, currency="EUR", idempotency_key="k6")
    assert info.value.status == 503 and info.value.retry_after == 3.0
    assert not info.value.maybe_charged
    assert classify(info.value) is ErrorClass.TRANSIENT
    assert gateway.charges() == []

    http.request("POST", gateway.url + "/_admin/faults", json={"error_rate": 0.5, "seed": 1},
                 headers=admin)
    ok = 0
    for i in range(40):
        try:
            client.charge(reference=f"r{i}", amount_cents=1, currency="EUR", idempotency_key=f"{i}")
            ok += 1
        except GatewayUnavailable:
            pass
    assert 5 < ok < 35  # seeded: some of each
    assert len(gateway.charges()) == ok
    listed = http.request("GET", gateway.url + "/_admin/charges", headers=admin).json()["charges"]
    assert len(listed) == ok
    http.request("POST", gateway.url + "/_admin/reset", headers=admin)
    assert gateway.charges() == []


def test_drop_after_charge_client_sees_failure_but_charge_exists(gateway: GatewayServer) -> None:
    """The dangerous fault: the charge commits, the answer is lost. Retrying with the same key
    returns that charge (no second one); without key support, lookup by reference finds it."""
    gateway.set_faults(drop_after_charge_rate=1.0)
    client = HttpPaymentGateway(gateway.url, timeout=10)
    with pytest.raises(GatewayUnavailable) as info:
        client.charge(reference="o-7", amount_cents=700, currency="EUR", idempotency_key="k7")
    assert info.value.maybe_charged
    assert classify(info.value) is ErrorClass.TRANSIENT
    assert len(gateway.charges()) == 1
    gateway.set_faults(drop_after_charge_rate=0.0)
    retried = client.charge(reference="o-7", amount_cents=700, currency="EUR",
                            idempotency_key="k7")
    assert [c["charge_id"] for c in gateway.charges()] == [retried.charge_id]

    gateway.set_faults(drop_after_charge_rate=1.0, honour_idempotency_key=False)
    with pytest.raises(GatewayUnavailable):
        client.charge(reference="o-8", amount_cents=800, currency="EUR", idempotency_key="k8")
    assert len(client.find_charges("o-8")) == 1


def test_latency_beyond_client_timeout_still_charges(gateway: GatewayServer) -> None:
    gateway.set_faults(latency_ms=1500)
    client = HttpPaymentGateway(gateway.url, timeout=0.3)
    with pytest.raises(GatewayUnavailable) as info:
        client.charge(reference="o-9", amount_cents=9, currency="EUR", idempotency_key="k9")
    assert info.value.maybe_charged
    deadline = time.monotonic() + 30
    while not gateway.charges() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(gateway.charges()) == 1


def test_unreachable_gateway_is_transient_and_not_maybe_charged() -> None:
    client = HttpPaymentGateway(f"http://127.0.0.1:{free_port()}", timeout=2)
    with pytest.raises(GatewayUnavailable) as info:
        client.find_charges("x")
    assert not info.value.maybe_charged
    assert classify(info.value) is ErrorClass.TRANSIENT


def test_resource_defaults_to_settings(monkeypatch: pytest.MonkeyPatch,
                                       gateway: GatewayServer) -> None:
    monkeypatch.setenv("SEKALI_GATEWAY_URL", gateway.url)
    client = DownstreamResource(downstream="payment_gateway").get_client()
    assert client.base_url == gateway.url
    client.charge(reference="o-10", amount_cents=1, currency="EUR", idempotency_key="k10")
    assert len(gateway.charges()) == 1


def test_cli_process_serves_and_dies_on_sigterm(tmp_path: Path) -> None:
    """``python -m sandbox.gateway`` is a real separate process; its charges survive it."""
    port = free_port()
    db_url = f"sqlite:///{tmp_path / 'cli.db'}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandbox.gateway", "--port", str(port), "--db-url", db_url],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ},
    )
    try:
        client = HttpPaymentGateway(f"http://127.0.0.1:{port}", timeout=5)
        deadline = time.monotonic() + 60
        while True:
            try:
                client.find_charges("warmup")
                break
            except GatewayUnavailable:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.2)
        charge = client.charge(reference="cli", amount_cents=5, currency="EUR",
                               idempotency_key="cli-1")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        assert proc.stdout is not None
        proc.stdout.close()
    with GatewayServer(db_url) as reopened:
        assert [c["charge_id"] for c in reopened.charges()] == [charge.charge_id]


def test_server_threads_survive_many_keys(gateway: GatewayServer) -> None:
    """Distinct keys from many threads: one charge each (no lost or merged charges)."""
    client = HttpPaymentGateway(gateway.url, timeout=30)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for j in range(5):
                client.charge(reference=f"m{i}", amount_cents=1, currency="EUR",
                              idempotency_key=f"m{i}:{j}")
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert len(gateway.charges()) == 60


class _BusyWithDate(http.server.BaseHTTPRequestHandler):
    """Answers every request 429 with ``Retry-After`` as an HTTP date ten minutes ahead (the form
    RFC 9110 allows besides delta seconds)."""

    protocol_version = "HTTP/1.1"

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = b'{"error": "busy"}'
        self.send_response(429)
        self.send_header("Retry-After", email.utils.formatdate(time.time() + 600, usegmt=True))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = _answer  # noqa: N815 - http.server naming
    do_POST = _answer  # noqa: N815

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_a_retry_after_given_as_an_http_date_is_honoured() -> None:
    """Catches the payment client reading ``Retry-After`` as delta seconds only (an HTTP date
    fell back to our own backoff, so a provider asking for ten minutes was called again at once):
    the wait it asks for is carried on the error, on a charge and on a lookup."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _BusyWithDate)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = HttpPaymentGateway(f"http://127.0.0.1:{server.server_address[1]}", timeout=5)
    try:
        with pytest.raises(GatewayUnavailable) as charged:
            client.charge(reference="busy", amount_cents=1, currency="EUR",
                          idempotency_key="k-busy")
        with pytest.raises(GatewayUnavailable) as looked_up:
            client.find_charges("busy")
    finally:
        client.close()
        server.shutdown()
        server.server_close()
    for error in (charged.value, looked_up.value):
        assert error.status == 429 and not error.maybe_charged
        assert error.retry_after is not None and 300 <= error.retry_after <= 601, error.retry_after
