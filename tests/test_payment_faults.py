"""A payment provider that ignores idempotency keys, answers late, or drips its answer.

Each test runs the real job code path against the real sandbox gateway over HTTP and counts
charges in the gateway's own ledger, never in what the job reports:

- a worker frozen (SIGSTOP, a real process) right before its charge, past its lease, wakes
  after another worker took the key over and charged: it must not charge again;
- a provider slower than the client's timeout still commits the first charge: a retry before
  the settle window must not charge again, and after it the lookup finds the charge;
- a provider that drips its answer a byte at a time cannot hold a call past its deadline;
- reconciliation resolves an unanswered charge after the window: found -> paid, not found ->
  reopened so the job charges once.

With key support on, the same scenarios give one charge too.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from sqlalchemy import text

from engine.attempts import AttemptRecorder
from engine.runtime import execute_request
from engine.services import Services
from engine.upkeep.reconciliation import Reconciler
from pipelines import ops
from pipelines.domain.payments import GatewayUnavailable, HttpPaymentGateway
from pipelines.jobs.payment import PaymentNotSettled, reference_for
from pipelines.profile import DownstreamResource
from resources.dlq import DlqStore
from resources.errors import SendDeadlinePassed
from resources.idempotency import IdempotencyStore, Status
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from resources.storage.settings import Settings
from sandbox.gateway import GatewayServer
from tests.job_workers import dagster_resources, request_loop

WORKER = Path(__file__).resolve().parent / "job_workers.py"
LEASE = 1.5
KEYS = pytest.mark.parametrize("keys", [False, True], ids=["keys-ignored", "keys-honoured"])


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[GatewayServer]:
    with GatewayServer(f"sqlite:///{tmp_path / 'gateway.db'}") as server:
        yield server


def services_for(
    db_url: str, redis_url: str, namespace: str, gateway: GatewayServer, *, keys: bool,
    timeout: float = 5.0, settle: float = 1.0,
) -> Services:
    settings = Settings(
        database_url=db_url, redis_url=redis_url, dagster_home=Path("/nonexistent"),
        gateway_url=gateway.url, smtp_host="127.0.0.1", smtp_port=9,
        gateway_settle_seconds=settle,
    )
    services = Services.from_settings(
        settings, lease_seconds=LEASE, budget_namespace=namespace, cache_namespace=namespace,
    )
    services.clients["payment_gateway"] = HttpPaymentGateway(
        gateway.url, timeout=timeout, deadline=timeout * 2, send_idempotency_key=keys
    )
    return services


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@KEYS
def test_worker_frozen_before_the_charge_past_its_lease_never_charges_again(
    db: Database, db_url: str, redis_url: str, namespace: str, redis_client: Any,
    gateway: GatewayServer, keys: bool,
) -> None:
    """Regression caught: a worker that claimed payment:K froze (SIGSTOP) just before the
    charge, past its lease; a second worker took over, found nothing by reference, charged and
    completed; the first resumed and charged again (2 charges in 9 of 10 tries with keys
    ignored). The job writes the send down and confirms its lease in the store right before the
    charge, so the resumed holder is refused there. Five tries side by side (two with keys on)."""
    gateway.set_faults(honour_idempotency_key=keys)
    tries = 2 if keys else 5
    orders = [f"o-frozen-{i}" for i in range(tries)]
    args = {"job_type": "charge_payment", "db_url": db_url, "redis_url": redis_url,
            "namespace": namespace, "gateway_url": gateway.url, "lease_seconds": LEASE,
            "send_idempotency_key": keys}
    payloads = [{"order_id": o, "amount_cents": 700, "currency": "EUR"} for o in orders]
    frozen = [
        subprocess.Popen(
            [sys.executable, str(WORKER), json.dumps({**args, "payloads": [p]})],
            env={**os.environ, "SEKALI_STOP_AT": "before_charge"},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for p in payloads
    ]
    try:
        deadline = time.monotonic() + 120
        for proc in frozen:
            while _state(proc.pid) != "T":
                assert proc.poll() is None, proc.communicate()[1][-2000:]
                assert time.monotonic() < deadline
                time.sleep(0.05)
        store = IdempotencyStore(db)
        for order in orders:
            record = store.get(f"payment:{order}")
            assert record is not None and record.status is Status.IN_PROGRESS
            assert record.lease_expires_at is not None
            time.sleep(max(0.0, record.lease_expires_at - time.time()) + 0.2)
        takeover = request_loop({**args, "payloads": payloads})
        assert [r["status"] for r in takeover] == ["completed"] * tries, takeover
        for proc in frozen:
            proc.send_signal(signal.SIGCONT)
        resumed = []
        for proc in frozen:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-2000:]
            resumed.extend(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in frozen:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    counts = {o: len(gateway.ledger.by_reference(reference_for(f"payment:{o}"))) for o in orders}
    assert counts == dict.fromkeys(orders, 1), counts
    assert [r["status"] for r in resumed] == ["LeaseLost"] * tries, resumed
    with db.statement() as conn:
        paid = conn.execute(
            text("SELECT COUNT(*) FROM orders WHERE payment_status = 'paid' AND payment_fence = 2")
        ).scalar()
    assert paid == tries


def test_worker_frozen_inside_the_charge_call_past_its_lease_does_not_send(
    db: Database, db_url: str, redis_url: str, namespace: str, redis_client: Any,
    gateway: GatewayServer,
) -> None:
    """Regression caught: with keys ignored, a worker that had written its send down and
    confirmed its lease froze (SIGSTOP) inside the charge call, before the request left; a
    second worker took over, waited out the settle window, found nothing by reference, charged
    and completed; the first resumed and POSTed: two charges. The send now carries a bound
    (monotonic, half the lease after the last confirmation) checked right before the request
    is written: the resumed holder finds it passed, sends nothing, re-confirms its lease and
    stops with LeaseLost. Three frozen workers side by side."""
    gateway.set_faults(honour_idempotency_key=False)
    orders = [f"o-frozen-send-{i}" for i in range(3)]
    args = {"job_type": "charge_payment", "db_url": db_url, "redis_url": redis_url,
            "namespace": namespace, "gateway_url": gateway.url, "lease_seconds": LEASE,
            "send_idempotency_key": False, "settle_seconds": 1.0}
    payloads = [{"order_id": o, "amount_cents": 900, "currency": "EUR"} for o in orders]
    frozen = [
        subprocess.Popen(
            [sys.executable, str(WORKER),
             json.dumps({**args, "payloads": [p], "stop_in_charge": True})],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for p in payloads
    ]
    try:
        deadline = time.monotonic() + 120
        for proc in frozen:
            while _state(proc.pid) != "T":
                assert proc.poll() is None, proc.communicate()[1][-2000:]
                assert time.monotonic() < deadline
                time.sleep(0.05)
        store = IdempotencyStore(db)
        for order in orders:
            record = store.get(f"payment:{order}")
            assert record is not None and record.status is Status.IN_PROGRESS
            assert record.lease_expires_at is not None
            with db.statement() as conn:
                sent_at = conn.execute(
                    text("SELECT charge_sent_at FROM orders WHERE order_id = :o"), {"o": order}
                ).scalar()
            assert sent_at is not None  # the send was written down before the freeze
            time.sleep(max(0.0, record.lease_expires_at - time.time(),
                           float(sent_at) + 1.0 - time.time()) + 0.2)
        takeover = request_loop({**args, "payloads": payloads})
        assert [r["status"] for r in takeover] == ["completed"] * 3, takeover
        for proc in frozen:
            proc.send_signal(signal.SIGCONT)
        resumed = []
        for proc in frozen:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-2000:]
            resumed.extend(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in frozen:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    counts = {o: len(gateway.ledger.by_reference(reference_for(f"payment:{o}"))) for o in orders}
    assert counts == dict.fromkeys(orders, 1), counts
    assert [r["status"] for r in resumed] == ["LeaseLost"] * 3, resumed
    for order in orders:
        record = store.get(f"payment:{order}")
        assert record is not None and record.status is Status.COMPLETED, record
    with db.statement() as conn:
        paid = conn.execute(
            text("SELECT COUNT(*) FROM orders WHERE payment_status = 'paid' AND payment_fence = 2"
                 " AND order_id LIKE 'o-frozen-send-%'")
        ).scalar()
    assert paid == 3


@KEYS
def test_slow_provider_charges_once_and_completes_after_the_settle_window(
    db: Database, db_url: str, redis_url: str, namespace: str, redis_client: Any,
    gateway: GatewayServer, keys: bool,
) -> None:
    """Regression caught: the provider took longer than the client's timeout and still charged;
    the retry looked the reference up, found nothing yet, and charged again (2 charges). After
    an unanswered charge no attempt charges before the settle window; a redelivery inside it
    raises PaymentNotSettled (transient), and the one after it finds the first charge."""
    gateway.set_faults(honour_idempotency_key=keys, charge_delay_ms=3000)
    settle = 0.4 * LEASE + 3.0 + 0.9  # what docs/job-types.md asks, with a margin
    # a read timeout the lookup after the window meets on a loaded machine (0.3 s did not)
    services = services_for(db_url, redis_url, namespace, gateway, keys=keys, timeout=1.0,
                            settle=settle)
    payload = {"order_id": "o-slow", "amount_cents": 900, "currency": "EUR"}
    for _ in range(2):  # the first attempt and a redelivery right behind it
        with pytest.raises(PaymentNotSettled) as early:
            execute_request("charge_payment", payload, services=services)
    with db.statement() as conn:
        sent_at = conn.execute(
            text("SELECT charge_sent_at FROM orders WHERE order_id = 'o-slow'")
        ).scalar()
    assert sent_at is not None and early.value.settles_at == pytest.approx(sent_at + settle)
    assert early.value.retry_after is not None and early.value.retry_after > 0
    time.sleep(max(0.0, sent_at + settle - time.time()))

    outcome = execute_request("charge_payment", payload, services=services)

    assert outcome.status == "completed"
    charges = gateway.ledger.by_reference(reference_for("payment:o-slow"))
    assert len(charges) == 1
    assert outcome.result["charge_id"] == charges[0]["charge_id"]
    rows = AttemptRecorder(db).for_key("payment:o-slow")
    assert [r["outcome"] for r in rows] == ["retried", "retried", "completed"]
    assert [r["error_class"] for r in rows[:2]] == ["PaymentNotSettled"] * 2
    assert "gateway_charge" not in rows[1]["durations"]  # the redelivery sent nothing
    assert rows[2]["started_at"] >= sent_at + settle
    assert "gateway_lookup" in rows[2]["durations"]
    assert "gateway_charge" not in rows[2]["durations"]


def test_a_pause_between_writing_the_send_down_and_confirming_cannot_outlast_the_window(
    db: Database, db_url: str, redis_url: str, namespace: str, redis_client: Any,
    gateway: GatewayServer, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression caught (the model's ``finding_settle_window``): the send bound was counted
    from the lease confirmation, which may come long after ``charge_sent_at`` (a pause between
    the two, the keeper still beating). The charge left 2.5 s after ``charge_sent_at``, the
    slow provider committed it 0.8 s later, and the retry's lookup at ``charge_sent_at`` plus
    a settle window of 0.4 lease + the provider's time found nothing and charged again: two
    charges. The bound is now capped at ``sent_at + 0.4 x lease``: the paused try sends
    nothing, writes the send down again, and the lookup after the window is conclusive."""
    from engine.context import JobContext

    gateway.set_faults(honour_idempotency_key=False, charge_delay_ms=800)
    settle = 0.4 * LEASE + 0.8 + 0.6  # what docs/job-types.md asks, with a margin
    services = services_for(db_url, redis_url, namespace, gateway, keys=False, timeout=0.3,
                            settle=settle)
    confirm = JobContext.confirm_lease
    paused: list[float] = []

    def paused_once(self: JobContext) -> float:
        if not paused:  # the first send was just written down: the process stalls here
            paused.append(time.time())
            time.sleep(2.5)
        return confirm(self)

    monkeypatch.setattr(JobContext, "confirm_lease", paused_once)
    payload = {"order_id": "o-paused-send", "amount_cents": 800, "currency": "EUR"}
    statuses = []
    for _ in range(6):
        try:
            statuses.append(execute_request("charge_payment", payload, services=services).status)
            break
        except PaymentNotSettled as exc:
            statuses.append("not settled")
            time.sleep(max(0.0, exc.settles_at - time.time()))
        except SendDeadlinePassed:
            statuses.append("bound passed")
    time.sleep(1.5)  # a charge still in the provider's hands has committed by now
    charges = gateway.ledger.by_reference(reference_for("payment:o-paused-send"))
    assert paused and statuses[-1] == "completed", statuses
    assert len(charges) == 1, (statuses, charges)


