"""Cancelling a request: queued or claimed-not-started ones never run (intake, every run path,
replays), running ones stop at their next cancel point and never between a send and its record,
completed ones are refused; each cancel says who, why and when.

Real SQLite and Postgres, the sandbox mail sink and payment gateway, several processes for the
races.
"""

from __future__ import annotations

import multiprocessing
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from engine import Keying, Queue, Running
from engine.attempts import AttemptRecorder
from engine.failures import FailurePath
from engine.registry import JOB_TYPES
from engine.requests import CancelState, RequestStatus, RequestStore, cancel_requests
from engine.runtime import execute_request
from engine.services import Services
from engine.step import run_batch
from pipelines.domain.mail import SmtpMailer, message_id_for
from resources.dlq import DlqStatus, DlqStore, FailureClass, FailureInfo
from resources.errors import (
    PermanentJobError,
    RequestCancelled,
    StoredFailure,
    TransientJobError,
)
from resources.idempotency import IdempotencyStore
from resources.storage.db import Database
from sandbox.mailsink import MailSink
from tests.cancel_workers import canceller, intake_worker


def email(i: int) -> dict[str, Any]:
    return {"template": "welcome", "user_id": f"c{i}", "date": "2026-11-29",
            "to": f"c{i}@example.com"}


def key_of(payload: dict[str, Any]) -> str:
    return f"email:welcome:{payload['user_id']}:2026-11-29"


def enqueue(db: Database, n: int) -> list[int]:
    store = RequestStore(db)
    return [store.enqueue("send_email", key_of(p), p, queue="light").id
            for p in map(email, range(n))]


def services_for(db: Database, sink: MailSink) -> Services:
    return Services(db=db, store=IdempotencyStore(db), attempts=AttemptRecorder(db),
                    clients={"smtp": SmtpMailer("127.0.0.1", sink.port)})


def run_one(store: RequestStore, services: Services, request_id: int) -> str:
    """What the per-request op does with a request: take it, run it, settle it."""
    request = store.get(request_id)
    assert request is not None
    if not store.mark_running(request_id, run_id="r"):
        return "not run"
    path = FailurePath(retries_here=False)
    try:
        execute_request(request.job_type, request.payload, services=services, key=request.key,
                        request_id=request_id, decide=path.outcome)
    except Exception as exc:  # noqa: BLE001 - every failure settles as the worker's would
        path.settle_request(store, request_id, exc, run_id="r")
        return type(exc).__name__
    store.mark_completed(request_id, run_id="r")
    return "completed"


def test_a_cancel_is_decided_by_where_the_request_is(db: Database) -> None:
    """Catches: a pending or claimed request that still runs after its cancel, a completed one
    that reads as cancelled, a failed one a replay requeues, a running one whose cancel dangles
    after it completed, and a cancel that does not keep who, why and when."""
    store = RequestStore(db)
    pending, claimed, done, failed, running = enqueue(db, 5)
    assert {r.id for r in store.claim_for_launch(1, relaunch_after=3600)} == {pending}
    store.mark_completed(done)
    store.mark_running(failed)
    store.mark_failed(failed, "GatewayRejected: declined")
    store.mark_running(running)
    # the claim above took the oldest; "pending" is now launched, and "claimed" still pending:
    # both are not started
    decided = {i: store.cancel(i, by="ops@example", reason="sent by mistake")
               for i in (pending, claimed, done, failed, running)}
    assert {i: d.state for i, d in decided.items()} == {
        pending: CancelState.CANCELLED, claimed: CancelState.CANCELLED,
        done: CancelState.REFUSED, failed: CancelState.CANCELLED,
        running: CancelState.REQUESTED,
    }
    assert "completed" in decided[done].detail
    assert store.claim_for_launch(10, relaunch_after=0) == []  # launched ones are re-claimable
    assert not store.mark_running(pending) and not store.mark_running(claimed)
    assert not store.requeue(failed)  # a replay requeues it no more
    assert store.get(done).status is RequestStatus.COMPLETED  # type: ignore[union-attr]

    store.mark_completed(running)  # it completed before any cancel point
    after = store.get(running)
    assert after is not None and after.cancel_state is CancelState.REFUSED
    assert "completed before" in (after.cancel_detail or "")

    kept = store.get(pending)
    assert kept is not None and kept.status is RequestStatus.CANCELLED
    assert (kept.cancel_by, kept.cancel_reason) == ("ops@example", "sent by mistake")
    assert kept.cancel_requested_at and kept.cancel_decided_at
    again = store.cancel(pending, by="someone else", reason="twice")
    assert not again.new and again.state is CancelState.CANCELLED
    assert store.get(pending).cancel_by == "ops@example"  # type: ignore[union-attr]
    stats = store.cancel_stats(0.0)
    assert stats == {"cancelled": 3, "refused": 2, "requested": 0}


