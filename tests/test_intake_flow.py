"""Intake flow control (docs/flow.md): debounce with a maximum wait, priorities with aging, and
dedupe windows, on SQLite and Postgres, with several processes where concurrency is claimed.

Time is the stores' injected clock, never a sleep: the burst is written at real time, and the
claims that must find it over are made "31 seconds later" by giving the claimer that clock.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import re
import shutil
import time
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from sqlalchemy import text

from cli.main import main as cli
from engine import FlowControl
from engine.intake import enqueue
from engine.registry import JOB_TYPES
from engine.requests import RequestStatus, RequestStore, windowed_key
from engine.validation import PRIORITY_MAX
from pipelines.domain.consumers import report_rebuild_consumer
from pipelines.jobs import report
from pipelines.ops import all_jobs, rebuild_report_cache_job
from resources.dlq import DlqStore, FailureInfo
from resources.errors import ValidationError
from resources.idempotency import Claim, Completed, IdempotencyStore
from resources.outbox import InAppPublisher, Inbox, OutboxPublisher, write_event
from resources.storage.db import Database
from resources.storage.migrations import sql_dir, upgrade
from sensors.intake import (
    IntakeMode,
    IntakePolicy,
    RequestsResource,
    evaluate_intake,
    merge_debounced,
    run_requests_for,
)
from tests import intake_flow_workers as workers
from tests.job_workers import dagster_resources

WAIT, MAX_WAIT = report.DEBOUNCE.wait, report.DEBOUNCE.max_wait


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _rows(store: RequestStore, job_type: str) -> list[Any]:
    ids = range(1, 10_000)
    return [r for r in store.get_many(list(ids)) if r.job_type == job_type]


# -- debounce ------------------------------------------------------------------------------------


def test_a_burst_of_200_shipped_events_makes_one_rebuild_per_report(db_url: str) -> None:
    """Catches: one rebuild per event (no debounce), a group launched twice by two claimers at
    once, a coalesced request lost (no status or link), a run before the burst is over."""
    db = Database.from_url(db_url)
    upgrade(db)
    store = RequestStore(db)
    enqueue("rebuild_report_cache", report.JOB_TYPE.presentation.example, db=db)
    store.claim_for_launch(10, merge=merge_debounced)  # not due yet: stays pending
    first = store.get_by_key(report.key_for(report.JOB_TYPE.presentation.example))
    assert first is not None and first.status is RequestStatus.PENDING

    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        delivered = pool.starmap(workers.ship_events, [(db_url, w, 50) for w in range(1, 5)])
    assert sum(delivered) == 200
    burst_end = time.time()
    assert store.claim_for_launch(500) == []  # the burst is not over: nothing runs yet

    later = burst_end + WAIT + 1
    with ctx.Manager() as manager, ctx.Pool(3) as pool:
        barrier = manager.Barrier(3)
        claimed = pool.starmap(workers.claim_at, [(db_url, later, 500, barrier)] * 3)
    launched = sorted(i for ids in claimed for i in ids)
    rows = _rows(store, "rebuild_report_cache")
    assert len(rows) == 401  # 200 events x 2 reports, and the example request
    by_status: dict[str, list[Any]] = {}
    for r in rows:
        by_status.setdefault(str(r.status), []).append(r)
    # One run per report's debounce group (stock_levels, fulfilment_by_status): exactly two.
    assert len(launched) == 2 and {r.id for r in by_status["launched"]} == set(launched)
    assert len(by_status["coalesced"]) == 399
    winners = {r.id: r for r in by_status["launched"]}
    for r in by_status["coalesced"]:
        assert r.coalesced_into in winners
        assert winners[r.coalesced_into].debounce_key == r.debounce_key
    for w in winners.values():
        group = [r for r in rows if r.debounce_key == w.debounce_key]
        assert w.created_at == max(r.created_at for r in group)  # the newest payload runs
        assert w.coalesced_count == len(group) - 1
        assert len(store.coalesced_into(w.id)) == w.coalesced_count
    assert sum(w.coalesced_count for w in winners.values()) == 399

    # No other request of the burst is ever launched: later ticks re-claim at most the two
    # winners (a launched request untouched past relaunch_after; its run key is the same).
    assert workers.claim_at(db_url, later + 1, 500) == []
    assert set(workers.claim_at(db_url, later + MAX_WAIT * 2, 500)) <= set(launched)
    db.dispose()


def test_a_steady_stream_still_runs_at_least_every_max_wait(db: Database) -> None:
    """Catches: a debounce that waits for a quiet moment forever while events keep arriving."""
    clock = Clock(1_000_000.0)
    store = RequestStore(db, clock=clock)
    step = WAIT / 3  # always busier than the wait: never a quiet moment
    launches: list[float] = []
    first_waiting = clock.now
    for i in range(int(3.5 * MAX_WAIT / step)):
        enqueue(
            "rebuild_report_cache",
            {"report": "stock_levels", "as_of": f"shipped-{i}"},
            db=db,
            clock=clock,
        )
        got = store.claim_for_launch(50, merge=merge_debounced)
        if got:
            (winner,) = got
            assert winner.payload["as_of"] == f"shipped-{i}"  # the newest one
            assert clock.now - first_waiting >= MAX_WAIT  # not before the maximum wait
            assert clock.now - first_waiting <= MAX_WAIT + step  # and no later than a tick
            launches.append(clock.now)
            first_waiting = clock.now + step
            assert store.mark_running(winner.id)  # its run started
        clock.now += step
    assert len(launches) == 3
    rows = _rows(store, "rebuild_report_cache")
    coalesced = [r for r in rows if r.status is RequestStatus.COALESCED]
    launched = [r for r in rows if r.status is RequestStatus.RUNNING]
    assert len(launched) == 3
    assert sum(r.coalesced_count for r in launched) == len(coalesced)


def test_a_merge_folds_the_groups_payloads_into_the_one_that_runs(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches: a job type's merge ignored (the newest payload run instead of the merged one)."""
    merged = dataclasses.replace(
        report.DEBOUNCE,
        merge=lambda ps: {"report": ps[-1]["report"], "as_of": f"n{len(ps)}"},
    )
    monkeypatch.setitem(
        JOB_TYPES, report.JOB_TYPE.name,
        dataclasses.replace(report.JOB_TYPE, flow=FlowControl(debounce=merged)),
    )
    clock = Clock(2_000_000.0)
    for i in range(5):
        enqueue("rebuild_report_cache", {"report": "stock_levels", "as_of": f"e{i}"},
                db=db, clock=clock)
    clock.now += WAIT
    (winner,) = RequestStore(db, clock=clock).claim_for_launch(10, merge=merge_debounced)
    assert winner.payload == {"report": "stock_levels", "as_of": "n5"}
    assert winner.coalesced_count == 4


