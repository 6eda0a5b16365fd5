"""The lookup hook: a job type asks its downstream what it holds for one intent.

Against the real sandbox gateway (HTTP) and mail sink (SMTP, its record in SQLite), and
reconciliation on SQLite and Postgres: the payment check resolves an unanswered charge through
the job type's declared lookup, and the registry names a side-effecting type that has none."""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from engine import Calls, Effect, JobType, Lookup
from engine.registry import JOB_TYPES, discover
from engine.upkeep.reconciliation import Reconciler
from pipelines.domain.mail import MailUnavailable, SmtpMailer, message_id_for
from pipelines.domain.payments import GATEWAY, HttpPaymentGateway
from pipelines.jobs.payment import reference_for
from resources.dlq import DlqStore
from resources.idempotency import IdempotencyStore
from resources.storage.db import Database
from sandbox.gateway import GatewayServer
from sandbox.mailsink import MailSink


def test_charge_payment_lookup_counts_the_charges_of_an_intent(gateway: GatewayServer) -> None:
    """Catches: a lookup that asks under another reference than the one every attempt charges
    under, or hides a duplicate."""
    lookup = JOB_TYPES["charge_payment"].calls.lookup
    assert lookup is not None
    client = HttpPaymentGateway(gateway.url)
    clients = {GATEWAY.name: client}.__getitem__
    key = "payment:o-look"
    assert lookup(clients, key, {"order_id": "o-look"}) == []
    for idem in ("a", "b"):
        client.charge(reference=reference_for(key), amount_cents=700, currency="EUR",
                      idempotency_key=idem)
    effects = lookup(clients, key, {"order_id": "o-look"})
    assert len(effects) == 2 and all(isinstance(e, Effect) for e in effects)
    assert {e.reference for e in effects} == {c["charge_id"] for c in gateway.charges()}
    assert effects[0].detail["amount_cents"] == 700 and effects[0].at is not None
    assert lookup(clients, "payment:o-other", {"order_id": "o-other"}) == []


def test_send_email_lookup_finds_the_mail_by_its_message_id(
    mail_sink: MailSink, tmp_path: Path
) -> None:
    """Catches: a mail lookup that cannot tell sent from never sent, or concludes "never sent"
    when the provider's record cannot be read."""
    jt = JOB_TYPES["send_email"]
    assert jt.calls.lookup is not None
    mailer = SmtpMailer(mail_sink.host, mail_sink.port, timeout=5, deadline=10,
                        log_url=mail_sink.db_url)
    key = "email:welcome:u-look:2026-12-01"
    clients: Any = {"smtp": mailer}.__getitem__
    assert jt.effects(clients, key, None) == []
    mailer.send(to="u@example.com", subject="hi", body="hello", message_id=message_id_for(key))
    (effect,) = jt.effects(clients, key, None)
    assert effect.reference == message_id_for(key) and effect.at is not None
    blind: Any = {"smtp": SmtpMailer(mail_sink.host, mail_sink.port)}.__getitem__
    with pytest.raises(MailUnavailable, match="SEKALI_SMTP_LOG_URL"):
        jt.effects(blind, key, None)


def _unanswered_order(db: Database, order_id: str, key: str, sent_at: float) -> None:
    """An order whose charge went out under ``key`` and whose answer never came."""
    with db.transaction() as conn:
        conn.execute(
            text(
                "INSERT INTO orders (order_id, amount_cents, currency, payment_status,"
                " payment_reference, charge_sent_at, fulfilment_status, created_at, updated_at)"
                " VALUES (:o, 700, 'EUR', 'charged_not_confirmed', :r, :t, 'new', :t, :t)"
            ),
            {"o": order_id, "r": reference_for(key), "t": sent_at},
        )
        conn.execute(
            text("INSERT INTO payment_references (order_id, reference, key, first_sent_at)"
                 " VALUES (:o, :r, :k, :t)"),
            {"o": order_id, "r": reference_for(key), "k": key, "t": sent_at},
        )


def test_reconciliation_resolves_an_unanswered_charge_through_the_declared_lookup(
    db: Database, gateway: GatewayServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches: reconciliation asking the gateway its own way instead of the job type's lookup
    (then a lookup that knows better, or a job type's own downstream, is never asked)."""
    key = "payment:o-unanswered"
    sent_at = time.time() - 3600
    _unanswered_order(db, "o-unanswered", key, sent_at)
    _unanswered_order(db, "o-never", "payment:o-never", sent_at)
    client = HttpPaymentGateway(gateway.url)
    charge = client.charge(reference=reference_for(key), amount_cents=700, currency="EUR",
                           idempotency_key=key)
    real = JOB_TYPES["charge_payment"]
    assert real.calls.lookup is not None
    inner: Lookup = real.calls.lookup
    asked: list[str] = []

    def recording(clients: Any, k: str, payload: Any) -> list[Effect]:
        asked.append(k)
        return list(inner(clients, k, payload))

    monkeypatch.setitem(JOB_TYPES, "charge_payment", dataclasses.replace(
        real, calls=dataclasses.replace(real.calls, lookup=recording)
    ))
    report = Reconciler(db, store=IdempotencyStore(db), dlq=DlqStore(db),
                        clients={GATEWAY.name: client}, grace_seconds=0,
                        settle_seconds=60).run()
    assert sorted(asked) == ["payment:o-never", key]
    assert report.fixed["charged_not_confirmed"] == 2
    with db.statement() as conn:
        rows = dict(conn.execute(
            text("SELECT order_id, payment_status || ':' || COALESCE(charge_id, '-')"
                 " FROM orders")).all())
    assert rows == {"o-unanswered": f"paid:{charge.charge_id}", "o-never": "payment_pending:-"}


def test_a_side_effecting_type_without_a_lookup_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Catches: a job type that sends to a downstream but cannot be asked about it going
    unnoticed; a type without a downstream (its effect is in our own tables) is not named."""
    assert not any(jt.missing_lookup for jt in JOB_TYPES.values())
    package = tmp_path / "blindjobs"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "blind.py").write_text(
        "from engine import Calls, JobType, Keying, Queue, Running\n"
        "from pipelines.domain.payments import GATEWAY\n"
        "JOB_TYPE = JobType(name='blind_charge', queue=Queue.LIGHT, validate=dict,\n"
        "    handler=lambda ctx, p: None, side_effect=True,\n"
        "    keying=Keying(key_for=lambda p: 'blind:' + p['id'], resource_id=lambda p: p['id']),\n"
        "    running=Running(max_runtime_seconds=10), calls=Calls(clients=(GATEWAY,)))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="engine.registry"):
        found = discover({"SEKALI_JOB_MODULES": "blindjobs.blind"})
    assert found["blind_charge"].missing_lookup
    assert "'blind_charge'" in caplog.text and "declares no lookup" in caplog.text
    sys.modules.pop("blindjobs.blind", None)
    sys.modules.pop("blindjobs", None)
    local = dataclasses.replace(found["blind_charge"], calls=Calls())
    assert isinstance(local, JobType) and not local.missing_lookup
