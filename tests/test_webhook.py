"""``deliver_webhook`` against the sandbox receiver over real HTTP, on SQLite and Postgres.

Deliveries are counted at the receiver (its own count per ``webhook-id``), never in what the
job reports. Most tests run the receiver with ``dedupe=False`` (a customer that ignores
``webhook-id``), so a second send would show as a second effect: sekali's own guarantee is
measured, not the receiver's dedupe.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from engine.attempts import AttemptRecorder
from engine.failures import FailurePath
from engine.registry import get_job_type
from engine.runtime import execute_request
from engine.services import Services
from pipelines import ops
from pipelines.definitions import dlq_sensor
from pipelines.jobs.webhook import (
    WebhookClient,
    WebhookNotSettled,
    WebhookRejected,
    WebhookUnavailable,
    body_of,
    webhook_id_for,
)
from pipelines.profile import DownstreamResource
from resources.dagster_resources import DlqResource
from resources.dlq import DlqStore, FailureClass
from resources.errors import SendDeadlinePassed, ValidationError
from resources.http import BoundedHttp, HttpNoAnswer, retry_after
from resources.idempotency import IdempotencyStore, Status
from resources.retry import ErrorClass, RetryPolicy, classify
from resources.signatures import (
    SignatureInvalid,
    SigningKeyInvalid,
    secret_bytes,
    signed_headers,
    verify,
)
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from resources.storage.settings import Settings
from resources.webhook_secrets import derived_secret
from sandbox.webhooks import WebhookReceiver
from tests.job_workers import dagster_resources

WORKER = Path(__file__).resolve().parent / "job_workers.py"
SECRET = "whsec_" + "c2VrYWxpLXRlc3Qtd2ViaG9va3Mtc2lnbmluZy1rZXk="  # 32 bytes
KEY = secret_bytes(SECRET)
JOB = "deliver_webhook"


def endpoint_keys(endpoint_id: str) -> list[bytes]:
    """Each endpoint's default secret, derived from ``SECRET`` as the platform derives it."""
    return [secret_bytes(derived_secret(KEY, endpoint_id))]


@pytest.fixture(autouse=True)
def signing_key_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers built from settings (the Dagster runs) sign with ``SECRET``, from the
    environment (never resource config)."""
    monkeypatch.setenv("SEKALI_WEBHOOKS_SIGNING_KEY", SECRET)


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    """The sandbox receiver on a free port, ignoring ``webhook-id`` (no dedupe), verifying
    each endpoint's own secret."""
    with WebhookReceiver(endpoint_keys, dedupe=False) as server:
        yield server


def payload(receiver: WebhookReceiver, event: str = "evt-1", endpoint: str = "ep-1",
            **extra: Any) -> dict[str, Any]:
    return {"endpoint_id": endpoint, "url": receiver.endpoint(endpoint), "event_id": event,
            "event_type": "order.paid", "data": {"order_id": "o-1", "total": 1250}, **extra}


def client(key: bytes = KEY, timeout: float = 2.0, deadline: float = 4.0) -> WebhookClient:
    return WebhookClient(BoundedHttp(timeout=timeout, deadline=deadline),
                         lambda ep: [secret_bytes(derived_secret(key, ep))])


def services_for(db_url: str, redis_url: str, namespace: str, *, settle: float = 1.0,
                 webhooks: WebhookClient | None = None, lease: float = 30.0) -> Services:
    settings = Settings(
        database_url=db_url, redis_url=redis_url, dagster_home=Path("/nonexistent"),
        gateway_url="http://127.0.0.1:9", smtp_host="127.0.0.1", smtp_port=9,
        gateway_settle_seconds=settle,
    )
    services = Services.from_settings(settings, lease_seconds=lease, budget_namespace=namespace,
                                      cache_namespace=namespace)
    services.clients["webhooks"] = webhooks or client()
    return services


def outcomes(db: Database, key: str) -> list[tuple[str, str | None]]:
    return [(r["outcome"], r["error_class"]) for r in AttemptRecorder(db).for_key(key)]


# -- the generic helpers ---------------------------------------------------------------------