def test_run_tags_show_priority_coalesced_count_and_dedupe_window(db: Database) -> None:
    """Catches: the run not telling the UI its priority (Dagster's queue ignores it), how many
    requests it stands for, or how long its key means one intent."""
    clock = Clock(3_000_000.0)
    for i in range(3):
        enqueue("rebuild_report_cache", {"report": "stock_levels", "as_of": f"e{i}"},
                db=db, clock=clock, priority=4)
    clock.now += WAIT
    claimed = RequestStore(db, clock=clock).claim_for_launch(10, merge=merge_debounced)
    runs, _ = run_requests_for(claimed, IntakePolicy(default_mode=IntakeMode.PER_REQUEST))
    (run,) = runs
    assert run.tags["dagster/priority"] == "4" and run.tags["sekali/priority"] == "4"
    assert run.tags["sekali/coalesced"] == "2"
    assert run.tags["sekali/dedupe_window"] == "until_finished"


# -- priorities ----------------------------------------------------------------------------------


def _normal_backlog(db: Database, clock: Clock, n: int) -> list[int]:
    ids = []
    for i in range(n):
        ids.append(
            enqueue("send_email", _mail(f"n{i}"), db=db, clock=clock).id
        )
    return ids


def _mail(user: str, date: str = "2026-11-30") -> dict[str, Any]:
    return {"template": "welcome", "user_id": user, "date": date, "to": f"{user}@example.com"}


