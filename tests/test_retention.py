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
from typing import Any

import dagster as dg
import pytest
from sqlalchemy import text

from engine.attempts import AttemptRecorder
from engine.failures import FailurePath
from engine.health.diagnosis import DiagnosisSetup, Finding, diagnose
from engine.intake import enqueue
from engine.registry import JOB_TYPES
from engine.requests import RequestStore
from engine.runtime import execute_request
from engine.services import Services
from engine.upkeep.reconciliation import Reconciler, ReconciliationResult
from pipelines.domain.mail import SmtpMailer
from pipelines.jobs.fulfilment import cart_for
from pipelines.jobs.report import report_loader
from resources.dagster_resources import DlqResource
from resources.dlq import MIN_RETENTION_SECONDS, DlqStatus, DlqStore
from resources.errors import ValidationError
from resources.idempotency import IdempotencyStore
from resources.outbox import (
    Consumer,
    InAppPublisher,
    Inbox,
    OutboxDeadLetters,
    OutboxPublisher,
    write_event,
)
from resources.storage.db import Database
from resources.storage.settings import RetentionSettings
from sandbox.mailsink import MailSink
from sandbox.redis_server import free_port
from sensors.dlq import dead_letter_failed_requests
from tests.job_workers import replay_sensor
from tests.test_outbox import make_tables
from tests.test_outbox_dead_letters import Poisoned

DAY = 86400.0


class Clock:
    """Time that moves only when the test says so."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now



def _mail_sent_then_run_failed(
    db: Database, clock: Clock, mail_sink: MailSink, user: str = "u1"
) -> tuple[dict[str, Any], Services, int]:
    """A welcome mail whose key completed, then the worker died before the step succeeded:
    the run failed, the request with it, and the sweep dead-lettered it (an open record)."""
    store = IdempotencyStore(db, clock=clock)
    services = Services(
        db=db,
        store=store,
        attempts=AttemptRecorder(db, clock=clock),
        clients={"smtp": SmtpMailer("127.0.0.1", mail_sink.port)},
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
    db: Database, mail_sink: MailSink
) -> None:
    """Catches: the reaper purging a completed key that an open DLQ record still points at, so
    a replay on day 8 runs against an empty ledger and sends the mail a second time; and such
    a record staying open for ever instead of resolving itself."""
    clock = Clock(time.time())
    payload, services, record_id = _mail_sent_then_run_failed(db, clock, mail_sink)
    assert len(mail_sink.messages()) == 1

    clock.now += 8 * DAY
    dlq = DlqStore(db, clock=clock)
    Reconciler(db, store=services.store, dlq=dlq, clock=clock).run()
    decisions = dlq.request_replay([record_id], actor="test", idempotency=services.store)
    if decisions[0].replay:  # what the replay run does: the same request, the same key
        execute_request("send_email", payload, services=services, run_id="replay-1")

    assert len(mail_sink.messages()) == 1, "a replay repeated the mail after the key's retention"
    record = dlq.get(record_id)
    assert record.status is DlqStatus.RESOLVED
    (resolved,) = [a for a in dlq.audit(record_id) if a["action"] == "resolved"]
    assert resolved["actor"] == "reconciliation" and "completed" in resolved["detail"]
    request = RequestStore(db).get(record.request_id or 0)
    assert request is not None and request.status == "completed"


def test_an_open_record_keeps_its_completed_key_past_the_ledger_retention(
    db: Database, mail_sink: MailSink
) -> None:
    """Catches: the reaper dropping a key an open DLQ record names when the record cannot
    resolve itself (its payload differs from the one the key completed with: a conflict a
    person must look at): a replay after the purge would run the other payload's effect."""
    clock = Clock(time.time())
    _payload, services, record_id = _mail_sent_then_run_failed(db, clock, mail_sink)
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
    db: Database, db_url: str, mail_sink: MailSink
) -> None:
    """Catches: a replay sensor that launches a run for a record whose intent is done (at best
    a wasted run; after the ledger's retention, a second mail)."""
    clock = Clock(time.time())
    _payload, services, record_id = _mail_sent_then_run_failed(db, clock, mail_sink)
    dlq = DlqStore(db)
    dlq.request_replay([record_id], actor="test", idempotency=services.store)

    sensor = replay_sensor(clock=clock)
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


