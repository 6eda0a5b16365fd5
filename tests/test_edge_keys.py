"""Keys and ids at the limits, in every script the limits allow, on every path: stored whole,
the effect once, a replay of a completed key a suppressed duplicate, an amend of it refused.

A key of 512 characters (the ``key_length`` limit) in 4-byte characters is 2,024 bytes of UTF-8;
the DLQ used to keep only the first 1,024 of them, so the replay's reset, a replay built from
the record, resolving a completed key, amending and retention's references all went by another
key (a second charge under a second reference). Order ids (200 characters) and correlation ids
(128) in the same scripts travel in HTTP and SMTP headers.

Paths: enqueue and the intake sensor (per request, micro-batch, fan-out), the per-request op,
the DLQ sensor's and the sweep's dead-lettering, plain and bulk replay through the replay
sensor, amend, reconciliation and retention. Real Dagster runs (``execute_in_process`` on a
temporary instance), the sandbox gateway and mail sink, both databases.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from engine import tags as tag
from engine.attempts import AttemptRecorder
from engine.intake import enqueue
from engine.replay import AmendRefused, Selection, amend, bulk_replay
from engine.requests import RequestStatus, RequestStore
from engine.runtime import execute_request
from engine.services import Services
from engine.upkeep.reconciliation import Reconciler
from engine.upkeep.retention import purge_expired
from pipelines.definitions import intake_sensor
from pipelines.domain.mail import message_id_for
from pipelines.domain.payments import HttpPaymentGateway
from pipelines.jobs.payment import reference_for
from pipelines.ops import charge_payment_job, send_email_job
from pipelines.ops.batch import intake_fan_out, intake_micro_batch
from resources.dagster_resources import DlqResource
from resources.dlq import DlqStatus, DlqStore, FailureInfo
from resources.errors import ValidationError
from resources.idempotency import IdempotencyStore
from resources.storage.db import Database
from resources.storage.settings import RetentionSettings
from sandbox.gateway import GatewayServer
from sandbox.mailsink import MailSink
from sensors.dlq import dead_letter_run, sweep
from sensors.intake import RequestsResource
from tests.conftest import IN_CI
from tests.job_workers import dagster_resources, replay_sensor

pytestmark = pytest.mark.dagster

SCRIPTS = {
    "4-byte emoji": "😀🙂",
    "4-byte CJK extension B": "𠀀𠀁𠀂",
    "combining marks": "e\u0301\u0327a\u0308",
    "right to left (Hebrew, Arabic, RLM)": "שלום\u200fمرحبا",
    "Latin-1": "éàü",
    "3-byte (CJK, Devanagari)": "日本語हिन्दी",
}
EDGES = {
    "4-byte (the most bytes a key may hold)": SCRIPTS["4-byte emoji"],
    "every script in one key": "".join(SCRIPTS.values()),
}
"""The end-to-end paths run twice: keys of 4-byte characters (2,024 bytes, the most), and keys
that cycle through every script above (about 1,400 bytes); the store test below draws from
every script and any admitted character."""
KEY_CHARS, ORDER_CHARS, CORRELATION_CHARS = 512, 200, 128


def filled(prefix: str, sample: str, length: int) -> str:
    """``prefix`` and ``sample`` repeated, exactly ``length`` characters."""
    body = "".join(itertools.islice(itertools.cycle(sample), length - len(prefix)))
    return prefix + body


@dataclass(frozen=True)
class Edge:
    """The ids of one script at their limits."""

    script: str
    sample: str

    def key(self, tag_: str) -> str:
        return filled(f"k{tag_}:", self.sample, KEY_CHARS)

    def order(self, tag_: str) -> str:
        return filled(f"o{tag_}-", self.sample, ORDER_CHARS)

    def correlation(self) -> str:
        return filled("c-", self.sample, CORRELATION_CHARS)


@pytest.fixture(params=sorted(EDGES), ids=sorted(EDGES))
def edge(request: pytest.FixtureRequest) -> Edge:
    return Edge(request.param, EDGES[request.param])


@dataclass
class World:
    db: Database
    db_url: str
    gateway: GatewayServer
    sink: MailSink
    instance: dg.DagsterInstance
    resources: dict[str, Any]
    monkeypatch: pytest.MonkeyPatch

    @property
    def requests(self) -> RequestStore:
        return RequestStore(self.db)

    @property
    def dlq(self) -> DlqStore:
        return DlqStore(self.db)

    def tick(self, mode: str) -> list[dg.RunRequest]:
        self.monkeypatch.setenv("SEKALI_INTAKE_MODE", mode)
        context = dg.build_sensor_context(
            instance=self.instance, resources={"requests": self.resources["requests"]}
        )
        result = intake_sensor(context)
        assert isinstance(result, dg.SensorResult)
        return list(result.run_requests or [])

    def run(self, job: dg.JobDefinition, request: dg.RunRequest) -> dg.ExecuteInProcessResult:
        return job.execute_in_process(
            run_config=request.run_config, instance=self.instance,
            tags={**request.tags, "dagster/run_key": request.run_key or ""},
            resources=self.resources, raise_on_error=False,
        )

    def replays(self) -> list[dg.RunRequest]:
        sensor = replay_sensor(name="replay_edge", per_second=50.0, max_per_tick=50)
        context = dg.build_sensor_context(
            instance=self.instance, resources={"dlq": DlqResource(database_url=self.db_url)}
        )
        return list(sensor.evaluate_tick(context).run_requests or [])

    def charges(self, order: str | None = None) -> list[dict[str, Any]]:
        """The gateway's charges (of ``order``: each order of a test has its own amount, so
        a charge under any reference, whichever key made it, is counted)."""
        return [c for c in self.gateway.charges()
                if order is None or c["amount_cents"] == amount_of(order)]

    def columns_hold(self, key: str) -> dict[str, bool]:
        """Whether each table that keeps an idempotency key holds ``key`` whole."""
        queries = {
            "job_requests": "SELECT 1 FROM job_requests WHERE key = :k",
            "idempotency_records": "SELECT 1 FROM idempotency_records WHERE key = :k",
            "job_attempts": "SELECT 1 FROM job_attempts WHERE idempotency_key = :k",
            "dlq_records": "SELECT 1 FROM dlq_records WHERE idempotency_key = :k",
        }
        with self.db.statement() as conn:
            return {table: conn.execute(text(q), {"k": key}).first() is not None
                    for table, q in queries.items()}


@pytest.fixture
def world(db: Database, db_url: str, redis_url: str, namespace: str, redis_client: Any,
          tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    gateway = GatewayServer(f"sqlite:///{tmp_path / 'gateway.db'}").start()
    sink = MailSink(f"sqlite:///{tmp_path / 'sink.db'}").start()
    home = tmp_path / "dagster"
    home.mkdir()
    instance = dg.DagsterInstance.local_temp(str(home))
    resources = dagster_resources(
        db_url=db_url, redis_url=redis_url, namespace=namespace, gateway_url=gateway.url,
        smtp_port=sink.port, settle_seconds=1.0, send_idempotency_key=True,
        retry={"max_attempts": 1},
    )
    resources["requests"] = RequestsResource(database_url=db_url)
    try:
        yield World(db, db_url, gateway, sink, instance, resources, monkeypatch)
    finally:
        instance.dispose()
        sink.stop()
        gateway.stop()


def amount_of(order: str) -> int:
    """Each order's own amount (from its id), so its charges can be told apart at the gateway."""
    return 1000 + sum(order.encode()) % 100_000


