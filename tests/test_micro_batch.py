"""The micro-batch path (``run_batch`` -> ``execute_batch``) keeps every guarantee of the
per-request path while it claims, completes and records a batch together.

Real stores on SQLite and Postgres, the real SMTP sink, real processes: one statement claims a
whole batch; each kind of failure stays with its own request; overlapping batches in several
processes make each effect once; a batch killed mid-way (SIGKILL) is finished by the next run
without a second effect; an inventory batch commits its carts in one transaction, a cart that
cannot be reserved rolling back alone.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, text
from sqlalchemy.engine import Engine

from engine.attempts import AttemptRecorder
from engine.requests import RequestStatus, RequestStore
from engine.services import Services
from engine.step import run_batch
from pipelines.domain.inventory import Inventory
from pipelines.domain.mail import SmtpMailer, message_id_for
from pipelines.jobs import inventory as inventory_job
from pipelines.jobs.email import validate
from resources.flow import ConcurrencyLimits
from resources.idempotency import Claim, Completed, IdempotencyStore, Status
from resources.storage.db import Database
from resources.storage.driver import DriverConnection, Sql
from resources.storage.redis import redis_client as redis_client_for
from resources.storage.settings import DEFAULT_SMTP_CONNECTIONS
from sandbox.mailsink import MailSink
from tests.job_workers import TALLY_LIMIT, batch_worker, limited_batch_worker
from tests.relays import SlowRelay

WORKER = Path(__file__).resolve().parent / "job_workers.py"


def email(tag: str, i: int, domain: str = "example.com") -> dict[str, Any]:
    return {"template": "welcome", "user_id": f"{tag}{i}", "date": "2026-11-29",
            "to": f"{tag}{i}@{domain}"}


def key_of(payload: dict[str, Any]) -> str:
    return f"email:welcome:{payload['user_id']}:2026-11-29"


def services_for(db: Database, sink: MailSink, lease: float = 30.0) -> Services:
    return Services(
        db=db, store=IdempotencyStore(db, lease_seconds=lease), attempts=AttemptRecorder(db),
        clients={"smtp": SmtpMailer("127.0.0.1", sink.port, log_url=sink.db_url)},
    )


def enqueue(db: Database, job_type: str, payloads: list[dict[str, Any]], key: Any) -> list[int]:
    store = RequestStore(db)
    return [store.enqueue(job_type, key(p), p, queue="light").id for p in payloads]


class LedgerStatements:
    """Counts the statements the idempotency ledger runs (observed on the driver, not faked)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        for name in ("rows", "row", "run"):
            original = getattr(DriverConnection, name)

            def counted(conn: Any, sql: Sql, params: Any, original: Any = original) -> Any:
                if "idempotency_records" in sql.text:
                    self.count += 1
                return original(conn, sql, params)

            monkeypatch.setattr(DriverConnection, name, counted)


