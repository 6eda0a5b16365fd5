"""Personal data stays out of what sekali writes for people to read: logs, attempt errors, DLQ
records and their views. Real Dagster runs of the per-request job, a real SMTP sink that refuses
one domain, the real DLQ sensor and CLI, on SQLite and Postgres.
"""

from __future__ import annotations

import io
import json
import logging
import re
from typing import Any

import dagster as dg
import pytest
from sqlalchemy import text

from cli.main import main as cli
from engine import JobContext, JobType, Keying, Queue, Running
from engine.attempts import AttemptRecorder
from engine.privacy import dlq_view
from engine.registry import JOB_TYPES
from engine.requests import RequestStore
from engine.services import Services
from engine.step import StepAttempt, StepRequest, run_steps
from pipelines.ops import all_jobs
from resources.dagster_resources import DlqResource
from resources.dlq import DlqStore
from resources.idempotency import IdempotencyStore
from resources.retry import RetryPolicy
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from resources.telemetry.logs import configure_json_logging
from sandbox.mailsink import MailSink
from sensors.dlq import dead_letter_run, sweep
from tests.job_workers import dagster_resources

ADDRESS = re.compile(r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+")
JOBS = {job.name: job for job in all_jobs}
DOWNSTREAM_LOGGERS = ("mail.log", "sandbox.")



def _mail_run(
    instance: dg.DagsterInstance, resources: dict[str, Any], requests: RequestStore, to: str,
    user: str,
) -> dg.ExecuteInProcessResult:
    payload = {"template": "welcome", "user_id": user, "date": "2026-11-01", "to": to}
    request = requests.enqueue("send_email", f"email:welcome:{user}:2026-11-01", payload,
                               queue="light").request
    return JOBS["send_email"].execute_in_process(
        run_config={"ops": {"send_email_op": {"config": {
            "payload": payload, "request_id": request.id,
        }}}},
        tags={"sekali/key": request.key, "sekali/request_id": str(request.id)},
        resources=resources,
        instance=instance,
        raise_on_error=False,
    )


def _addresses(value: Any) -> list[str]:
    return ADDRESS.findall(json.dumps(value, default=str))


def test_logs_attempts_and_dlq_views_of_a_run_carry_no_email_address(
    db: Database, db_url: str, redis_url: str, namespace: str, mail_sink: MailSink,
    caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str],
) -> None:
    """Catches: a recipient's address logged at INFO ("sent ... to ann@..."), carried into the
    attempt's error, the request's last_error, the DLQ record's message and trace, and printed
    by `sekali dlq show` / `list --json` (with the payload's `to`)."""
    caplog.set_level(logging.DEBUG)
    instance = dg.DagsterInstance.ephemeral()
    resources = dagster_resources(
        db_url=db_url, redis_url=redis_url, namespace=namespace, smtp_port=mail_sink.port
    )
    requests = RequestStore(db)
    assert _mail_run(instance, resources, requests, "ann@example.com", "u1").success
    failed = _mail_run(instance, resources, requests, "bob@reject.invalid", "u2")
    assert not failed.success
    store = DlqStore(db)
    dead_letter_run(instance, instance.get_run_by_id(failed.run_id), store, actor="test")
    sweep(instance, store, None)
    (record,) = store.list_records()
    assert record.payload["to"] == "bob@reject.invalid"  # kept whole: a replay needs it

    logged = [
        (r.name, r.getMessage(), r.__dict__.get("sekali"), r.exc_text)
        for r in caplog.records
        if not r.name.startswith(DOWNSTREAM_LOGGERS)  # the stand-in SMTP server's own logs
    ]
    assert any("sent" in m for _, m, _, _ in logged)  # the mail log line is there, masked
    assert _addresses(logged) == []
    with db.statement() as conn:
        errors = [r[0] for r in conn.execute(text("SELECT error_reason FROM job_attempts"))]
        last_errors = [r[0] for r in conn.execute(text("SELECT last_error FROM job_requests"))]
    assert any(e and "refused" in e for e in errors)
    assert _addresses([errors, last_errors, record.last_error, record.trace]) == []

    views = []
    for argv in (["show", str(record.id)], ["show", str(record.id), "--json"],
                 ["list", "--json"], ["list"]):
        assert cli(["dlq", *argv, "--url", db_url]) == 0
        views.append(capsys.readouterr().out)
    assert "<redacted>" in views[1] and "refused" in views[1]
    assert _addresses(views) == []
    assert _addresses(dlq_view(record)) == []


def test_an_sqlalchemy_error_in_a_dlq_trace_holds_no_bound_payload(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches: engines that print bound parameters in their errors, which the failure path
    carries into the request's dead letter (its message and trace): the whole payload,
    personal data included."""
    secret = "payload-value-4417"

    def write(ctx: JobContext, payload: dict[str, Any]) -> None:
        with ctx.services.db.statement() as conn:  # field is NOT NULL
            conn.execute(
                text("INSERT INTO job_rejections (job_type, payload, field, error, created_at)"
                     " VALUES ('send_email', :payload, NULL, 'e', 0)"),
                {"payload": payload["value"]},
            )

    monkeypatch.setitem(JOB_TYPES, "write_probe", JobType(
        name="write_probe",
        queue=Queue.LIGHT,
        validate=dict,
        handler=write,
        side_effect=False,
        keying=Keying(key_for=lambda p: f"w:{p['value']}", resource_id=lambda p: "w"),
        running=Running(max_runtime_seconds=60),
    ))
    request = RequestStore(db).enqueue("write_probe", "w:1", {"value": secret}, queue="light")
    services = Services(db=db, store=IdempotencyStore(db), attempts=AttemptRecorder(db),
                        retry_policy=RetryPolicy(max_attempts=1))
    result = run_steps(services, StepAttempt("run-1", "write_probe_op"),
                       [StepRequest.of(request.request)])[0]
    assert result.dead_letter is not None
    (record,) = DlqStore(db).list_records()
    assert "INSERT INTO job_rejections" in (record.trace or "")  # the statement, for debugging
    assert secret not in (record.trace or "") and secret not in (record.last_error or "")


def test_json_log_lines_mask_addresses_in_message_extras_and_exceptions() -> None:
    """Catches: the structured log format passing an address through in any of its fields."""
    stream = io.StringIO()
    log = logging.getLogger("tests.privacy")
    handler = configure_json_logging(logging.DEBUG, stream=stream, logger="tests.privacy")
    try:
        try:
            raise ValueError("cannot deliver to cy@example.org")
        except ValueError:
            log.exception("mail to %s failed", "ann@example.com",
                          extra={"sekali": {"to": "dee@example.net"}, "key": "k@x.io"})
    finally:
        log.removeHandler(handler)
    line = json.loads(stream.getvalue())
    assert _addresses(line) == [] and line["message"] == "mail to <email> failed"
    assert "ValueError" in line["exception"]


def test_the_dlq_resource_and_cli_exit_cleanly_on_a_masked_record(db_url: str) -> None:
    """The resource builds the store the CLI reads (a smoke check of the wiring)."""
    db = Database.from_url(db_url)
    upgrade(db)  # a resource checks the schema; on Postgres it applies nothing itself
    db.dispose()
    assert isinstance(DlqResource(database_url=db_url).get_store(), DlqStore)