def payment(order: str) -> dict[str, Any]:
    return {"order_id": order, "amount_cents": amount_of(order), "currency": "EUR"}


def outcomes(db: Database, key: str) -> list[str]:
    return [a["outcome"] for a in AttemptRecorder(db).for_key(key)]


# -- every way in keeps the whole key -------------------------------------------------------


def test_every_way_in_and_out_of_the_dlq_keeps_the_whole_key(world: World, edge: Edge) -> None:
    """Catches: a DLQ record keeping a key cut at 1,024 bytes (the sensor's, the sweep's and a
    fan-out run's), and a header that cannot carry the script (UnicodeEncodeError, classified
    ``data_bug``). Then a bulk replay charges each order once, and running the replays again
    is a suppressed duplicate."""
    world.gateway.set_faults(error_rate=1.0)  # every charge refused (503): nothing charged
    cid = edge.correlation()
    made = {}
    for mode in ("per_request", "micro_batch", "fan_out"):
        key, order = edge.key(mode[:3]), edge.order(mode[:3])
        enqueue("charge_payment", payment(order), key=key, correlation_id=cid, db=world.db)
        (request,) = world.tick(mode)
        if mode == "per_request":
            assert request.tags[tag.KEY] == key and request.run_key == f"intake:{key}"
        job = {"per_request": charge_payment_job, "micro_batch": intake_micro_batch,
               "fan_out": intake_fan_out}[mode]
        result = world.run(job, request)
        assert result.success is (mode == "micro_batch")  # a batch step succeeds regardless
        made[mode] = (key, order, result.run_id)
    store = world.dlq
    for mode in ("per_request", "fan_out"):  # the DLQ sensor's way
        run = world.instance.get_run_by_id(made[mode][2])
        assert run is not None
        dead_letter_run(world.instance, run, store, actor="dlq_sensor")
    sweep(world.instance, store, None)  # the micro-batch's failed request
    records = {r.idempotency_key: r for r in store.list_records()}
    for mode, (key, _order, _run) in made.items():
        assert key in records, f"{mode}: the record's key is not the key that ran"
        assert records[key].error_class == "transient", (mode, records[key].error_class)
        assert all(world.columns_hold(key).values()), (mode, world.columns_hold(key))
    assert world.charges() == []

    world.gateway.set_faults(error_rate=0.0)
    chosen = bulk_replay(store, Selection(ids=[r.id for r in records.values()]), actor="test",
                         reason="gateway back")
    assert chosen.chosen == 3, [(d.record.id, d.reason) for d in chosen.decisions]
    replays = world.replays()
    assert len(replays) == 3
    jobs = {job.name: job for job in (charge_payment_job, intake_fan_out)}
    for request in replays:
        assert world.run(jobs[request.job_name or ""], request).success
    for mode, (key, order, _run) in made.items():
        (charge,) = world.charges(order)
        assert charge["reference"] == reference_for(key), mode
        assert charge["idempotency_key"] == key and charge["correlation_id"] == cid, mode
    for request in replays:  # the same replays again: suppressed duplicates
        assert world.run(jobs[request.job_name or ""], request).success
    for mode, (key, order, _run) in made.items():
        assert len(world.charges(order)) == 1, mode
        assert outcomes(world.db, key)[-2:] == ["completed", "duplicate_suppressed"], mode