def test_a_batch_claims_and_completes_its_keys_in_one_statement_each(
    db: Database, sink: MailSink, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches: a micro-batch that still claims and completes its keys one at a time (the
    ledger's statements grow with the batch), or that sends any mail twice."""
    counter = LedgerStatements(monkeypatch)
    services = services_for(db, sink)
    per_batch = []
    for size in (3, 12):
        ids = enqueue(db, "send_email", [email(f"n{size}-", i) for i in range(size)], key_of)
        before = counter.count
        summary = run_batch(RequestStore(db), ids, services=services, run_id=f"r{size}")
        assert (summary["completed"], summary["failed"]) == (size, 0)
        per_batch.append(counter.count - before)
    # one claim and one completion (one transaction of per-key statements on SQLite)
    if db.is_postgres:
        assert per_batch == [2, 2]
    mails = [m["message_id"] for m in sink.messages()]
    assert len(mails) == 15 and len(set(mails)) == 15


class ProviderReads:
    """Counts the reads of the mail provider's record (the sink's database, observed on
    SQLAlchemy's events of every engine on it, not faked)."""

    def __init__(self, sink: MailSink) -> None:
        self.count = 0
        self.url = str(sink.engine.url)
        event.listen(Engine, "before_cursor_execute", self._seen)

    def _seen(self, conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if str(conn.engine.url) == self.url and statement.lstrip().upper().startswith("SELECT"):
            self.count += 1

    def close(self) -> None:
        event.remove(Engine, "before_cursor_execute", self._seen)


def test_a_batch_looks_its_mails_up_in_one_read_and_sends_none_the_provider_has(
    db: Database, sink: MailSink
) -> None:
    """Catches: a batch that reads the provider's record once per mail (the reads grow with
    the batch), or a batch read that misses a mail the provider already took: a first claim
    whose mail was sent before (a failover rolled back the key that recorded it) must not
    send it again."""
    services = services_for(db, sink)
    reads = ProviderReads(sink)
    try:
        sent_before = email("known", 1)
        SmtpMailer("127.0.0.1", sink.port).send(
            to=sent_before["to"], subject="Welcome", body="sent before the failover",
            message_id=message_id_for(key_of(sent_before)))
        per_batch = []
        for size in (3, 12):
            payloads = [email(f"known{size}-", i) for i in range(size)]
            if size == 3:
                payloads[1] = sent_before
            ids = enqueue(db, "send_email", payloads, key_of)
            before = reads.count
            summary = run_batch(RequestStore(db), ids, services=services, run_id=f"r{size}")
            assert (summary["completed"], summary["failed"]) == (size, 0), summary
            per_batch.append(reads.count - before)
    finally:
        reads.close()
    assert per_batch == [1, 1]
    mails = Counter(m["message_id"] for m in sink.messages())
    assert len(mails) == 15 and set(mails.values()) == {1}


def test_a_batch_sends_its_mails_on_its_connections_at_once(db: Database) -> None:
    """Catches a batch whose mails go out one after another on one connection (it then waits
    for each mail's round trips in turn: a relay 100 ms away holds 50 mails 20 s), or on more
    connections than the mailer's ``connections``: 12 mails to a relay that takes 50 ms over
    each DATA arrive once each, on exactly 3 connections, up to 3 at a time."""
    with SlowRelay(data_delay=0.05) as relay:
        services = Services(
            db=db, store=IdempotencyStore(db), attempts=AttemptRecorder(db),
            clients={"smtp": SmtpMailer("127.0.0.1", relay.port, connections=3)},
        )
        payloads = [email("lane", i) for i in range(12)]
        ids = enqueue(db, "send_email", payloads, key_of)
        summary = run_batch(RequestStore(db), ids, services=services, run_id="lanes")
    assert (summary["completed"], summary["failed"]) == (12, 0), summary
    assert sorted(mid for mid, _ in relay.accepted) == sorted(
        message_id_for(key_of(p)) for p in payloads)
    assert len({peer for _, peer in relay.accepted}) == 3
    assert 2 <= relay.most_at_once <= 3


def test_each_kind_of_failure_stays_with_its_request(db: Database, sink: MailSink) -> None:
    """Catches: a batch whose neighbours are stopped, skipped or dead-lettered by one request's
    failure, or a failure that skips the failure path (request status, attempt outcome)."""
    services = services_for(db, sink)
    requests = RequestStore(db)
    good = [email("ok", i) for i in range(4)]
    done, busy = email("done", 0), email("busy", 0)
    rejected = email("rej", 0, domain="reject.invalid")
    ids = enqueue(db, "send_email", [*good, done, busy, rejected], key_of)
    bad = requests.enqueue("send_email", "email:bad", {"template": "nope"}, queue="light").id
    claim = services.store.begin(key_of(done), payload=validate(done))
    assert isinstance(claim, Claim)
    services.store.complete(claim, {"old": True})
    services.store.begin(key_of(busy), payload=validate(busy))  # another worker's live lease

    summary = run_batch(requests, [*ids, bad], services=services, run_id="mixed")

    assert (summary["completed"], summary["duplicate"], summary["failed"]) == (4, 1, 3)
    assert set(summary["failures"]) == {key_of(busy), key_of(rejected), "email:bad"}
    statuses = {i: requests.get(i).status for i in [*ids, bad]}  # type: ignore[union-attr]
    assert [statuses[i] for i in ids[:5]] == [RequestStatus.COMPLETED] * 5
    assert [statuses[i] for i in (ids[5], ids[6], bad)] == [RequestStatus.FAILED] * 3
    outcomes = {
        key: [r["outcome"] for r in AttemptRecorder(db).for_key(key)]
        for key in [key_of(p) for p in [*good, done, busy, rejected]]
    }
    assert all(outcomes[key_of(p)] == ["completed"] for p in good)
    assert outcomes[key_of(done)] == ["duplicate_suppressed"]
    assert outcomes[key_of(busy)] == ["in_progress_elsewhere"]
    assert outcomes[key_of(rejected)] == ["failed_permanent"]
    rejected_record = services.store.get(key_of(rejected))
    assert rejected_record is not None and rejected_record.status is Status.FAILED
    assert sorted(m["message_id"] for m in sink.messages()) == sorted(
        message_id_for(key_of(p)) for p in good
    )


def test_overlapping_batches_in_several_processes_send_each_mail_once(
    db: Database, db_url: str, sink: MailSink
) -> None:
    """Catches: two batches (in different processes) that both claim a key of their overlap and
    both send it, or a request left neither completed nor failed."""
    payloads = [email("ov", i) for i in range(24)]
    ids = enqueue(db, "send_email", payloads, key_of)
    go = time.time() + 5.0
    specs = [
        {"db_url": db_url, "smtp_port": sink.port, "request_ids": ids[lo:hi], "go": go,
         "run_id": f"p{n}"}
        for n, (lo, hi) in enumerate([(0, 16), (8, 24), (0, 24)])
    ]
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        summaries = pool.map(batch_worker, specs)
    assert sum(s["completed"] + s["duplicate"] for s in summaries) >= 24
    mails = Counter(m["message_id"] for m in sink.messages())
    assert mails == Counter(message_id_for(key_of(p)) for p in payloads)
    for key in map(key_of, payloads):
        assert [r["outcome"] for r in AttemptRecorder(db).for_key(key)].count("completed") == 1
    # losers of a race were marked failed for the DLQ only if nobody completed the key
    assert RequestStore(db).counts()["completed"] == 24


def test_a_batch_killed_after_its_first_send_is_finished_without_a_second_effect(
    db: Database, db_url: str, sink: MailSink
) -> None:
    """Catches: keys claimed by a batch that died staying stuck, or being redone with another
    identity, or a mail sent again: the worker died after the SMTP accept of a mail and before
    recording it (its other lanes' mails under way may have been accepted too, at most one
    each); after the dead batch's short lease expires the next run takes every key over,
    finds those mails at the provider by their Message-IDs (the lookup on takeover) and sends
    only the others: each mail exists once."""
    payloads = [email("crash", i) for i in range(5)]
    ids = enqueue(db, "send_email", payloads, key_of)
    spec = {"db_url": db_url, "smtp_port": sink.port, "request_ids": ids, "lease_seconds": 1.5}
    proc = subprocess.run(
        [sys.executable, str(WORKER), json.dumps(spec)],
        env={**os.environ, "SEKALI_CRASH_AT": "after_send"}, capture_output=True, text=True,
        timeout=180,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    store = IdempotencyStore(db)
    claimed = [store.get(key_of(p)) for p in payloads]
    assert all(r is not None and r.status is Status.IN_PROGRESS for r in claimed)
    assert 1 <= len(sink.messages()) <= DEFAULT_SMTP_CONNECTIONS
    time.sleep(2.0)  # past the dead batch's lease

    summary = run_batch(RequestStore(db), ids, services=services_for(db, sink), run_id="again")

    assert summary["completed"] == 5
    assert Counter(m["message_id"] for m in sink.messages()) == Counter(
        {message_id_for(key_of(p)): 1 for p in payloads}
    )
    for p in payloads:
        record = store.get(key_of(p))
        assert record is not None and record.status is Status.COMPLETED and record.fence == 2
        rows = AttemptRecorder(db).for_key(key_of(p))
        assert [(r["outcome"], r["takeover"]) for r in rows] == [
            ("started", False), ("completed", True)
        ]


def cart(i: int, quantity: int = 1) -> dict[str, Any]:
    return {"cart_id": f"c{i}", "items": [{"sku": "sku-b", "quantity": quantity},
                                          {"sku": "sku-a", "quantity": 1}]}


def test_inventory_batch_commits_its_carts_together_and_a_bad_cart_alone_rolls_back(
    db: Database, db_url: str, sink: MailSink
) -> None:
    """Catches: a batch handler that lets one cart's failure roll back its neighbours, reserves
    a cart without completing its key in the same transaction, or oversells. A batch killed
    before its commit leaves nothing reserved and nothing completed; the rerun does it all."""
    inventory = Inventory(db)
    inventory.set_stock("sku-a", 10)
    inventory.set_stock("sku-b", 10)
    payloads = [cart(0), cart(1), cart(2, quantity=50), cart(3)]  # cart 2 asks too much
    ids = enqueue(db, "reserve_inventory", payloads, lambda p: f"inventory-reserve:{p['cart_id']}")
    spec = {"db_url": db_url, "request_ids": ids, "lease_seconds": 1.5}
    proc = subprocess.run(
        [sys.executable, str(WORKER), json.dumps(spec)],
        env={**os.environ, "SEKALI_CRASH_AT": "before_commit_reservation"},
        capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert inventory.stock("sku-a") == (10, 0) and inventory.stock("sku-b") == (10, 0)
    time.sleep(2.0)

    transactions: set[int] = set()

    def note(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().startswith("INSERT INTO reservations"):
            transactions.add(id(conn.get_transaction()))

    event.listen(db.engine, "before_cursor_execute", note)
    summary = run_batch(RequestStore(db), ids, services=services_for(db, sink), run_id="inv")
    # each cart was taken over from the dead batch, so each ran alone (a crasher among them
    # must not take the others with it again); a fresh batch reserves its carts together
    transactions.clear()
    fresh = enqueue(db, "reserve_inventory", [cart(4), cart(5)],
                    lambda p: f"inventory-reserve:{p['cart_id']}")
    assert run_batch(RequestStore(db), fresh, services=services_for(db, sink))["completed"] == 2
    event.remove(db.engine, "before_cursor_execute", note)
    assert len(transactions) == 1  # a fresh batch reserves its carts in one transaction

    assert (summary["completed"], summary["failed"]) == (3, 1)
    assert "InsufficientStock" in summary["failures"]["inventory-reserve:c2"]
    assert inventory.stock("sku-a") == (10, 5) and inventory.stock("sku-b") == (10, 5)
    with db.statement() as conn:
        rows = conn.execute(text("SELECT cart_id, COUNT(*) FROM reservations GROUP BY cart_id"))
        assert dict(rows.tuples().all()) == {"c0": 2, "c1": 2, "c3": 2, "c4": 2, "c5": 2}
    store = IdempotencyStore(db)
    for i in (0, 1, 3):
        again = store.begin(f"inventory-reserve:c{i}", payload=inventory_job.validate(payloads[i]))
        assert isinstance(again, Completed) and again.result["cart_id"] == f"c{i}"


def test_batches_in_several_processes_never_exceed_a_job_types_concurrency_limit(
    db: Database, db_url: str, redis_url: str, namespace: str
) -> None:
    """Catches a micro-batch whose batch hook makes its effects without the job type's
    concurrency slots (the per-request handlers hold them), or whose lanes split the requests
    of one key between them (two effects at once under the batch's one slot of it): four
    processes run batches whose requests (distinct keys) share two concurrency keys of limit 2,
    and at no moment are more than 2 effects of one key under way."""
    go = time.time() + 6.0
    specs = [
        {"db_url": db_url, "redis_url": redis_url, "namespace": namespace, "go": go,
         "run_id": f"w{w}", "batch": 4,
         "payloads": [{"group": f"g{i % 2}", "n": f"{w}-{i}"} for i in range(12)]}
        for w in range(4)
    ]
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        statuses = pool.map(limited_batch_worker, specs)
    assert [s for each in statuses for s in each] == ["completed"] * 48
    client = redis_client_for(redis_url)
    most = {g: int(client.get(f"{namespace}:tally:max:{g}") or 0) for g in ("g0", "g1")}
    assert 1 <= most["g0"] <= TALLY_LIMIT and 1 <= most["g1"] <= TALLY_LIMIT, most
    client.close()


def test_a_cart_whose_slot_another_worker_holds_waits_out_and_fails_alone(
    db: Database, redis_client: Any, namespace: str, sink: MailSink
) -> None:
    """Catches an inventory batch that reserves a cart while another worker holds the only
    slot of ``cart:{cart_id}``: that cart fails with LimitNotAcquired (transient: replayed by
    the DLQ) and reserves nothing; the batch's other carts complete; and once the slot is free
    the cart goes through."""
    inventory = Inventory(db)
    inventory.set_stock("sku-a", 10)
    inventory.set_stock("sku-b", 10)
    services = services_for(db, sink)
    services.concurrency = ConcurrencyLimits(
        redis_client, wait=0.3, prefix=f"{namespace}:limit:"
    )
    other = services.concurrency.limiter("reserve_inventory", 1).acquire("cart:c1")
    payloads = [cart(0), cart(1), cart(2)]
    ids = enqueue(db, "reserve_inventory", payloads, lambda p: f"inventory-reserve:{p['cart_id']}")

    summary = run_batch(RequestStore(db), ids, services=services, run_id="held")

    assert (summary["completed"], summary["failed"]) == (2, 1)
    assert "LimitNotAcquired" in summary["failures"]["inventory-reserve:c1"]
    with db.statement() as conn:
        rows = conn.execute(text("SELECT DISTINCT cart_id FROM reservations"))
        assert sorted(r[0] for r in rows) == ["c0", "c2"]
    waited = AttemptRecorder(db).for_key("inventory-reserve:c0")[-1]["durations"]
    assert "concurrency_wait" in waited
    other.release()
    again = run_batch(RequestStore(db), [ids[1]], services=services, run_id="free")
    assert again["completed"] == 1 and inventory.stock("sku-a") == (10, 3)


class SlowAnswerSink(MailSink):
    """The sandbox sink that records the first mail, then answers later than the mailer's read
    timeout: the mail was accepted and the sender saw no answer (a lost SMTP reply)."""

    def __init__(self, *args: Any, hold: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hold = hold
        self.answered = threading.Event()

    def record(self, **kwargs: Any) -> None:
        super().record(**kwargs)
        if not self.answered.is_set():
            time.sleep(self.hold)
            self.answered.set()


def test_a_retry_after_a_lost_smtp_answer_asks_the_provider_before_sending(
    db: Database, tmp_path: Path
) -> None:
    """Catches: a plain retry (no takeover) that sends a mail again when the first attempt's
    SMTP answer was lost after the server accepted it: the retry must find the mail at the
    provider by its Message-ID and complete without a second send."""
    sink = SlowAnswerSink(f"sqlite:///{tmp_path / 'slow.db'}", hold=2.5).start()
    try:
        services = Services(
            db=db, store=IdempotencyStore(db, lease_seconds=30.0),
            attempts=AttemptRecorder(db),
            clients={"smtp": SmtpMailer("127.0.0.1", sink.port, timeout=1.0, deadline=5.0,
                                        log_url=sink.db_url)},
        )
        payload = email("lost", 0)
        [rid] = enqueue(db, "send_email", [payload], key_of)
        first = run_batch(RequestStore(db), [rid], services=services, run_id="lost-1")
        assert first["completed"] == 0, first
        assert sink.answered.wait(30)  # the sink answers (late) before the retry
        assert len(sink.messages()) == 1  # accepted, though the sender saw no answer
        second = run_batch(RequestStore(db), [rid], services=services, run_id="lost-2")
        assert second["completed"] == 1, second
        assert [m["message_id"] for m in sink.messages()] == [message_id_for(key_of(payload))]
    finally:
        sink.stop()