def test_signatures_match_the_standard_webhooks_vector_and_refuse_tampering() -> None:
    """Catches a signer that is not Standard Webhooks (any receiver library must verify
    sekali's messages), and a verifier that accepts a changed body, a stale timestamp or a
    wrong key."""
    key = secret_bytes("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    body = b'{"test": 2432232314}'
    headers = signed_headers(key, "msg_p5jXN8AQM9LWM0D4loKWxJek", body, 1614265330.4)
    assert headers["webhook-signature"] == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    assert verify(key, headers, body, 1614265330) == "msg_p5jXN8AQM9LWM0D4loKWxJek"
    rotated = {**headers, "webhook-signature": "v1,bm90LXRoaXMtb25l " + headers[
        "webhook-signature"]}
    assert verify(key, rotated, body, 1614265330)  # any one of several signatures
    with pytest.raises(SignatureInvalid, match="no v1 signature"):
        verify(key, headers, body + b" ", 1614265330)
    with pytest.raises(SignatureInvalid, match="tolerance"):
        verify(key, headers, body, 1614265330 + 301)
    with pytest.raises(SignatureInvalid, match="no v1 signature"):
        verify(KEY, headers, body, 1614265330)
    with pytest.raises(SignatureInvalid, match="webhook-signature"):
        verify(key, {"webhook-id": "m", "webhook-timestamp": "1"}, body, 1)
    with pytest.raises(SigningKeyInvalid) as short:
        secret_bytes("whsec_c2hvcnQ=", setting="SEKALI_WEBHOOKS_SIGNING_KEY")
    assert "SEKALI_WEBHOOKS_SIGNING_KEY" in str(short.value) and "c2hvcnQ" not in str(short.value)


class _Big(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        data = b"x" * 2_000_000
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_the_bounded_client_reads_at_most_max_body_and_parses_retry_after() -> None:
    """Catches a client that reads a hostile endpoint's whole answer into memory."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Big)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        http = BoundedHttp(timeout=2.0, deadline=5.0, max_body=1000)
        answer = http.request("GET", f"http://127.0.0.1:{server.server_address[1]}/")
        assert answer.status == 200 and answer.truncated and len(answer.body) == 1000
    finally:
        server.shutdown()
        server.server_close()
    assert retry_after("7", 0.0) == 7.0
    assert retry_after("Thu, 01 Jan 1970 00:01:40 GMT", 40.0) == 60.0
    assert retry_after("soon", 0.0) is None and retry_after(None, 0.0) is None


# -- the job, through the one execution path -------------------------------------------------


def test_a_webhook_is_delivered_once_signed_and_a_repeat_is_a_duplicate(
    db: Database, db_url: str, redis_url: str, namespace: str, redis_client: Any,
    receiver: WebhookReceiver,
) -> None:
    """The happy path: one signed POST that the receiver verifies (it refuses a bad signature),
    with the body and webhook-id derived from the intent; the same request again is answered
    from the ledger and sends nothing."""
    services = services_for(db_url, redis_url, namespace)
    p = payload(receiver)
    first = execute_request(JOB, p, services=services)
    assert first.status == "completed" and first.key == "webhook:ep-1:evt-1"
    webhook_id = webhook_id_for(first.key)
    assert first.result["webhook_id"] == webhook_id and first.result["status"] == 200
    again = execute_request(JOB, p, services=services)
    assert again.status == "duplicate"
    assert receiver.deliveries(webhook_id) == 1 and len(receiver.effects(webhook_id)) == 1
    assert receiver.rejected == 0
    [body] = receiver.bodies(webhook_id)
    assert body == body_of(get_job_type(JOB).validate(dict(p)))
    assert json.loads(body) == {"type": "order.paid", "id": "evt-1",
                                "data": {"order_id": "o-1", "total": 1250}}
    assert outcomes(db, first.key) == [("completed", None), ("duplicate_suppressed", None)]


def test_an_endpoint_without_a_url_is_reached_through_the_declared_address(
    db: Database, db_url: str, redis_url: str, namespace: str, redis_client: Any,
    receiver: WebhookReceiver,
) -> None:
    """No ``url`` in the payload: the message goes to ``<SEKALI_WEBHOOKS_URL>/hooks/<id>`` (the
    client's base address), and the lookup asks there too."""
    webhooks = WebhookClient(BoundedHttp(timeout=2.0, deadline=4.0), endpoint_keys,
                             base_url=receiver.url)
    services = services_for(db_url, redis_url, namespace, webhooks=webhooks)
    p = {k: v for k, v in payload(receiver, "evt-base", "ep-base").items() if k != "url"}
    done = execute_request(JOB, p, services=services)
    webhook_id = webhook_id_for("webhook:ep-base:evt-base")
    assert done.status == "completed"
    assert receiver.deliveries(webhook_id, "/hooks/ep-base") == 1
    jt = get_job_type(JOB)
    effects = jt.effects(services.client, done.key, jt.validate(dict(p)))
    assert len(effects) == 1


def test_the_receiver_refuses_a_wrong_signature_and_the_job_gives_up_for_good(
    db: Database, db_url: str, redis_url: str, namespace: str, redis_client: Any,
    receiver: WebhookReceiver,
) -> None:
    """A sender with another key is refused (401) and nothing counts as delivered; a 401 is
    permanent: recorded once, never retried."""
    wrong = secret_bytes("whsec_" + "b3RoZXIta2V5LW90aGVyLWtleS1vdGhlci1rZXktMDA=")
    services = services_for(db_url, redis_url, namespace, webhooks=client(key=wrong))
    with pytest.raises(WebhookRejected) as refused:
        execute_request(JOB, payload(receiver, "evt-sig"), services=services)
    assert refused.value.status == 401 and classify(refused.value) is ErrorClass.PERMANENT
    assert receiver.rejected == 1
    assert receiver.deliveries(webhook_id_for("webhook:ep-1:evt-sig")) == 0
    assert outcomes(db, "webhook:ep-1:evt-sig") == [("failed_permanent", "WebhookRejected")]


@pytest.mark.parametrize(
    ("change", "field"),
    [({"url": "file:///etc/passwd"}, "url"), ({"url": "http://user:pw@h/x"}, "url"),
     ({"url": "http://h/x\r\nX-Evil: 1"}, "url"), ({"url": "http://h/" + "a" * 3000}, "url"),
     ({"event_id": "a:b"}, "event_id"), ({"endpoint_id": None}, "endpoint_id"),
     ({"data": [1, 2]}, "data"), ({"data": {"x": "y" * 70_000}}, "data"),
     ({"data": {"x": float("nan")}}, "data"), ({"secret": "s"}, "secret")],
)
def test_bad_input_names_the_field_and_sends_nothing(
    db: Database, db_url: str, redis_url: str, namespace: str, redis_client: Any,
    receiver: WebhookReceiver, change: dict[str, Any], field: str,
) -> None:
    services = services_for(db_url, redis_url, namespace)
    bad = {**payload(receiver), **change}
    with pytest.raises(ValidationError) as refused:
        execute_request(JOB, bad, services=services)
    assert refused.value.field == field and classify(refused.value) is ErrorClass.PERMANENT
    assert receiver.summary()["messages"] == []


def test_a_4xx_is_permanent_and_a_real_run_dead_letters_it(
    db: Database, db_url: str, redis_url: str, namespace: str, redis_client: Any,
    receiver: WebhookReceiver, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real Dagster run of the per-request job against an endpoint that answers 410: the step
    is not retried (one attempt, failed_permanent), the run fails and the run-failure sensor
    keeps it in the DLQ as permanent, with the key left failed (replayable after a fix)."""
    monkeypatch.setenv("DATABASE_URL", db_url)  # the secrets' store, as the run finds it
    receiver.set_faults(status=410)
    resources = {
        **dagster_resources(db_url=db_url, redis_url=redis_url, namespace=namespace),
        "webhooks": DownstreamResource(downstream="webhooks", timeout=2.0,
                                       settle_seconds=1.0),
    }
    with dg.DagsterInstance.ephemeral() as instance:
        result = ops.deliver_webhook_job.execute_in_process(
            run_config={"ops": {"deliver_webhook_op": {"config": {
                "payload": {**payload(receiver, "evt-gone"), "data": {"order_id": "o-1"}}}}}},
            resources=resources, instance=instance, raise_on_error=False,
        )
        assert not result.success
        run = instance.get_run_by_id(result.run_id)
        failure = instance.all_logs(result.run_id, of_type=dg.DagsterEventType.RUN_FAILURE)[-1]
        context = dg.build_run_status_sensor_context(
            sensor_name="dlq_sensor", dagster_event=failure.dagster_event,
            dagster_instance=instance, dagster_run=run,
            resources={"dlq": DlqResource(database_url=db_url)},
        )
        dlq_sensor(context.for_run_failure())
    key = "webhook:ep-1:evt-gone"
    assert outcomes(db, key) == [("failed_permanent", "WebhookRejected")]
    [record] = DlqStore(db).list_records()
    assert record.error_class == FailureClass.PERMANENT and record.idempotency_key == key
    assert record.error_type == "WebhookRejected"
    stored = IdempotencyStore(db).get(key)
    assert stored is not None and stored.status is Status.FAILED
    assert receiver.deliveries(webhook_id_for(key)) == 0


def test_429_and_5xx_are_retried_and_retry_after_is_honoured(
    db: Database, db_url: str, redis_url: str, namespace: str, redis_client: Any,
    receiver: WebhookReceiver,
) -> None:
    """429 with ``Retry-After: 7`` is transient and the retry waits at least 7 s; a 503 (an
    answer: not delivered) is retried at once by the policy, without a settle wait or a
    lookup; each ends in exactly one delivery."""
    services = services_for(db_url, redis_url, namespace)
    receiver.set_faults(status=429, fail_times=1, retry_after_s=7)
    p = payload(receiver, "evt-429")
    with pytest.raises(WebhookUnavailable) as limited:
        execute_request(JOB, p, services=services)
    assert limited.value.retry_after == 7 and not limited.value.maybe_delivered
    decision = FailurePath(policy=RetryPolicy(base_delay=0.01, max_delay=0.1)).decide(
        limited.value)
    assert decision.retry and decision.delay is not None and decision.delay >= 7
    assert execute_request(JOB, p, services=services).status == "completed"

    receiver.set_faults(status=503, fail_times=2, retry_after_s=None)
    q = payload(receiver, "evt-503")
    for _ in range(2):
        with pytest.raises(WebhookUnavailable):
            execute_request(JOB, q, services=services)
    done = execute_request(JOB, q, services=services)
    assert done.status == "completed" and done.result["found"] is None
    for key in ("webhook:ep-1:evt-429", "webhook:ep-1:evt-503"):
        assert receiver.deliveries(webhook_id_for(key)) == 1
        assert len(receiver.effects(webhook_id_for(key))) == 1
    assert [o for o, _ in outcomes(db, "webhook:ep-1:evt-503")] == [
        "retried", "retried", "completed"]


def test_an_unanswered_send_is_looked_up_after_the_settle_window_never_resent_blind(
    db: Database, db_url: str, redis_url: str, namespace: str, redis_client: Any,
    receiver: WebhookReceiver,
) -> None:
    """Regression caught: a send whose answer never came (the receiver acted, then answered
    after the client's deadline) was sent again by the retry, and a receiver that ignores
    webhook-id acted twice. The job records the send, refuses to resend inside the settle
    window (WebhookNotSettled, transient, with the time left), then asks the receiver and
    completes from what it found: one delivery, one effect."""
    receiver.set_faults(answer_delay_ms=1500)
    services = services_for(db_url, redis_url, namespace, settle=1.5,
                            webhooks=client(timeout=0.3, deadline=0.6))
    p = payload(receiver, "evt-slow")
    key = "webhook:ep-1:evt-slow"
    with pytest.raises(WebhookNotSettled) as unknown:
        execute_request(JOB, p, services=services)
    assert isinstance(unknown.value.__cause__, WebhookUnavailable)
    assert isinstance(unknown.value.__cause__.__cause__, HttpNoAnswer)
    with pytest.raises(WebhookNotSettled) as early:
        execute_request(JOB, p, services=services)
    assert 0 < (early.value.retry_after or 0) <= 1.5
    time.sleep(max(0.0, unknown.value.settles_at - time.time()) + 0.05)
    done = execute_request(JOB, p, services=services)
    assert done.status == "completed" and done.result["found"] is not None
    webhook_id = webhook_id_for(key)
    assert receiver.deliveries(webhook_id) == 1 and len(receiver.effects(webhook_id)) == 1
    rows = AttemptRecorder(db).for_key(key)
    assert [(r["outcome"], r["error_class"]) for r in rows] == [
        ("retried", "WebhookNotSettled"), ("retried", "WebhookNotSettled"), ("completed", None)]
    assert rows[0]["status_after"] == "maybe_delivered"
    assert rows[2]["status_before"] == "maybe_delivered"
    assert "webhook_lookup" in rows[2]["durations"] and "webhook_post" not in rows[2][
        "durations"]


def test_a_receiver_slower_than_the_client_is_not_asked_before_the_window(
    db: Database, db_url: str, redis_url: str, namespace: str, redis_client: Any,
    receiver: WebhookReceiver,
) -> None:
    """Regression caught: a retry that asks right away, while the receiver still works on the
    first send, finds nothing and sends again (two effects). The settle window (longer than the
    receiver's processing) makes the lookup conclusive."""
    receiver.set_faults(latency_ms=1200)
    services = services_for(db_url, redis_url, namespace, settle=2.0,
                            webhooks=client(timeout=0.3, deadline=0.6))
    p = payload(receiver, "evt-later")
    webhook_id = webhook_id_for("webhook:ep-1:evt-later")
    with pytest.raises(WebhookNotSettled) as unknown:
        execute_request(JOB, p, services=services)
    assert receiver.effects(webhook_id) == []  # not yet: the receiver is still at it
    with pytest.raises(WebhookNotSettled):
        execute_request(JOB, p, services=services)
    time.sleep(max(0.0, unknown.value.settles_at - time.time()) + 0.05)
    assert execute_request(JOB, p, services=services).result["found"] is not None
    assert receiver.deliveries(webhook_id) == 1 and len(receiver.effects(webhook_id)) == 1


def test_a_pause_between_writing_the_send_down_and_confirming_cannot_outlast_the_window(
    db: Database, db_url: str, redis_url: str, namespace: str, redis_client: Any,
    receiver: WebhookReceiver, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression caught (the model's ``finding_settle_window``, through the engine so every
    job type with a settle window gets it): the handler's thread stalled between writing the
    send down (``sent_at``) and confirming the lease, the keeper beating; the bound, counted
    from the confirmation, let the POST leave 2.5 s after ``sent_at``; the retry asked the
    receiver at ``sent_at`` plus a window of 0.4 lease + the receiver's time, found nothing yet
    and sent again: two deliveries. The bound is now capped at the send's stamp plus 0.4 of a
    lease (``JobContext.stamp_send``)."""
    from engine.context import JobContext

    receiver.set_faults(latency_ms=800)
    lease = 1.5
    services = services_for(db_url, redis_url, namespace, settle=0.4 * lease + 0.8 + 0.6,
                            webhooks=client(timeout=0.3, deadline=0.6), lease=lease)
    confirm = JobContext.confirm_lease
    paused: list[float] = []

    def paused_once(self: JobContext) -> float:
        if not paused:
            paused.append(time.time())
            time.sleep(2.5)
        return confirm(self)

    monkeypatch.setattr(JobContext, "confirm_lease", paused_once)
    p = payload(receiver, "evt-paused")
    statuses = []
    for _ in range(6):
        try:
            statuses.append(execute_request(JOB, p, services=services).status)
            break
        except WebhookNotSettled as exc:
            statuses.append("not settled")
            time.sleep(max(0.0, exc.settles_at - time.time()))
        except SendDeadlinePassed:
            statuses.append("bound passed")
    time.sleep(1.5)  # a POST still in the receiver's hands has been acted on by now
    webhook_id = webhook_id_for("webhook:ep-1:evt-paused")
    assert paused and statuses[-1] == "completed", statuses
    assert receiver.deliveries(webhook_id) == 1, statuses


def test_a_worker_killed_after_sending_is_taken_over_and_nothing_is_sent_twice(
    db: Database, db_url: str, redis_url: str, namespace: str, redis_client: Any,
    receiver: WebhookReceiver,
) -> None:
    """A real worker process is SIGKILLed right after its POST was delivered, before the key
    completed; after its lease ran out another worker takes the key over, waits out the settle
    window, finds the delivery and completes: one effect at a receiver that ignores keys."""
    p = payload(receiver, "evt-kill")
    args = {"job_type": JOB, "db_url": db_url, "redis_url": redis_url,
            "namespace": namespace, "lease_seconds": 1.0, "settle_seconds": 1.0,
            "payloads": [p]}
    env = {**os.environ, "SEKALI_CRASH_AT": "after_send", "SEKALI_WEBHOOKS_SIGNING_KEY": SECRET}
    killed = subprocess.run([sys.executable, str(WORKER), json.dumps(args)], env=env,
                            capture_output=True, text=True, timeout=120)
    assert killed.returncode == -9, killed.stderr[-2000:]
    webhook_id = webhook_id_for("webhook:ep-1:evt-kill")
    assert receiver.deliveries(webhook_id) == 1
    services = services_for(db_url, redis_url, namespace, settle=1.0, lease=1.0)
    deadline = time.monotonic() + 60
    while True:
        try:
            done = execute_request(JOB, p, services=services)
            break
        except (WebhookNotSettled, Exception) as exc:  # noqa: BLE001 - waiting out lease and window
            assert classify(exc) is ErrorClass.TRANSIENT, exc
            assert time.monotonic() < deadline
            time.sleep(0.2)
    assert done.status == "completed" and done.result["found"] is not None
    assert receiver.deliveries(webhook_id) == 1 and len(receiver.effects(webhook_id)) == 1


def test_concurrent_workers_in_several_processes_deliver_each_event_once(
    db: Database, db_url: str, redis_url: str, namespace: str, redis_client: Any,
    receiver: WebhookReceiver,
) -> None:
    """Three worker processes get the same five requests (a redelivery storm); the receiver,
    which ignores webhook-id, sees each event exactly once."""
    payloads = [payload(receiver, f"evt-dup-{i}") for i in range(5)]
    args = {"job_type": JOB, "db_url": db_url, "redis_url": redis_url,
            "namespace": namespace, "payloads": payloads}
    env = {**os.environ, "SEKALI_WEBHOOKS_SIGNING_KEY": SECRET}
    procs = [subprocess.Popen([sys.executable, str(WORKER), json.dumps(args)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    statuses = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-2000:]
        statuses += [r["status"] for r in json.loads(out.strip().splitlines()[-1])]
    assert sorted(set(statuses)) <= ["completed", "duplicate"]
    assert statuses.count("completed") == 5
    for i in range(5):
        webhook_id = webhook_id_for(f"webhook:ep-1:evt-dup-{i}")
        assert receiver.deliveries(webhook_id) == 1 and len(receiver.effects(webhook_id)) == 1
    assert receiver.rejected == 0


@pytest.mark.dagster
def test_a_real_dagster_run_delivers_and_its_retry_after_a_5xx_delivers_once(
    sqlite_url: str, redis_url: str, namespace: str, redis_client: Any,
    receiver: WebhookReceiver, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The per-request job on a real instance: the endpoint fails once with 500, Dagster's step
    retry (the op's policy) sends again, and the run succeeds with one delivery."""
    monkeypatch.setenv("DATABASE_URL", sqlite_url)  # the secrets' store, as the run finds it
    db = Database.from_url(sqlite_url)
    upgrade(db)
    receiver.set_faults(status=500, fail_times=1)
    resources = {
        **dagster_resources(db_url=sqlite_url, redis_url=redis_url, namespace=namespace),
        "webhooks": DownstreamResource(downstream="webhooks", timeout=2.0,
                                       settle_seconds=1.0),
    }
    p = payload(receiver, "evt-run")
    with dg.DagsterInstance.ephemeral() as instance:
        result = ops.deliver_webhook_job.execute_in_process(
            run_config={"ops": {"deliver_webhook_op": {"config": {"payload": {
                **p, "data": {"order_id": "o-1"}}}}}},
            resources=resources, instance=instance, raise_on_error=False,
        )
    assert result.success
    key = "webhook:ep-1:evt-run"
    assert receiver.deliveries(webhook_id_for(key)) == 1
    assert [o for o, _ in outcomes(db, key)] == ["retried", "completed"]
    db.dispose()