# -- a charge whose answer was lost, through the sweep and a replay --------------------------


def test_a_charge_whose_answer_was_lost_is_charged_once_through_the_dlq(
    world: World, edge: Edge
) -> None:
    """Catches: the issue's second charge. A micro-batch charge whose answer the provider
    dropped (keys ignored) is swept into the DLQ; its replay, built from the record, ran under
    the cut key: another claim, another reference, a lookup that found nothing, a second
    charge. Now the replay finds the first charge, and running it again is a duplicate."""
    world.gateway.set_faults(drop_after_charge_rate=1.0, honour_idempotency_key=False)
    key, order = edge.key("lost"), edge.order("lost")
    enqueue("charge_payment", payment(order), key=key, db=world.db)
    (batch,) = world.tick("micro_batch")
    assert world.run(intake_micro_batch, batch).success
    assert len(world.charges(order)) == 1  # charged; the answer never came
    (failed,) = world.requests.find(status=[RequestStatus.FAILED])
    assert failed.error_class == "transient"
    sweep(world.instance, world.dlq, None)
    (record,) = world.dlq.list_records()
    assert record.idempotency_key == key and record.run_config == {}

    world.gateway.set_faults(drop_after_charge_rate=0.0)
    time.sleep(1.1)  # the settle window (1 s here): a lookup by reference is now conclusive
    world.dlq.request_replay([record.id], actor="test", idempotency=IdempotencyStore(world.db))
    (replay,) = world.replays()
    assert replay.tags[tag.KEY] == key
    assert world.run(charge_payment_job, replay).success
    assert world.run(charge_payment_job, replay).success  # a replay of a completed key
    assert len(world.charges(order)) == 1
    assert outcomes(world.db, key)[-2:] == ["completed", "duplicate_suppressed"]
    with world.db.statement() as conn:
        status = conn.execute(text("SELECT payment_status FROM orders WHERE order_id = :o"),
                              {"o": order}).scalar()
    assert status == "paid"