@pytest.mark.dagster
def test_the_dagster_retry_after_an_unanswered_charge_waits_out_the_window(
    sqlite_url: str, redis_url: str, namespace: str, redis_client: Any, gateway: GatewayServer,
) -> None:
    """Regression caught: the step's retry after an unanswered charge came after the usual
    short backoff, looked up too early and charged again. PaymentNotSettled carries the time
    left as ``retry_after``, so Dagster's retry waits it out and the run succeeds, once."""
    db = Database.from_url(sqlite_url)
    upgrade(db)
    gateway.set_faults(honour_idempotency_key=False, charge_delay_ms=1200)
    resources = dagster_resources(
        db_url=sqlite_url, redis_url=redis_url, namespace=namespace, gateway_url=gateway.url,
        lease_seconds=5, send_idempotency_key=False,
    )
    resources["payment_gateway"] = DownstreamResource(
        downstream="payment_gateway", address=gateway.url, timeout=0.3, deadline=0.6,
        extra={"send_idempotency_key": False}, settle_seconds=2.5,
    )
    with dg.DagsterInstance.ephemeral() as instance:
        result = ops.charge_payment_job.execute_in_process(
            run_config={"ops": {"charge_payment_op": {"config": {"payload": {
                "order_id": "o-retry", "amount_cents": 300}}}}},
            resources=resources, instance=instance, raise_on_error=False,
        )
    assert result.success
    assert len(gateway.charges()) == 1
    rows = AttemptRecorder(db).for_key("payment:o-retry")
    assert [(r["outcome"], r["error_class"]) for r in rows] == [
        ("retried", "PaymentNotSettled"), ("completed", None)]
    with db.statement() as conn:
        sent_at = conn.execute(text("SELECT charge_sent_at FROM orders")).scalar()
    assert rows[1]["started_at"] >= sent_at + 2.5
    db.dispose()