def test_cancel_by_key_and_unknown_references(db: Database) -> None:
    """Catches: the Python call not finding a request by its key, or failing as a whole on one
    unknown reference."""
    (request_id,) = enqueue(db, 1)
    store = RequestStore(db)
    first, unknown = cancel_requests(store, [key_of(email(0)), "nope"], by="t", reason="r")
    assert not isinstance(first, KeyError) and first.request.id == request_id
    assert first.state is CancelState.CANCELLED
    assert isinstance(unknown, KeyError)


def test_cancelling_a_dead_lettered_request_closes_its_dead_letter(db: Database) -> None:
    """Catches: a cancelled request whose open dead letter still offers a replay."""
    (request_id,) = enqueue(db, 1)
    store = RequestStore(db)
    store.mark_running(request_id)
    store.mark_failed(request_id, "GatewayUnavailable: 503")
    dlq = DlqStore(db)
    record = dlq.record_failure(FailureInfo(
        job_type="send_email", dedupe_key=f"request:{request_id}", error_type="GatewayUnavailable",
        message="503", run_id="r-1", request_id=request_id, idempotency_key=key_of(email(0)),
        error_class=FailureClass.TRANSIENT,
    )).record
    (decision,) = cancel_requests(store, [request_id], by="ops", reason="duplicate order")
    assert not isinstance(decision, KeyError) and decision.state is CancelState.CANCELLED
    closed = dlq.get(record.id)
    assert closed.status is DlqStatus.DISCARDED
    assert "cancelled: duplicate order" in dlq.audit(record.id)[-1]["detail"]


def test_no_run_path_runs_a_cancelled_request(db: Database, sink: MailSink) -> None:
    """Catches: a cancelled request that still sends through a micro-batch run, a per-request
    run, or a run launched under its key (a replay, a Launchpad run)."""
    store = RequestStore(db)
    services = services_for(db, sink)
    ids = enqueue(db, 3)
    for request_id in ids:
        store.cancel(request_id, by="t", reason="r")
    assert run_batch(store, ids[:2], services=services)["skipped"] == 2
    assert run_one(store, services, ids[2]) == "not run"
    with pytest.raises(RequestCancelled):  # by key, as a replay or a Launchpad run would
        execute_request("send_email", email(2), services=services, key=key_of(email(2)))
    with pytest.raises(StoredFailure):  # and the key stays closed afterwards
        execute_request("send_email", email(2), services=services, key=key_of(email(2)))
    assert sink.messages() == []


def test_a_running_request_stops_at_its_next_cancel_point(db: Database, sink: MailSink) -> None:
    """Catches: a running request that sends after a cancel asked before its send, or a
    cancelled request that does not say where it stopped."""
    store = RequestStore(db)
    services = services_for(db, sink)
    (request_id,) = enqueue(db, 1)
    store.mark_running(request_id)
    assert store.cancel(request_id, by="t", reason="r").state is CancelState.REQUESTED
    assert run_one(store, services, request_id) == "RequestCancelled"
    request = store.get(request_id)
    assert request is not None and request.status is RequestStatus.CANCELLED
    assert request.cancel_state is CancelState.CANCELLED
    assert "stopped at start" in (request.cancel_detail or "")
    assert sink.messages() == []


@pytest.fixture
def probe(db: Database) -> Any:
    """A job type with two phases, each written with a checkpoint, and a downstream call
    between them; ``hooks`` run at named moments (a cancel arriving there)."""
    from engine import JobContext, JobType

    hooks: dict[str, Callable[[], None]] = {}
    effects: list[str] = []

    def handler(ctx: JobContext, p: dict[str, Any]) -> dict[str, Any]:
        hooks.get("before_reserve", lambda: None)()
        with ctx.transaction("reserve") as conn:
            ctx.checkpoint("reserved", None, conn=conn)
        effects.append("reserved")
        hooks.get("before_send", lambda: None)()
        ctx.confirm_lease()
        hooks.get("after_confirm", lambda: None)()
        effects.append("sent")
        hooks.get("after_send", lambda: None)()
        with ctx.transaction("record") as conn:
            ctx.checkpoint("recorded", None, conn=conn)
        effects.append("recorded")
        return {"ok": True}

    JOB_TYPES["cancel_probe"] = JobType(
        name="cancel_probe",
        queue=Queue.LIGHT,
        validate=dict,
        handler=handler,
        side_effect=True,
        keying=Keying(key_for=lambda p: f"probe:{p['n']}", resource_id=lambda p: str(p["n"])),
        running=Running(max_runtime_seconds=60),
    )
    try:
        yield hooks, effects
    finally:
        del JOB_TYPES["cancel_probe"]