# -- a key completed elsewhere ------------------------------------------------------------------


def test_a_key_completed_elsewhere_is_not_amended_nor_purged_and_its_record_resolves(
    world: World, edge: Edge
) -> None:
    """Catches: with the record's key cut short, an amend (``dlq replay --patch``) accepted for
    a key that completed, retention purging the completed key while its record is open (a later
    replay would repeat the effect), and reconciliation leaving the record open."""
    world.gateway.set_faults(error_rate=1.0)
    key, order = edge.key("done"), edge.order("done")
    enqueue("charge_payment", payment(order), key=key, db=world.db)
    (request,) = world.tick("per_request")
    failed = world.run(charge_payment_job, request)
    assert not failed.success
    run = world.instance.get_run_by_id(failed.run_id)
    assert run is not None
    (recorded,) = dead_letter_run(world.instance, run, world.dlq, actor="dlq_sensor")
    record = recorded.record
    assert record.idempotency_key == key and record.status is DlqStatus.OPEN

    world.gateway.set_faults(error_rate=0.0)
    by_hand = dg.RunRequest(run_key=None, run_config={"ops": {"charge_payment_op": {"config": {
        "payload": payment(order), "key": key}}}})  # a Launchpad run: no request id
    assert world.run(charge_payment_job, by_hand).success
    assert len(world.charges(order)) == 1
    # the run by hand carried the request's key and payload: it ran as that request
    assert world.requests.get(record.request_id or 0).status is RequestStatus.COMPLETED  # type: ignore[union-attr]

    with pytest.raises(AmendRefused, match="completed"):  # the key or its request
        amend(world.dlq, record.id, {"amount_cents": amount_of(order) + 1}, actor="test")
    world.requests.mark_completed(record.request_id or 0)  # only the DLQ record keeps the key

    later = time.time() + 40 * 86400
    reconciler = Reconciler(world.db, store=IdempotencyStore(world.db), dlq=world.dlq,
                            retention=RetentionSettings(), clock=lambda: later)
    purge_expired(world.db, reconciler.expiries(), RetentionSettings())
    assert key in IdempotencyStore(world.db).records([key]), "purged while its record is open"

    report = Reconciler(world.db, store=IdempotencyStore(world.db), dlq=world.dlq).run()
    assert record.id in report.resolved_dead_letters
    assert world.dlq.get(record.id).status is DlqStatus.RESOLVED
    assert len(world.charges(order)) == 1


# -- an amended replay at the limit ----------------------------------------------------------------


def test_an_amended_version_of_a_key_at_the_limit_runs_once(world: World, edge: Edge) -> None:
    """The version's key (``<key>#v2``) is kept whole like its base: a mail refused for good
    (5xx) is amended with a corrected address and sent once under the version, and the base
    key stays failed (never sent). A base key leaves room for the version mark: at the very
    limit the version is refused naming ``key_length``."""
    key = edge.key("amend")[: KEY_CHARS - 3]
    mail = {"template": "welcome", "user_id": "u-a", "date": "2026-11-29",
            "to": "bob@reject.invalid"}
    enqueue("send_email", mail, key=key, db=world.db)
    (request,) = world.tick("per_request")
    assert not world.run(send_email_job, request).success  # 550: permanent, dead-lettered
    run = world.instance.get_run_by_id(request_run_id(world, key))
    assert run is not None
    (recorded,) = dead_letter_run(world.instance, run, world.dlq, actor="dlq_sensor")
    assert recorded.record.idempotency_key == key
    made = amend(world.dlq, recorded.record.id, {"to": "bob@example.com"}, actor="test",
                 reason="typo in the domain")
    assert made.key == f"{key}#v2" and made.previous_key == key
    (version,) = world.tick("per_request")
    assert version.tags[tag.KEY] == made.key
    assert world.run(send_email_job, version).success
    assert world.run(send_email_job, version).success  # again: a duplicate
    (sent,) = world.sink.messages()
    assert sent["message_id"] == message_id_for(made.key)
    assert outcomes(world.db, made.key) == ["completed", "duplicate_suppressed"]
    assert IdempotencyStore(world.db).records([key])[key].status == "failed"
    enqueue("send_email", mail, key=edge.key("full"), db=world.db)
    (full,) = world.tick("per_request")
    world.run(send_email_job, full)
    run = world.instance.get_run_by_id(request_run_id(world, edge.key("full")))
    assert run is not None
    (at_limit,) = dead_letter_run(world.instance, run, world.dlq, actor="dlq_sensor")
    with pytest.raises(ValidationError, match="key_length"):
        amend(world.dlq, at_limit.record.id, {"to": "bob@example.com"}, actor="test")