# -- every table after a workload and a purge -------------------------------------------------

ZERO = RetentionSettings(
    idempotency=MIN_RETENTION_SECONDS,  # the floors; the purge runs 4 days later
    dlq=MIN_RETENTION_SECONDS,
    attempts=0,
    rejections=0,
    requests=0,
    report_snapshots=0,
    outbox=0,
    inbox=0,
    reconciliation_actions=0,
)


def _send(
    services: Services, requests: RequestStore, to: str, user: str, *, fail_ok: bool = False
) -> int:
    """Enqueue and run one welcome mail the way a run does; returns the request id."""
    payload = {"template": "welcome", "user_id": user, "date": "2026-11-01", "to": to}
    request = enqueue("send_email", payload, db=services.db).request
    requests.mark_running(request.id, run_id=f"run-{user}")
    try:
        execute_request(
            "send_email", payload, services=services, request_id=request.id, run_id=f"run-{user}"
        )
        requests.mark_completed(request.id, run_id=f"run-{user}")
    except Exception as exc:  # noqa: BLE001 - any failure is allowed when fail_ok, then settled
        assert fail_ok, exc
        FailurePath().settle_request(requests, request.id, exc, run_id=f"run-{user}")
    return request.id


def workload(db: Database, clock: Clock, mail_sink: MailSink) -> dict[str, Any]:
    """One of everything the tables keep: finished work, and work still unresolved."""
    store = IdempotencyStore(db, clock=clock)
    attempts = AttemptRecorder(db, clock=clock)
    requests = RequestStore(db, clock=clock)
    dlq = DlqStore(db, clock=clock)
    services = Services(
        db=db, store=store, attempts=attempts,
        clients={"smtp": SmtpMailer("127.0.0.1", mail_sink.port)},
    )
    down = Services(
        db=db, store=store, attempts=attempts,
        clients={"smtp": SmtpMailer("127.0.0.1", free_port())},
    )
    ids = {
        "sent": _send(services, requests, "ann@example.com", "u-sent"),
        "given_up": _send(services, requests, "bob@reject.invalid", "u-given-up", fail_ok=True),
        "open": _send(services, requests, "cy@reject.invalid", "u-open", fail_ok=True),
        "retrying": _send(down, requests, "dee@example.com", "u-retrying", fail_ok=True),
        "pending": enqueue(
            "send_email",
            {"template": "welcome", "user_id": "u-pending", "date": "2026-11-01", "to": "e@x.io"},
            db=db,
        ).id,
    }
    with pytest.raises(ValidationError):
        enqueue("send_email", {"template": "nope"}, db=db)
    records = {r.request_id: r.id for r in dlq.list_records()}  # written at each decision
    dlq.discard([records[ids["given_up"]]], actor="test", reason="the address is wrong")
    report_loader(db, "orders_by_status", "2026-11-01")()
    with db.transaction() as conn:
        write_event(conn, aggregate_type="order", aggregate_id="o1", event_type="e",
                    payload={}, event_id="ev-published", now=clock())
        write_event(conn, aggregate_type="order", aggregate_id="o2", event_type="e",
                    payload={}, event_id="ev-unpublished", now=clock())
        for order, status in (("o-paid", "new"), ("o-comp", "needs_compensation")):
            conn.execute(
                text(
                    "INSERT INTO orders (order_id, payment_status, fulfilment_status,"
                    " created_at, updated_at) VALUES (:o, 'paid', :f, :t, :t)"
                ),
                {"o": order, "f": status, "t": clock()},
            )
    inbox = Inbox(db, clock=clock)
    consumer = Consumer("c", frozenset(), lambda _conn, _event: None)
    publisher = OutboxPublisher(db, InAppPublisher(inbox, [consumer]), batch_size=1, clock=clock)
    publisher.publish_batch()
    # the consumer applied ev-unpublished, its publisher died before marking it published
    (unpublished,) = OutboxPublisher(db, InAppPublisher(inbox, []), clock=clock).claim()
    inbox.process("c", unpublished, consumer.handler)
    reconciler = Reconciler(db, store=store, dlq=dlq, clock=clock, retention=ZERO)
    report = ReconciliationResult()
    for key, order in (
        ("reconcile:flag-paid-without-charge:o-paid", "o-paid"),
        (f"compensate:cancel-reservation:{cart_for('o-comp')}", "o-comp"),
        ("compensate:refund-pending:o-comp:None", "o-comp"),  # paid, no charge id
    ):
        reconciler.act(report, key, "flag", order, lambda _conn: {})
    return {"ids": ids, "open_record": records[ids["open"]], "reconciler": reconciler}