def test_the_client_sends_nothing_once_the_send_bound_passed(gateway: GatewayServer) -> None:
    """The bound is checked before a byte leaves: a charge whose ``send_by`` has passed raises
    SendDeadlinePassed (transient, nothing sent) and the gateway records no charge; one within
    its bound charges."""
    gateway.set_faults(honour_idempotency_key=False)
    client = HttpPaymentGateway(gateway.url, timeout=1.0, deadline=2.0)
    with pytest.raises(SendDeadlinePassed) as late:
        client.charge(reference="ref-late", amount_cents=100, currency="EUR",
                      idempotency_key="k-late", send_by=time.monotonic() - 0.5)
    assert late.value.late_by >= 0.5 and "not sent" in str(late.value)
    assert gateway.ledger.by_reference("ref-late") == []
    client.charge(reference="ref-late", amount_cents=100, currency="EUR",
                  idempotency_key="k-late", send_by=time.monotonic() + 30)
    assert len(gateway.ledger.by_reference("ref-late")) == 1


def test_a_pause_after_the_bound_check_and_before_the_write_sends_nothing(
    gateway: GatewayServer, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Catches the window the guide example's chaos run struck (a duplicate credit): the bound
    was checked once, before urllib3 was handed the request, so a process paused after that
    check (here, right after the new connection is up; in the chaos run, a sibling thread's
    SIGSTOP) wrote the whole request once it resumed, past its bound, while a takeover had
    already looked up, found nothing and sent its own. Every write of the request is checked
    against the bound: a pause past it sends nothing and raises SendDeadlinePassed, and the
    gateway records no charge."""
    import urllib3.connection

    gateway.set_faults(honour_idempotency_key=False)
    client = HttpPaymentGateway(gateway.url, timeout=2.0, deadline=4.0)
    connect = urllib3.connection.HTTPConnection.connect
    bound = time.monotonic() + 0.5

    def paused_after_connect(self: Any) -> None:
        connect(self)
        time.sleep(max(0.0, bound - time.monotonic()) + 0.2)  # frozen: the bound passes

    monkeypatch.setattr(urllib3.connection.HTTPConnection, "connect", paused_after_connect)
    try:
        with pytest.raises(SendDeadlinePassed):
            client.charge(reference="ref-paused", amount_cents=100, currency="EUR",
                          idempotency_key="k-paused", send_by=bound)
        monkeypatch.undo()
        time.sleep(0.5)  # a request written late would be in the gateway's ledger by now
        assert gateway.ledger.by_reference("ref-paused") == []
        client.charge(reference="ref-paused", amount_cents=100, currency="EUR",
                      idempotency_key="k-paused", send_by=time.monotonic() + 30)
        assert len(gateway.ledger.by_reference("ref-paused")) == 1
    finally:
        client.close()


class _LateOnce:
    """The real client, handed a send bound already passed on its first charge: what a holder
    paused after its lease confirmation, but not taken over, sees when it resumes."""

    def __init__(self, inner: HttpPaymentGateway) -> None:
        self.inner = inner
        self.bounds: list[float] = []

    def charge(self, **kwargs: Any) -> Any:
        self.bounds.append(kwargs["send_by"])
        if len(self.bounds) == 1:
            kwargs["send_by"] = time.monotonic() - 0.1
        return self.inner.charge(**kwargs)

    def find_charges(self, reference: str) -> Any:
        return self.inner.find_charges(reference)


def test_a_holder_still_holding_after_a_passed_bound_confirms_and_charges_once(
    db: Database, db_url: str, redis_url: str, namespace: str, redis_client: Any,
    gateway: GatewayServer,
) -> None:
    """After SendDeadlinePassed the job writes the send down again, confirms its lease (still
    its own: nobody took over) and sends with a new bound, in the same attempt: one charge, the
    order paid, no unknown outcome left behind."""
    services = services_for(db_url, redis_url, namespace, gateway, keys=False)
    assert isinstance(services.client("payment_gateway"), HttpPaymentGateway)
    late = _LateOnce(services.client("payment_gateway"))
    services.clients["payment_gateway"] = late
    payload = {"order_id": "o-late-once", "amount_cents": 500, "currency": "EUR"}
    outcome = execute_request("charge_payment", payload, services=services)
    assert outcome.status == "completed"
    assert len(late.bounds) == 2 and late.bounds[1] > late.bounds[0]
    assert len(gateway.ledger.by_reference(reference_for("payment:o-late-once"))) == 1
    rows = AttemptRecorder(db).for_key("payment:o-late-once")
    assert [r["outcome"] for r in rows] == ["completed"]
    with db.statement() as conn:
        status = conn.execute(
            text("SELECT payment_status FROM orders WHERE order_id = 'o-late-once'")
        ).scalar()
    assert status == "paid"


def test_a_dripping_provider_is_cut_off_at_the_deadline(gateway: GatewayServer) -> None:
    """Regression caught: timeouts applied per read, so a provider writing one byte every half
    second (well within the read timeout) held a call for minutes. The client's deadline bounds
    the whole call: it ends with GatewayUnavailable (transient; a POST may have charged)."""
    client = HttpPaymentGateway(gateway.url, timeout=1.0, deadline=2.0)
    client.charge(reference="ref-drip", amount_cents=100, currency="EUR", idempotency_key="k1")
    gateway.set_faults(drip_ms=500)
    errors: dict[str, BaseException] = {}

    def call(name: str, fn: Any) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            errors[name] = exc

    calls = {
        "charge": lambda: client.charge(
            reference="ref-drip-2", amount_cents=100, currency="EUR", idempotency_key="k2"
        ),
        "lookup": lambda: client.find_charges("ref-drip"),
    }
    threads = [threading.Thread(target=call, args=item, daemon=True) for item in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=40)  # the answers take minutes at this pace
    assert not any(t.is_alive() for t in threads), "a dripping answer held the call"
    charge, lookup = errors.get("charge"), errors.get("lookup")
    assert isinstance(charge, GatewayUnavailable) and charge.maybe_charged, errors
    assert isinstance(lookup, GatewayUnavailable) and not lookup.maybe_charged, errors


@pytest.fixture
def blackhole() -> Iterator[str]:
    """A provider that takes the connection and the request, and never answers."""
    with socket.create_server(("127.0.0.1", 0), backlog=16) as server:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"


def test_reconciliation_resolves_an_unanswered_charge_only_after_the_window(
    db: Database, db_url: str, redis_url: str, namespace: str, redis_client: Any,
    gateway: GatewayServer, blackhole: str,
) -> None:
    """Regression caught: an unanswered charge nothing retries stays unresolved, or is resolved
    by a lookup before the provider could have committed it. A charge found makes the order
    paid; none found after the window reopens it (once), and the job then charges once."""
    services = services_for(db_url, redis_url, namespace, gateway, keys=False, timeout=0.3)
    real = services.client("payment_gateway")
    services.clients["payment_gateway"] = HttpPaymentGateway(
        blackhole, timeout=0.3, send_idempotency_key=False
    )
    with pytest.raises(PaymentNotSettled):  # the request went out, nothing was charged
        execute_request("charge_payment", {"order_id": "o-none", "amount_cents": 500},
                        services=services)
    services.clients["payment_gateway"] = real
    gateway.set_faults(charge_delay_ms=600)
    with pytest.raises(PaymentNotSettled):  # charged after the client gave up
        execute_request("charge_payment", {"order_id": "o-found", "amount_cents": 500},
                        services=services)
    while not gateway.charges():
        time.sleep(0.1)

    def reconciler(ahead: float) -> Reconciler:
        return Reconciler(db, store=IdempotencyStore(db), dlq=DlqStore(db),
                          clients={"payment_gateway": real},
                          grace_seconds=0, settle_seconds=120,
                          clock=lambda: time.time() + ahead)

    def statuses() -> dict[str, str]:
        with db.statement() as conn:
            return dict(conn.execute(text("SELECT order_id, payment_status FROM orders")).all())

    within = reconciler(0).run()
    assert within.fixed["charged_not_confirmed"] == 1  # found: paid at once
    assert statuses() == {"o-found": "paid", "o-none": "charged_not_confirmed"}
    after = reconciler(300).run()
    assert after.fixed["charged_not_confirmed"] == 1  # not found after the window: reopened
    assert reconciler(300).run().total_found == 0
    assert statuses() == {"o-found": "paid", "o-none": "payment_pending"}
    gateway.set_faults(charge_delay_ms=0)
    for _ in range(2):
        execute_request("charge_payment", {"order_id": "o-none", "amount_cents": 500},
                        services=services)
    assert len(gateway.ledger.by_reference(reference_for("payment:o-none"))) == 1