def request_run_id(world: World, key: str) -> str:
    found = world.requests.get_by_key(key)
    assert found is not None and found.run_id is not None
    return found.run_id


# -- reconciliation sees a charge under another reference ---------------------------------------


def test_double_charged_sees_a_charge_under_another_reference_of_the_order(
    world: World, edge: Edge
) -> None:
    """Catches: ``double_charged`` reading only the order's current reference, so the charge
    an older release made under a cut key's reference (and a second one under the whole
    key's) went unseen."""
    order = edge.order("two")
    key = edge.key("two")
    cut = key.encode()[:1024].decode("utf-8", "ignore")  # what an older release replayed under
    world.gateway.set_faults(drop_after_charge_rate=1.0, honour_idempotency_key=False)
    enqueue("charge_payment", payment(order), key=cut, db=world.db)
    (first,) = world.tick("per_request")
    world.run(charge_payment_job, first)  # charged under the cut key; the answer dropped
    world.gateway.set_faults(drop_after_charge_rate=0.0)
    client = HttpPaymentGateway(world.gateway.url, send_idempotency_key=False)
    second = client.charge(reference=reference_for(key), amount_cents=amount_of(order),
                           currency="EUR", idempotency_key=key)
    with world.db.transaction() as conn:  # the order as the double-charging replay left it
        conn.execute(text("UPDATE orders SET payment_status = 'paid', charge_id = :c,"
                          " payment_reference = :r, updated_at = :t WHERE order_id = :o"),
                     {"c": second.charge_id, "r": reference_for(key), "o": order,
                      "t": time.time() - 3600})
    assert len(world.charges(order)) == 2
    report = Reconciler(world.db, store=IdempotencyStore(world.db), dlq=world.dlq,
                        clients={"payment_gateway": client}).run()
    assert report.found["double_charged"] == 1 and report.fixed["double_charged"] == 1
    (action,) = [a for a in report.actions if a.startswith("compensate:refund-pending:")]
    assert action.endswith(":" + [c["charge_id"] for c in world.charges(order)
                                  if c["charge_id"] != second.charge_id][0])


# -- headers ------------------------------------------------------------------------------------


def test_a_header_value_with_cr_lf_is_refused_and_nothing_is_marked_sent(world: World) -> None:
    """Catches: a control character in a value bound for an HTTP header failing inside urllib3
    after the order was written down as sent (``charged_not_confirmed``, ``charge_sent_at``):
    every retry then waited out the settle window for a send that never began."""
    services = Services(db=world.db, store=IdempotencyStore(world.db),
                        attempts=AttemptRecorder(world.db),
                        clients={"payment_gateway": HttpPaymentGateway(world.gateway.url)})
    with pytest.raises(ValidationError) as refused:
        execute_request("charge_payment", payment("o-crlf"), services=services, key="k-crlf",
                        correlation_id="c\r\nX-Injected: 1")
    assert refused.value.field == "correlation_id"
    assert world.charges() == []
    with world.db.statement() as conn:
        row = conn.execute(text("SELECT payment_status, charge_sent_at FROM orders"
                                " WHERE order_id = 'o-crlf'")).one()
    assert row.payment_status != "charged_not_confirmed" and row.charge_sent_at is None