def test_urgent_requests_overtake_a_backlog_of_500(db: Database) -> None:
    """Catches: claims in arrival order only (urgent work waits behind the whole backlog)."""
    clock = Clock(4_000_000.0)
    _normal_backlog(db, clock, 500)
    clock.now += 1
    urgent = {
        enqueue("send_email", _mail(f"u{i}"), db=db, clock=clock, priority=PRIORITY_MAX).id
        for i in range(10)
    }
    clock.now += 1
    store = RequestStore(db, clock=clock)
    first = store.claim_for_launch(10)
    assert {r.id for r in first} == urgent
    assert all(r.priority == PRIORITY_MAX for r in first)
    second = store.claim_for_launch(10)
    assert [r.priority for r in second] == [0] * 10
    assert [r.id for r in second] == sorted(r.id for r in second)  # the oldest normal ones


def test_the_oldest_normal_request_is_claimed_within_the_aging_bound(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches: starvation: a backlog request never claimed while urgent work keeps arriving."""
    aging = 6.0
    monkeypatch.setenv("SEKALI_INTAKE_PRIORITY_AGING", str(aging))
    clock = Clock(5_000_000.0)
    backlog = _normal_backlog(db, clock, 500)
    oldest = backlog[0]
    store = RequestStore(db, clock=clock)
    claimed_at_tick = None
    bound = int(PRIORITY_MAX * aging) + 2  # ticks of one second
    for tick in range(bound + 5):
        clock.now += 1
        for i in range(10):  # as much urgent work arrives as a tick claims
            enqueue("send_email", _mail(f"u{tick}-{i}"), db=db, clock=clock,
                    priority=PRIORITY_MAX)
        got = [r.id for r in store.claim_for_launch(10)]
        if oldest in got:
            claimed_at_tick = tick
            break
    assert claimed_at_tick is not None and claimed_at_tick <= bound


@pytest.mark.parametrize("bad", ["high", 11, -11, True, 2.5, None])
def test_a_bad_priority_is_refused_naming_the_field_and_kept(db: Database, bad: Any) -> None:
    """Catches: a priority outside the bounds stored (and a queue ordering on it)."""
    with pytest.raises(ValidationError) as info:
        enqueue("send_email", _mail("p"), db=db, priority=bad)
    assert info.value.field == "priority"
    (rejection,) = RequestStore(db).rejections("send_email")
    assert rejection["field"] == "priority"
    assert RequestStore(db).counts()["pending"] == 0


# -- dedupe windows ------------------------------------------------------------------------------


@pytest.fixture
def daily_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    """``send_email`` as a daily digest: its key means one intent for 24 h."""
    monkeypatch.setitem(
        JOB_TYPES, "send_email", dataclasses.replace(
            JOB_TYPES["send_email"],
            keying=dataclasses.replace(JOB_TYPES["send_email"].keying, dedupe_window=86400),
        ),
    )


def test_within_the_window_a_duplicate_after_it_a_new_intent_that_runs_once(
    db: Database, daily_digest: None
) -> None:
    """Catches: a windowed key deduplicated forever (tomorrow's digest never sent), or not at all
    (a second digest today), and a new intent run twice by the ledger."""
    day = 1_764_460_800.0  # 2025-11-30T00:00:00Z
    clock = Clock(day + 10 * 3600)
    first = enqueue("send_email", _mail("d", "2026-01-01"), db=db, clock=clock)
    assert first.key == "email:welcome:d:2026-01-01@2025-11-30T00:00:00Z"
    assert first.request.dedupe_window == 86400 and first.request.dedupe == "86400s"
    clock.now = day + 23 * 3600
    again = enqueue("send_email", _mail("d", "2026-01-01"), db=db, clock=clock)
    assert again.duplicate and again.id == first.id
    clock.now = day + 86400 + 3600
    tomorrow = enqueue("send_email", _mail("d", "2026-01-01"), db=db, clock=clock)
    assert tomorrow.created and tomorrow.key.endswith("@2025-12-01T00:00:00Z")

    ledger = IdempotencyStore(db)
    payload = {"x": 1}
    claim = ledger.begin(first.key, payload=payload)
    assert isinstance(claim, Claim)
    with db.transaction() as conn:
        ledger.complete(claim, {"sent": 1}, conn=conn)
    assert isinstance(ledger.begin(first.key, payload=payload), Completed)  # a duplicate
    new = ledger.begin(tomorrow.key, payload=payload)
    assert isinstance(new, Claim)  # a new intent runs
    with db.transaction() as conn:
        ledger.complete(new, {"sent": 2}, conn=conn)
    assert isinstance(ledger.begin(tomorrow.key, payload=payload), Completed)  # once


def test_until_finished_keeps_the_key_as_given() -> None:
    assert windowed_key("k", None, 123.0) == "k"
    assert windowed_key("k", 3600, 7200.5) == "k@1970-01-01T02:00:00Z"


def test_dlq_show_and_the_request_record_show_the_dedupe_window(
    db_url: str, daily_digest: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches: an operator unable to tell whether a replay of this key is the same intent."""
    db = Database.from_url(db_url)
    upgrade(db)
    made = enqueue("send_email", _mail("s"), db=db)
    plain = enqueue("rebuild_report_cache", report.JOB_TYPE.presentation.example, db=db)
    dlq = DlqStore(db)
    ids = []
    for request in (made.request, plain.request):
        recorded = dlq.record_failure(
            FailureInfo(
                job_type=request.job_type,
                dedupe_key=f"request:{request.id}",
                error_type="Boom",
                message="boom",
                run_id=f"run-{request.id}",
                idempotency_key=request.key,
                request_id=request.id,
            )
        )
        ids.append(recorded.record.id)
    shown = []
    for record_id in ids:
        capsys.readouterr()
        assert cli(["dlq", "show", str(record_id), "--url", db_url, "--json"]) == 0
        shown.append(json.loads(capsys.readouterr().out)["dedupe_window"])
    assert shown == ["86400s", "until_finished"]
    assert cli(["dlq", "show", str(ids[0]), "--url", db_url]) == 0
    assert re.search(r"dedupe_window\s+86400s", capsys.readouterr().out)
    db.dispose()


def test_sekali_enqueue_takes_a_priority_and_refuses_a_bad_one(
    db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches: the CLI dropping the priority, or a bad one not kept as a rejection."""
    db = Database.from_url(db_url)
    upgrade(db)
    payload = json.dumps(_mail("cli"))
    assert cli(["enqueue", "send_email", "--payload", payload, "--url", db_url,
                "--priority", "7"]) == 0
    request = RequestStore(db).get_by_key("email:welcome:cli:2026-11-30")
    assert request is not None and request.priority == 7
    capsys.readouterr()
    assert cli(["enqueue", "send_email", "--payload", payload, "--url", db_url,
                "--priority", "urgent"]) == 2
    assert "priority: must be a whole number" in capsys.readouterr().err
    assert RequestStore(db).rejections(source="cli")[0]["field"] == "priority"
    db.dispose()


def test_the_dagster_job_says_how_its_intake_treats_requests() -> None:
    """Catches: a debounced or windowed job type whose job page says nothing about it."""
    described = {j.name: j.description or "" for j in all_jobs}
    assert "Debounced per {report}: runs 30 s" in described["rebuild_report_cache"]
    assert "one intent until finished" in described["send_email"]


@pytest.mark.dagster
def test_shipped_events_through_the_outbox_and_the_intake_sensor_rebuild_each_report_once(
    db: Database, db_url: str, redis_url: str, namespace: str, redis_client: Any
) -> None:
    """End to end: outbox -> consumer -> requests -> the intake sensor on a real instance -> the
    runs executed. Catches: a rebuild per event, coalesced requests left pending, a coalesced
    request whose link points at a run that did not complete."""
    with db.transaction() as conn:
        for i in range(30):
            write_event(conn, aggregate_type="order", aggregate_id=f"o{i}",
                        event_type="order.shipped", payload={"order_id": f"o{i}"},
                        event_id=f"fulfil:o{i}:shipped")
    inbox = Inbox(db)
    publisher = OutboxPublisher(db, InAppPublisher(inbox, [report_rebuild_consumer()]))
    assert publisher.publish_batch().published == 30
    store = RequestStore(db)
    assert store.counts()["pending"] == 60

    resources = dagster_resources(db_url=db_url, redis_url=redis_url, namespace=namespace)
    resources["requests"] = RequestsResource(database_url=db_url)
    policy = IntakePolicy(default_mode=IntakeMode.PER_REQUEST)
    with dg.DagsterInstance.ephemeral() as instance:
        now = Clock(time.time())
        timed = RequestStore(db, clock=now)
        quiet = evaluate_intake(dg.build_sensor_context(instance=instance), timed, policy)
        assert not quiet.run_requests  # the burst is not over
        now.now += WAIT
        result = evaluate_intake(dg.build_sensor_context(instance=instance), timed, policy)
        runs = result.run_requests or []
        served = [timed.get(r.run_config["ops"]["rebuild_report_cache_op"]["config"]
                            ["request_id"]) for r in runs]
        assert sorted(r.payload["report"] for r in served if r is not None) == [
            "fulfilment_by_status", "stock_levels"]
        assert {r.tags["sekali/coalesced"] for r in runs} == {"29"}
        for run in runs:
            executed = rebuild_report_cache_job.execute_in_process(
                run_config=run.run_config,
                instance=instance,
                tags={**run.tags, "dagster/run_key": run.run_key or ""},
                resources=resources,
                raise_on_error=False,
            )
            assert executed.success
        evaluate_intake(dg.build_sensor_context(instance=instance), timed, policy)
    counts = store.counts()
    assert counts["completed"] == 2 and counts["coalesced"] == 58 and counts["pending"] == 0
    with db.statement() as conn:
        built = conn.execute(text("SELECT report FROM report_snapshots ORDER BY report")).all()
    assert [r.report for r in built] == ["fulfilment_by_status", "stock_levels"]


def test_requests_written_before_the_migration_keep_everything_and_claim_in_order(
    db_url: str, tmp_path: Path
) -> None:
    """Catches: the SQLite table rebuild losing rows, ids or columns, new ids reusing old ones,
    or old rows left without a claim rank (never claimed)."""
    before = tmp_path / "sql"
    shutil.copytree(sql_dir(), before)
    for path in before.glob("0*.sql"):
        if path.name >= "0110":  # this migration and those after it
            path.unlink()
    db = Database.from_url(db_url)
    upgrade(db, before)
    with db.transaction() as conn:
        for i, status in enumerate(["pending", "failed", "completed", "pending"]):
            conn.execute(
                text(
                    "INSERT INTO job_requests (job_type, key, payload, payload_hash, status,"
                    " queue, created_at, updated_at, attempts, last_error, error_class,"
                    " traceparent) VALUES ('send_email', :k, '{}', 'h', :s, 'light', :t, :t,"
                    " 1, 'e', 'transient', 'tp')"
                ),
                {"k": f"old:{i}", "s": status, "t": 100.0 + i},
            )
    with db.transaction() as conn:  # the amended-replay column (0105) survives the rebuild
        conn.execute(text("UPDATE job_requests SET superseded_by = 'old:1#v2' WHERE key = 'old:1'"))
    assert upgrade(db)[0] == "0110_flow_intake"
    store = RequestStore(db)
    old = [store.get_by_key(f"old:{i}") for i in range(4)]
    assert [r.status for r in old if r] == ["pending", "failed", "completed", "pending"]
    assert all(r is not None and r.priority == 0 and r.claim_rank == r.created_at
               and r.last_error == "e" and r.traceparent == "tp" for r in old)
    with db.statement() as conn:
        kept = conn.execute(text("SELECT key, superseded_by FROM job_requests"
                                 " WHERE superseded_by IS NOT NULL")).all()
    assert [tuple(r) for r in kept] == [("old:1", "old:1#v2")]
    new = store.enqueue("send_email", "new", {}, queue="light")
    assert new.id > max(r.id for r in old if r)
    assert [r.key for r in store.claim_for_launch(10)] == ["old:0", "old:3", "new"]
    db.dispose()


def test_the_request_record_carries_its_dedupe_window_as_a_field(db: Database) -> None:
    """Catches: ``requests show`` (which prints every field of the record) not saying
    ``until_finished`` for a key that means one intent until it is done."""
    made = enqueue("send_email", _mail("f"), db=db)
    fields = {f.name for f in dataclasses.fields(made.request)}
    assert {"dedupe", "dedupe_window", "priority", "coalesced_into", "coalesced_count"} <= fields
    assert made.request.dedupe == "until_finished"