def _rows(db: Database, sql: str) -> list[Any]:
    with db.statement() as conn:
        return [tuple(r) for r in conn.execute(text(sql))]


def test_after_a_workload_and_a_purge_only_what_is_unresolved_remains(
    db: Database, mail_sink: MailSink
) -> None:
    """Catches: a table nothing ever purges (attempts, rejections, finished requests, report
    snapshots, published outbox rows, inbox, reconciliation actions, closed DLQ records and
    failed keys nothing names), and a purge that drops a row something unresolved still needs
    (an open DLQ record, its request, key and attempts; a retrying or pending request; an
    unpublished event and its inbox entry; the actions of an order still to compensate)."""
    clock = Clock(time.time())
    w = workload(db, clock, mail_sink)
    ids = w["ids"]
    clock.now += 4 * DAY
    report = w["reconciler"].run()

    unresolved = sorted([ids["open"], ids["retrying"], ids["pending"]])
    assert [r[0] for r in _rows(db, "SELECT id FROM job_requests ORDER BY id")] == unresolved
    assert _rows(db, "SELECT id, status FROM dlq_records") == [(w["open_record"], "open")]
    for table in ("dlq_failures", "dlq_audit"):
        assert {r[0] for r in _rows(db, f"SELECT record_id FROM {table}")} == {w["open_record"]}
    assert {r[0] for r in _rows(db, "SELECT key FROM idempotency_records")} == {
        "email:welcome:u-open:2026-11-01",  # failed, its DLQ record open
        "email:welcome:u-retrying:2026-11-01",  # retryable, its request still running
    }
    assert {r[0] for r in _rows(db, "SELECT request_id FROM job_attempts")} == {
        ids["open"], ids["retrying"]
    }
    assert _rows(db, "SELECT event_id FROM outbox") == [("ev-unpublished",)]
    assert _rows(db, "SELECT event_id FROM inbox") == [("ev-unpublished",)]
    assert _rows(db, "SELECT subject FROM reconciliation_actions") == [("o-comp",)] * 2
    for table in ("job_rejections", "report_snapshots"):
        assert _rows(db, f"SELECT COUNT(*) FROM {table}") == [(0,)]
    assert report.purged["job_attempts"] == 2 and report.purged["job_rejections"] == 1


def test_a_purge_is_bounded_and_the_rest_waits_for_the_next_run(db: Database) -> None:
    """Catches: a purge that deletes a whole backlog in one unbounded statement."""
    requests = RequestStore(db)
    for i in range(25):
        requests.reject("send_email", {"n": i}, field="to", error="invalid to")
    expired = requests.expired_rejections(0.0)
    assert expired.purge(db, batch_size=10, max_batches=2) == 20
    assert expired.count(db) == 5
    assert expired.purge(db, batch_size=10, max_batches=2) == 5


# -- the doctor ---------------------------------------------------------------------------------


def _doctor(db: Database, clock: Clock, check: str) -> Finding:
    setup = DiagnosisSetup(db=db, job_types=JOB_TYPES, lease_seconds=60, clock=clock)
    (finding,) = diagnose(setup, only=[check])
    return finding