def test_mail_headers_refuse_cr_lf_and_a_second_recipient_and_keep_the_script(
    world: World, edge: Edge
) -> None:
    """Catches: CR/LF in a template value ending the headers early (no Message-ID at the sink,
    the dedupe evidence gone), a comma in ``to`` making one mail two RCPT TO, a correlation id
    outside ASCII failing the send. One mail per key, its Message-ID from the whole key, sent
    once through the micro-batch and once more as a duplicate that sends nothing."""
    mail = {"template": "receipt", "user_id": "u-1", "date": "2026-11-29",
            "to": "u1@example.com", "context": {"order_id": "o-1\r\nBcc: x@example.com"}}
    with pytest.raises(ValidationError) as crlf:
        enqueue("send_email", mail, db=world.db)
    assert crlf.value.field == "context.order_id"
    for to in ("a@example.com, b@example.com", "a@example.com\r\nBcc: b@example.com",
               "Ann <a@example.com>"):
        with pytest.raises(ValidationError) as bad:
            enqueue("send_email", {**mail, "context": {}, "to": to}, db=world.db)
        assert bad.value.field == "to"
    key = edge.key("mail")
    cid = edge.correlation()
    body_only = {"order_id": "o-1", "note": "line one\r\nline two"}  # reaches the body only
    enqueue("send_email", {**mail, "context": body_only}, key=key, correlation_id=cid,
            db=world.db)
    (batch,) = world.tick("micro_batch")
    assert world.run(intake_micro_batch, batch).success
    (sent,) = world.sink.messages()
    assert sent["message_id"] == message_id_for(key) and sent["rcpt_tos"] == ["u1@example.com"]
    assert sent["correlation_id"] == cid
    again = dg.RunRequest(run_key=None, run_config={"ops": {"send_email_op": {"config": {
        "payload": {**mail, "context": body_only}, "key": key}}}})
    assert world.run(send_email_job, again).success
    assert len(world.sink.messages()) == 1
    assert outcomes(world.db, key)[-1] == "duplicate_suppressed"


# -- the stores, for any key the boundary admits -------------------------------------------------

_ADMITTED = st.characters(exclude_categories=("Cs", "Cc"))
KEYS = st.one_of(
    st.text(_ADMITTED, min_size=1, max_size=KEY_CHARS),
    st.sampled_from(sorted(SCRIPTS.values())).map(lambda s: filled("k:", s, KEY_CHARS)),
)
PROFILE = settings(max_examples=300 if IN_CI else 60, deadline=None, database=None,
                   suppress_health_check=list(HealthCheck))


def test_any_admitted_key_is_stored_whole_and_found_by_every_lookup(db: Database) -> None:
    """Catches: any store cutting, escaping or normalising a key the boundary admits (the DLQ
    cut it at 1,024 bytes): the request, the ledger, the DLQ record and retention's reference
    to it must all name the same key."""
    requests, ledger, dlq = RequestStore(db), IdempotencyStore(db), DlqStore(db)
    seen: set[str] = set()

    @PROFILE
    @given(key=KEYS)
    def example(key: str) -> None:
        if key in seen:
            return
        seen.add(key)
        payload = payment(f"o{len(seen)}")
        made = enqueue("charge_payment", payload, key=key, db=db)
        stored = requests.get(made.id)
        assert stored is not None and stored.key == key
        claim = ledger.begin(key, payload=payload)
        ledger.complete(claim, {"ok": True})  # type: ignore[arg-type]
        recorded = dlq.record_failure(FailureInfo(
            job_type="charge_payment", dedupe_key=f"request:{made.id}",
            error_type="E", message="m", run_id=f"r{len(seen)}", idempotency_key=key,
            request_id=made.id))
        assert recorded.record.idempotency_key == key
        with db.statement() as conn:
            kept = conn.execute(
                text("SELECT key FROM idempotency_records WHERE key = :k AND "
                     + dlq.unresolved_key_reference("idempotency_records.key")),
                {"k": key},
            ).scalar()
        assert kept == key
        assert key in ledger.records([key])

    example()
    assert len(seen) > 10