@pytest.mark.parametrize(("moment", "state", "effects"), [
    ("before_reserve", CancelState.CANCELLED, []),
    ("before_send", CancelState.CANCELLED, ["reserved"]),
    ("after_send", CancelState.REFUSED, ["reserved", "sent", "recorded"]),
])
def test_a_cancel_is_honoured_only_before_a_send(
    db: Database, probe: Any, moment: str, state: CancelState, effects: list[str]
) -> None:
    """Catches: a cancel that stops an attempt between a downstream call and its record (the
    call's outcome would be lost), or one that lets the next phase run after it was asked."""
    hooks, done = probe
    store = RequestStore(db)
    request_id = store.enqueue("cancel_probe", "probe:1", {"n": 1}, queue="light").id
    hooks[moment] = lambda: store.cancel(request_id, by="t", reason="r")
    services = Services(db=db, store=IdempotencyStore(db), attempts=AttemptRecorder(db))
    outcome = run_one(store, services, request_id)
    request = store.get(request_id)
    assert request is not None
    assert (request.cancel_state, done) == (state, effects)
    if state is CancelState.CANCELLED:
        assert outcome == "RequestCancelled" and request.status is RequestStatus.CANCELLED
        assert f"done before it: {', '.join(effects) or 'nothing'}" in (
            request.cancel_detail or "")
    else:
        assert outcome == "completed" and request.status is RequestStatus.COMPLETED


def _probe_request(db: Database, n: int) -> tuple[RequestStore, Services, int]:
    store = RequestStore(db)
    request_id = store.enqueue("cancel_probe", f"probe:{n}", {"n": n}, queue="light").id
    services = Services(db=db, store=IdempotencyStore(db), attempts=AttemptRecorder(db))
    return store, services, request_id


def _open_dead_letters(db: Database, request_id: int) -> list[Any]:
    return [r for r in DlqStore(db).list_records(request_id=request_id)
            if r.status is DlqStatus.OPEN]


def _duplicate_gives_up_then_cancel(
    store: RequestStore, services: Services, request_id: int, decided: list[Any]
) -> Callable[[], None]:
    """A second delivery of the running request takes its row, finds the key held by the
    first and gives up (a micro-batch never retries in the step): the request reads
    ``failed``. Then the operator cancels it."""
    def hook() -> None:
        assert run_one(store, services, request_id) == "AlreadyInProgress"
        assert store.get(request_id).status is RequestStatus.FAILED  # type: ignore[union-attr]
        decided.extend(cancel_requests(store, [request_id], by="ops", reason="mistake"))
    return hook


def test_a_cancel_while_another_delivery_holds_the_key_waits_for_that_holder(
    db: Database, probe: Any
) -> None:
    """Regression caught (the model's ``finding_cancel``): a failed request was cancelled at
    once ("no attempt is running") while the first delivery still held its key past its cancel
    point; that delivery then sent: a cancelled request with an effect made after the cancel.
    The cancel of a request whose key a live holder holds is only requested: the holder
    completes and the cancel is refused."""
    hooks, done = probe
    store, services, request_id = _probe_request(db, 1)
    decided: list[Any] = []
    hooks["after_confirm"] = _duplicate_gives_up_then_cancel(store, services, request_id,
                                                             decided)
    outcome = run_one(store, services, request_id)
    request = store.get(request_id)
    assert request is not None
    assert [d.state for d in decided] == [CancelState.REQUESTED], decided
    assert (outcome, done) == ("completed", ["reserved", "sent", "recorded"])
    assert request.status is RequestStatus.COMPLETED
    assert request.cancel_state is CancelState.REFUSED


def test_a_requested_cancel_ends_cancelled_when_the_holder_gives_up(
    db: Database, probe: Any
) -> None:
    """Catches a cancel left ``requested`` for good, or a dead letter left open on a cancelled
    request: the holder the cancel waited for fails (permanently, before its send); its
    failure path finds the key free and ends the request ``cancelled``, its dead letters
    closed."""
    hooks, done = probe
    store, services, request_id = _probe_request(db, 2)
    decided: list[Any] = []
    cancel = _duplicate_gives_up_then_cancel(store, services, request_id, decided)

    def cancel_then_fail() -> None:
        cancel()
        raise PermanentJobError("the downstream refused the request")

    hooks["before_send"] = cancel_then_fail
    assert run_one(store, services, request_id) == "PermanentJobError"
    request = store.get(request_id)
    assert request is not None
    assert [d.state for d in decided] == [CancelState.REQUESTED], decided
    assert (request.status, request.cancel_state) == (RequestStatus.CANCELLED,
                                                      CancelState.CANCELLED)
    assert "sent" not in done
    assert _open_dead_letters(db, request_id) == []