def test_the_doctor_reports_rows_past_retention_until_the_purge_runs(
    db: Database, mail_sink: MailSink
) -> None:
    """Catches: a purge that stopped running (no schedule) going unnoticed while tables grow."""
    clock = Clock(time.time())
    _mail_sent_then_run_failed(db, clock, mail_sink)
    RequestStore(db, clock=clock).reject("send_email", {}, field="to", error="invalid to")
    assert _doctor(db, clock, "retention_backlog").passed

    clock.now += 40 * DAY
    late = _doctor(db, clock, "retention_backlog")
    assert not late.passed and late.severity == "WARN"
    assert late.evidence["tables"]["job_rejections"]["expired"] == 1
    assert late.evidence["open_records_with_completed_key"]  # not resolved: nothing ran
    assert "reconciliation_schedule" in late.fix

    Reconciler(db, store=IdempotencyStore(db, clock=clock), dlq=DlqStore(db, clock=clock),
               clock=clock).run()
    assert _doctor(db, clock, "retention_backlog").passed


def test_the_doctor_fails_when_an_open_record_lost_its_completed_key(
    db: Database, mail_sink: MailSink
) -> None:
    """Catches: a ledger purge that ignored the open DLQ records (an old reaper, a manual
    DELETE): the next replay of such a record repeats its effect, and the doctor must say so."""
    clock = Clock(time.time())
    _payload, services, _record_id = _mail_sent_then_run_failed(db, clock, mail_sink)
    assert _doctor(db, clock, "retention_agreement").passed

    clock.now += 8 * DAY
    services.store.purge(older_than=7 * DAY)  # the reaper as it was: no keep conditions
    finding = _doctor(db, clock, "retention_agreement")
    assert not finding.passed and finding.severity == "ERROR"
    assert finding.evidence["forgotten_keys"] == ["email:welcome:u1:2026-11-01"]
    assert "Do not replay" in finding.fix


# -- outbox dead letters --------------------------------------------------------------------------


def test_closed_outbox_dead_letters_are_purged_after_the_dlq_retention_and_open_ones_never(
    db: Database,
) -> None:
    """Catches outbox dead letters kept forever (they had no retention), and a purge that drops
    one an operator still has to decide on (open, whatever its age), one closed within the
    retention, or a replayed one whose event is still unpublished (if it dies again, its dead
    letter opens again with its count of deaths)."""
    clock = Clock(time.time())
    make_tables(db)
    events = ["ev-open", "ev-discarded", "ev-replayed-published", "ev-replayed-pending",
              "ev-discarded-recent"]
    with db.transaction() as conn:
        for i, event_id in enumerate(events):
            write_event(conn, aggregate_type="order", aggregate_id=f"a{i}", event_type="e",
                        payload={}, event_id=event_id, now=clock())
    OutboxPublisher(db, Poisoned(db, set(events)), max_failures=1, clock=clock).publish_batch()
    store = OutboxDeadLetters(db, clock=clock)
    dead = {d.event_id: d.id for d in store.page()}
    assert set(dead) == set(events)
    assert store.discard([dead["ev-discarded"]], actor="test", reason="bad") != []
    assert store.replay([dead["ev-replayed-published"], dead["ev-replayed-pending"]],
                        actor="test") != []
    still_failing = Poisoned(db, {"ev-replayed-pending"})
    OutboxPublisher(db, still_failing, max_failures=100, clock=clock).publish_batch()
    clock.now += MIN_RETENTION_SECONDS + DAY
    assert store.discard([dead["ev-discarded-recent"]], actor="test", reason="bad") != []

    report = Reconciler(db, store=IdempotencyStore(db, clock=clock),
                        dlq=DlqStore(db, clock=clock), clock=clock, retention=ZERO).run()

    assert report.purged["outbox_dead_letters"] == 2
    left = {d.event_id: str(d.status) for d in store.page(None)}
    assert left == {"ev-open": "open", "ev-replayed-pending": "replayed",
                    "ev-discarded-recent": "discarded"}
