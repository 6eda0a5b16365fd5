"""The correlation chain, end to end through the code of the other parts: enqueue (which now
generates an id when the producer gives none) -> job_requests -> the intake sensor's run config
and run tag -> execute_request -> job_attempts -> X-Correlation-Id at the sandbox gateway. Then
the doctor's correlation check links all three; and JSON logs carry the same id."""

from __future__ import annotations

import io
import json
import logging
import threading
from pathlib import Path

from sqlalchemy import text

from engine import tags as tag
from engine.attempts import AttemptRecorder
from engine.health.diagnosis import DiagnosisSetup, EffectLedger, check_correlation
from engine.intake import enqueue
from engine.registry import JOB_TYPES
from engine.runtime import execute_request
from engine.services import Services
from pipelines.domain.payments import HttpPaymentGateway
from resources.idempotency import IdempotencyStore
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from resources.telemetry.logs import JsonFormatter, configure_json_logging, correlation_context
from sandbox.gateway import GatewayServer
from sensors.intake import IntakeMode, _tags, per_request_run_config


def test_correlation_id_follows_request_to_run_to_attempt_to_gateway(
    tmp_path: Path, sqlite_url: str
) -> None:
    """Breaks if any link drops the id: enqueue default, sensor config/tag, runtime, client."""
    db = Database.from_url(sqlite_url)
    upgrade(db)
    gateway_url = f"sqlite:///{tmp_path / 'gateway.db'}"
    server = GatewayServer(gateway_url).start()
    try:
        payload = {"order_id": "o-77", "amount_cents": 1250, "currency": "EUR"}
        given = enqueue("charge_payment", payload, correlation_id="corr-given", db=db).request
        generated = enqueue(
            "charge_payment", {**payload, "order_id": "o-78"}, db=db
        ).request
        assert given.correlation_id == "corr-given"
        assert generated.correlation_id  # the producer gave none: enqueue made one
        services = Services(
            db=db, store=IdempotencyStore(db), attempts=AttemptRecorder(db),
            clients={"payment_gateway": HttpPaymentGateway(server.url)},
        )
        for request in (given, generated):
            config = per_request_run_config(request)["ops"]["charge_payment_op"]["config"]
            tags = _tags(IntakeMode.PER_REQUEST, [request])
            assert config == {"request_id": request.id}  # the op reads the row
            assert tags[tag.CORRELATION_ID] == request.correlation_id
            outcome = execute_request(
                "charge_payment", request.payload, services=services, key=request.key,
                request_id=request.id, correlation_id=request.correlation_id,
            )
            assert outcome.status == "completed"
        with db.statement() as conn:
            attempts = dict(conn.execute(text(
                "SELECT request_id, correlation_id FROM job_attempts WHERE outcome = 'completed'"
            )).all())
        assert attempts == {given.id: "corr-given", generated.id: generated.correlation_id}
        charged = {c["correlation_id"] for c in server.charges()}
        assert charged == {"corr-given", generated.correlation_id}
        ledger = EffectLedger("gateway_charges", Database.from_url(gateway_url),
                              "gateway_charges", "reference", "correlation_id", "created_at")
        finding = check_correlation(DiagnosisSetup(
            db=db, job_types=JOB_TYPES, lease_seconds=60, effect_ledgers=[ledger]))
        assert finding.passed, finding.found
        assert finding.evidence["effects"] == 2 and finding.evidence["requests"] == 2
    finally:
        server.stop()
        db.dispose()


def test_json_logs_carry_correlation_fields(sqlite_url: str) -> None:
    """One JSON object per line with the ambient context, extras and the attempt's fields;
    each thread keeps its own context."""
    db = Database.from_url(sqlite_url)
    upgrade(db)
    stream = io.StringIO()
    handler = configure_json_logging(logging.INFO, stream=stream, logger="engine.attempts")
    other = logging.getLogger("tests.obs")
    other.addHandler(handler)
    other.setLevel(logging.INFO)
    try:
        recorder = AttemptRecorder(db)
        record = recorder.new("send_email", idempotency_key="email:w:1:d", correlation_id="c-9",
                              run_id="run-1")
        recorder.start(record)
        recorder.finish(record, "completed")

        def worker(cid: str) -> None:
            with correlation_context(correlation_id=cid, run_id=f"run-{cid}"):
                other.info("working", extra={"request_id": 5})

        threads = [threading.Thread(target=worker, args=(f"t{i}",)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        logging.getLogger("engine.attempts").removeHandler(handler)
        other.removeHandler(handler)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    attempt = next(x for x in lines if x["logger"] == "engine.attempts")
    assert attempt["correlation_id"] == "c-9" and attempt["run_id"] == "run-1"
    assert attempt["idempotency_key"] == "email:w:1:d" and attempt["outcome"] == "completed"
    work = sorted((x["correlation_id"], x["run_id"], x["request_id"])
                  for x in lines if x["message"] == "working")
    assert work == [(f"t{i}", f"run-t{i}", 5) for i in range(4)]
    assert isinstance(JsonFormatter().format(logging.makeLogRecord({"msg": "x"})), str)
    db.dispose()
