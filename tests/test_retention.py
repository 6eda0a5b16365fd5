"""Retention against SQLite and Postgres with time driven by injected clocks (nothing sleeps).

The guarantee under test: retention deletes only what nothing unresolved still needs. Above all,
a DLQ record still open for a request whose idempotency key completed (the worker died after the
key completed and before the step reported success) must never turn into a second effect when
the ledger's retention comes around: the key is kept while the record is open, and the record
resolves itself once it is seen with its key completed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from sqlalchemy import text

from pipelines.attempts import AttemptRecorder
from pipelines.domain.mail import SmtpMailer
from pipelines.reconciliation import Reconciler
from pipelines.requests import RequestStore
from pipelines.runtime import execute_request
from pipelines.services import Services
from resources.dagster_resources import DlqResource
from resources.dlq import DlqStatus, DlqStore
from resources.idempotency import IdempotencyStore
from resources.storage.db import Database
from sandbox.mailsink import MailSink
from sensors.dlq import build_dlq_replay_sensor, dead_letter_failed_requests

DAY = 86400.0


class Clock:
    """Time that moves only when the test says so."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def sink(tmp_path: Path) -> Iterator[MailSink]:
    server = MailSink(f"sqlite:///{tmp_path / 'mail.db'}").start()
    try:
        yield server
    finally:
        server.stop()


def _mail_sent_then_run_failed(
    db: Database, clock: Clock, sink: MailSink, user: str = "u1"
) -> tuple[dict[str, Any], Services, int]:
    """A welcome mail whose key completed, then the worker died before the step succeeded:
    the run failed, the request with it, and the sweep dead-lettered it (an open record)."""
    store = IdempotencyStore(db, clock=clock)
    services = Services(
        db=db,
        store=store,
        attempts=AttemptRecorder(db, clock=clock),
        mailer=SmtpMailer("127.0.0.1", sink.port),
    )
    requests = RequestStore(db, clock=clock)
    payload = {
        "template": "welcome", "user_id": user, "date": "2026-11-01", "to": "ann@example.com"
    }
    key = f"email:welcome:{user}:2026-11-01"
    request = requests.enqueue("send_email", key, payload, queue="light").request
    requests.mark_running(request.id, run_id="run-1")
    execute_request("send_email", payload, services=services, request_id=request.id, run_id="run-1")
    requests.mark_failed(
        request.id, "RunFailure: worker killed", error_class="transient", run_id="run-1"
    )
    (recorded,) = dead_letter_failed_requests(DlqStore(db, clock=clock))
    assert recorded.record.status is DlqStatus.OPEN
    return payload, services, recorded.record.id


def test_replay_on_day_8_of_a_record_whose_key_completed_sends_no_second_mail(
    db: Database, sink: MailSink
) -> None:
    """Catches: the reaper purging a completed key that an open DLQ record still points at, so
    a replay on day 8 runs against an empty ledger and sends the mail a second time; and such
    a record staying open for ever instead of resolving itself."""
    clock = Clock(time.time())
    payload, services, record_id = _mail_sent_then_run_failed(db, clock, sink)
    assert len(sink.messages()) == 1

    clock.now += 8 * DAY
    dlq = DlqStore(db, clock=clock)
    Reconciler(db, store=services.store, dlq=dlq, clock=clock).run()
    decisions = dlq.request_replay([record_id], actor="test", idempotency=services.store)
    if decisions[0].replay:  # what the replay run does: the same request, the same key
        execute_request("send_email", payload, services=services, run_id="replay-1")

    assert len(sink.messages()) == 1, "a DLQ replay repeated the mail after the key's retention"
    record = dlq.get(record_id)
    assert record.status is DlqStatus.RESOLVED
    (resolved,) = [a for a in dlq.audit(record_id) if a["action"] == "resolved"]
    assert resolved["actor"] == "reconciliation" and "completed" in resolved["detail"]
    request = RequestStore(db).get(record.request_id or 0)
    assert request is not None and request.status == "completed"


def test_an_open_record_keeps_its_completed_key_past_the_ledger_retention(
    db: Database, sink: MailSink
) -> None:
    """Catches: the reaper dropping a key an open DLQ record names when the record cannot
    resolve itself (its payload differs from the one the key completed with: a conflict a
    person must look at): a replay after the purge would run the other payload's effect."""
    clock = Clock(time.time())
    _payload, services, record_id = _mail_sent_then_run_failed(db, clock, sink)
    dlq = DlqStore(db, clock=clock)
    key = dlq.get(record_id).idempotency_key or ""
    conflicting = {"template": "welcome", "user_id": "u1", "date": "2026-11-01", "to": "b@x.org"}
    with db.transaction() as conn:  # what a conflicting request's run leaves: its own payload
        conn.execute(
            text("UPDATE dlq_records SET payload = :p WHERE id = :id"),
            {"p": json.dumps(conflicting), "id": record_id},
        )

    clock.now += 8 * DAY
    report = Reconciler(db, store=services.store, dlq=dlq, clock=clock).run()

    assert report.resolved_dead_letters == []
    assert dlq.get(record_id).status is DlqStatus.OPEN
    assert services.store.get(key) is not None, "the key of an open DLQ record was purged"
    dlq.discard([record_id], actor="test", reason="conflict looked at")
    clock.now += 31 * DAY
    Reconciler(db, store=services.store, dlq=dlq, clock=clock).run()
    assert services.store.get(key) is None  # nothing unresolved names it any more


def test_the_replay_sensor_resolves_a_requested_record_whose_key_completed(
    db: Database, db_url: str, sink: MailSink
) -> None:
    """Catches: a replay sensor that launches a run for a record whose intent is done (at best
    a wasted run; after the ledger's retention, a second mail)."""
    clock = Clock(time.time())
    _payload, services, record_id = _mail_sent_then_run_failed(db, clock, sink)
    dlq = DlqStore(db)
    dlq.request_replay([record_id], actor="test", idempotency=services.store)

    sensor = build_dlq_replay_sensor(clock=clock)
    context = dg.build_sensor_context(
        instance=dg.DagsterInstance.ephemeral(),
        resources={"dlq": DlqResource(database_url=db_url)},
    )
    result = sensor.evaluate_tick(context)

    assert not result.run_requests
    assert dlq.get(record_id).status is DlqStatus.RESOLVED
    assert any(
        a["action"] == "resolved" and a["actor"] == "dlq_replay_sensor"
        for a in dlq.audit(record_id)
    )