def test_a_cancel_waiting_for_a_holder_that_died_ends_once_its_lease_ran_out(
    db: Database,
) -> None:
    """Catches a cancel that trusts a dead holder's row forever, or one that ignores a live
    lease: the key's holder dies (no failure path runs); while its lease lasts a cancel of
    the failed request is only requested, and asked again once the lease ran out (judged on
    the cancel's clock, as a takeover judges it) it cancels the request and closes its dead
    letter."""
    now = [1_000.0]
    store = RequestStore(db, clock=lambda: now[0])
    request_id = store.enqueue("send_email", key_of(email(7)), email(7), queue="light").id
    holder = IdempotencyStore(db, lease_seconds=30.0, clock=lambda: now[0])
    holder.begin(key_of(email(7)), payload=email(7))  # then it dies, holding the key
    store.mark_running(request_id)
    store.mark_failed(request_id, "AlreadyInProgress: a second delivery gave up")
    DlqStore(db).record_failure(FailureInfo(
        job_type="send_email", dedupe_key=f"request:{request_id}",
        error_type="AlreadyInProgress", message="held", run_id="r-2", request_id=request_id,
        idempotency_key=key_of(email(7)), error_class=FailureClass.TRANSIENT,
    ))
    (first,) = cancel_requests(store, [request_id], by="ops", reason="mistake")
    assert not isinstance(first, KeyError) and first.state is CancelState.REQUESTED
    assert "holds its key" in first.detail
    now[0] += 31.0
    (again,) = cancel_requests(store, [request_id], by="ops", reason="mistake")
    assert not isinstance(again, KeyError) and again.new
    assert again.state is CancelState.CANCELLED
    assert store.get(request_id).status is RequestStatus.CANCELLED  # type: ignore[union-attr]
    assert _open_dead_letters(db, request_id) == []


@pytest.mark.dagster
def test_the_dlq_sweep_ends_a_cancel_whose_holder_died(db: Database) -> None:
    """Catches a cancel left ``requested`` for good when nobody asks again: the holder the
    cancel waited for dies (no failure path runs); once its lease ran out, the DLQ sweep ends
    the request ``cancelled`` and closes its dead letter."""
    import dagster as dg

    from sensors.dlq import sweep

    store = RequestStore(db)
    request_id = store.enqueue("send_email", key_of(email(8)), email(8), queue="light").id
    began = time.time()
    holder = IdempotencyStore(db, lease_seconds=5.0, clock=lambda: began)
    holder.begin(key_of(email(8)), payload=email(8))  # then it dies, holding the key
    store.mark_running(request_id)
    store.mark_failed(request_id, "AlreadyInProgress: a second delivery gave up")
    DlqStore(db).record_failure(FailureInfo(
        job_type="send_email", dedupe_key=f"request:{request_id}",
        error_type="AlreadyInProgress", message="held", run_id="r-2", request_id=request_id,
        idempotency_key=key_of(email(8)), error_class=FailureClass.TRANSIENT,
    ))
    (asked,) = cancel_requests(store, [request_id], by="ops", reason="mistake")
    assert not isinstance(asked, KeyError) and asked.state is CancelState.REQUESTED
    with dg.DagsterInstance.ephemeral() as instance:
        sweep(instance, DlqStore(db), None)  # the lease still runs: nothing ends
        assert store.get(request_id).cancel_state is CancelState.REQUESTED  # type: ignore[union-attr]
        time.sleep(max(0.0, began + 5.0 - time.time()) + 0.1)
        sweep(instance, DlqStore(db), None)
    request = store.get(request_id)
    assert request is not None and request.status is RequestStatus.CANCELLED
    assert request.cancel_state is CancelState.CANCELLED
    assert "ended" in (request.cancel_detail or "")
    assert _open_dead_letters(db, request_id) == []


def test_a_cancel_stops_a_send_after_an_earlier_attempts_recovery_point(
    db: Database, probe: Any
) -> None:
    """Regression caught (the model's ``finding_cancel``, second trail): a duplicate delivery
    took the running request; the first attempt wrote its first phase (a recovery point) and
    failed, failing the request; the cancel found it failed and its key free and cancelled it
    at once; the duplicate then claimed the key, skipped every cancel point because of the
    earlier recovery point, and sent. The cancel point right before a downstream call is
    skipped only once this attempt may have sent."""
    hooks, done = probe
    store, services, request_id = _probe_request(db, 3)

    def duplicate_takes_it_then_fail() -> None:
        del hooks["before_send"]
        assert store.mark_running(request_id, run_id="duplicate")
        raise TransientJobError("the downstream is away")

    hooks["before_send"] = duplicate_takes_it_then_fail
    assert run_one(store, services, request_id) == "TransientJobError"
    (decided,) = cancel_requests(store, [request_id], by="ops", reason="mistake")
    assert not isinstance(decided, KeyError) and decided.state is CancelState.CANCELLED
    with pytest.raises(RequestCancelled):  # the duplicate's op, which had taken the row
        execute_request("cancel_probe", {"n": 3}, services=services, key="probe:3",
                        request_id=request_id)
    request = store.get(request_id)
    assert request is not None and request.status is RequestStatus.CANCELLED
    assert done.count("sent") == 0, done


@pytest.mark.parametrize("batch", [False, True], ids=["per_request", "micro_batch"])
def test_cancel_racing_claims_and_runs_in_several_processes(
    db: Database, db_url: str, sink: MailSink, batch: bool
) -> None:
    """Catches: a request that both reads cancelled and sent its mail, a completed request whose
    cancel reads anything but refused, and a cancel left undecided: two intake workers (claim,
    take, run, settle) and two cancellers in four processes, on overlapping requests."""
    ids = enqueue(db, 30)
    go = time.time() + 4.0
    workers = [{"db_url": db_url, "smtp_port": sink.port, "go": go, "n": n, "batch": batch}
               for n in range(2)]
    cancels = [{"db_url": db_url, "go": go, "n": 0, "ids": ids[::2]},
               {"db_url": db_url, "go": go, "n": 1, "ids": ids[::3]}]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        ran = pool.map_async(intake_worker, workers)
        asked = pool.map_async(canceller, cancels)
        ran.get(timeout=180)
        asked.get(timeout=180)

    mails = Counter(m["message_id"] for m in sink.messages())
    targeted = set(ids[::2]) | set(ids[::3])
    states: Counter[str] = Counter()
    for request in RequestStore(db).get_many(ids):
        sent = mails[message_id_for(request.key)]
        states[f"{request.status}/{request.cancel_state}"] += 1
        if request.status is RequestStatus.COMPLETED:
            assert sent == 1, request
            assert request.cancel_state in (None, CancelState.REFUSED), request
        else:
            assert request.status is RequestStatus.CANCELLED, request
            assert request.cancel_state is CancelState.CANCELLED, request
            assert sent == 0, request
        if request.id in targeted:
            assert request.cancel_state in (CancelState.CANCELLED, CancelState.REFUSED), request
        else:
            assert request.status is RequestStatus.COMPLETED, request
    assert states["cancelled/cancelled"] >= 1, states


@pytest.mark.dagster
def test_the_cancel_job_cancels_from_the_launchpad_and_says_what_it_did(
    db: Database, db_url: str, tmp_path: Any
) -> None:
    """Catches: a UI cancel that is not the CLI's (another decision path), a launch without a
    reason accepted, and a run that does not say per request what happened."""
    import dagster as dg

    from pipelines.ops.request_ops import cancel_requests_job
    from sensors.intake import RequestsResource

    waiting, done = enqueue(db, 2)
    RequestStore(db).mark_completed(done)
    resources = {"requests": RequestsResource(database_url=db_url)}
    with dg.instance_for_test(temp_dir=str(tmp_path)) as instance:
        def launch(reason: str) -> dg.ExecuteInProcessResult:
            return cancel_requests_job.execute_in_process(
                run_config={"ops": {"cancel_request": {"config": {
                    "requests": [str(waiting), key_of(email(1)), "nope"], "reason": reason}}}},
                instance=instance, resources=resources, raise_on_error=False)

        refused = launch(" ")
        assert not refused.success
        assert RequestStore(db).get(waiting).status is RequestStatus.PENDING  # type: ignore[union-attr]
        result = launch("sent by mistake")
        assert result.success
        assert result.output_for_node("cancel_request") == {
            "cancelled": 1, "requested": 0, "refused": 1, "unknown": 1}
        run = instance.get_run_by_id(result.run_id)
        assert run is not None and run.tags["sekali/cancel"] == "1 cancelled, 1 refused, 1 unknown"
    kept = RequestStore(db).get(waiting)
    assert kept is not None and kept.status is RequestStatus.CANCELLED
    assert (kept.cancel_by, kept.cancel_reason) == ("dagster-ui", "sent by mistake")
