"""Bulk replay by filter (``sekali dlq replay --job-type T --class C --fingerprint F
--older-than 1h --limit N [--dry-run] [--pace 10/s]`` and ``dlq_operations``), SQLite and
Postgres: the filters pick exactly the matching open records, oldest first up to the limit; a dry
run changes nothing; pacing spaces the requests (checked on an injected clock, never the wall
clock); every record acted on has an audit line with who and why."""

from __future__ import annotations

import time
from typing import Any

import dagster as dg
import pytest

from cli.main import main as cli
from engine.replay import Selection, bulk_replay
from pipelines.ops.dlq_ops import dlq_operations
from resources.dagster_resources import DlqResource
from resources.dlq import DlqStatus, DlqStore, FailureClass, FailureInfo
from resources.idempotency import IdempotencyStore
from resources.storage.db import Database

NOW = time.time()  # the CLI's store reads the real clock for ages


class Clock:
    """Time that moves only when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = NOW
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def _seed(db: Database, clock: Clock) -> DlqStore:
    """Ten open records: ids 1-6 send_email permanent 'mailbox' failures two hours old (5 and 6
    with another fingerprint), 7-8 the same but ten minutes old, 9-10 charge_payment transient."""
    store, ledger = DlqStore(db, clock=clock), IdempotencyStore(db)
    for i in range(1, 11):
        payment = i >= 9
        key = f"payment:o{i}" if payment else f"email:welcome:u{i}:2026-11-29"
        ledger.fail(ledger.begin(key), "boom", "permanent")
        store.record_failure(
            FailureInfo(
                job_type="charge_payment" if payment else "send_email",
                dedupe_key=f"request:{i}",
                error_type="GatewayUnavailable" if payment else "SMTPDataError",
                message="timeout" if payment else ("550 mailbox" if i < 5 or i > 6 else "552"),
                error_class=FailureClass.TRANSIENT if payment else FailureClass.PERMANENT,
                run_id=f"r{i}",
                request_id=i,
                idempotency_key=key,
                failed_at=NOW - (600 if i in (7, 8) else 7200),
            )
        )
    return store


def test_filters_limit_dry_run_and_an_audit_line_per_record(
    db: Database, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches: a filter ignored (records of another type, class, cause or age replayed), a
    limit overrun, a dry run that changes or audits something, a replay without its audit
    line, a key reset for a record that was not replayed."""
    clock = Clock()
    store = _seed(db, clock)
    fingerprint = store.get(1).fingerprint
    assert store.get(5).fingerprint != fingerprint
    store.discard([2], actor="t", reason="stale")  # matches the filters but is not open
    audit_before = {i: len(store.audit(i)) for i in range(1, 11)}

    selection = Selection(
        job_type="send_email", error_class="permanent", fingerprint=fingerprint,
        older_than=3600, limit=2,
    )
    dry = bulk_replay(store, selection, actor="ops", dry_run=True)
    assert [(d.record.id, d.replay) for d in dry.decisions] == [(1, True), (3, True)]
    assert store.counts()["open"] == 9
    assert {i: len(store.audit(i)) for i in range(1, 11)} == audit_before

    url = ["--url", db_url]
    args = ["dlq", "replay", "--job-type", "send_email", "--class", "permanent",
            "--fingerprint", fingerprint, "--older-than", "1h"]
    assert cli([*args, "--limit", "2", "--dry-run", *url]) == 0
    out = capsys.readouterr().out
    assert "1  would replay" in out and "3  would replay" in out and "2 of 2" in out
    assert store.counts()["open"] == 9

    assert cli([*args, "--limit", "0", *url]) == 2
    assert "limit" in capsys.readouterr().err
    # bad usage is argparse's exit 2 naming the flag; a pace is a rate only (a limiter's burst
    # or wait would be silently ignored)
    for bad in ([*args, "--pace", "fast"], [*args, "--pace", "10/s,burst=50"],
                ["dlq", "list", "--older-than", "2x"], ["dlq", "list", "--older-than", "5"]):
        with pytest.raises(SystemExit) as usage:
            cli([*bad, *url])
        assert usage.value.code == 2
        assert f"argument {bad[-2]}:" in capsys.readouterr().err

    who = ["--actor", "ops@test", "--reason", "mailbox fixed"]
    # no mail record to ask here: the verdict is unknown, so the guard wants the ids named
    assert cli([*args, "--limit", "2", *who, *url]) == 1
    assert "--allow-repeat 1,3" in capsys.readouterr().err
    assert cli([*args, "--limit", "2", "--allow-repeat", "1,3", *who, *url]) == 0
    assert "2 of 2 selected records requested for replay" in capsys.readouterr().out
    replayed = [r.id for r in store.list_records(status="replay_requested")]
    assert replayed == [1, 3]  # 4 matches too: the limit took the oldest two
    for i in (1, 3):
        last = store.audit(i)[-1]
        assert (last["action"], last["actor"], last["detail"]) == (
            "replay_requested", "ops@test", "mailbox fixed"
        )
    ledger = IdempotencyStore(db)
    reset = {i for i in range(1, 9) if ledger.get(f"email:welcome:u{i}:2026-11-29").status
             == "retryable"}
    assert reset == {1, 3}

    # The same filters again take the next one (4); 5-6 (other cause), 7-8 (too recent),
    # 9-10 (other type) are never touched.
    assert cli([*args, "--allow-repeat", "4", "--actor", "ops@test", *url]) == 0
    capsys.readouterr()
    assert [r.id for r in store.list_records(status="replay_requested")] == [1, 3, 4]
    for i in (5, 6, 7, 8, 9, 10):
        assert store.get(i).status is DlqStatus.OPEN
        assert len(store.audit(i)) == audit_before[i]

    # Named ids: a record that is not open is skipped, with an audit line saying why.
    assert cli(["dlq", "replay", "2", "5", "--allow-repeat", "5", "--actor", "ops@test",
                *url]) == 0
    capsys.readouterr()
    skipped = store.audit(2)[-1]
    assert (skipped["action"], skipped["detail"]) == ("replay_skipped", "status is discarded")
    assert store.audit(5)[-1]["action"] == "replay_requested"


def test_pacing_spaces_the_replay_requests(db: Database) -> None:
    """Catches: a pace that is not applied (a burst of requests at once) or applied to the
    records skipped (time wasted on no-ops)."""
    clock = Clock()
    store = _seed(db, clock)
    store.discard([3], actor="t", reason="stale")
    result = bulk_replay(
        store, Selection(ids=list(range(1, 9))), actor="ops", pace=4.0, clock=clock,
        sleep=clock.sleep,
    )
    assert result.chosen == 7
    times = [
        a["at"] for i in range(1, 9) for a in store.audit(i) if a["action"] == "replay_requested"
    ]
    assert len(times) == 7
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert all(g >= 0.25 - 1e-9 for g in gaps), gaps  # 4/s: a request every 0.25 s at most
    assert times[-1] - times[0] == pytest.approx(6 * 0.25)
    assert len(clock.slept) == 6


def test_dlq_operations_bulk_replay_with_limit_and_pace(db: Database, db_url: str) -> None:
    """Catches: the UI job ignoring the limit or the pace, or hiding the audit."""
    store = _seed(db, Clock())

    def run(**config: Any) -> dg.ExecuteInProcessResult:
        return dlq_operations.execute_in_process(
            run_config={"ops": {"dlq_operation": {"config": config}}},
            resources={"dlq": DlqResource(database_url=db_url)},
            instance=dg.DagsterInstance.ephemeral(),
            raise_on_error=False,
        )

    assert not run(action="replay", job_type="send_email", pace="often").success
    assert not run(action="replay", job_type="send_email", limit=0).success
    guarded = run(action="replay", job_type="send_email", limit=3, dry_run=False)
    assert guarded.output_for_node("dlq_operation")["refused"] == [1, 2, 3]  # mail unknowable
    assert store.counts()["open"] == 10
    done = run(action="replay", job_type="send_email", limit=3, pace="1000/s", dry_run=False,
               actor="alice", allow_repeat=[1, 2, 3])
    assert done.success
    assert done.output_for_node("dlq_operation")["changed"] == [1, 2, 3]
    assert [r.id for r in store.list_records(status="replay_requested")] == [1, 2, 3]
    metadata = next(
        e.event_specific_data.metadata
        for e in done.all_events
        if e.event_type_value == "STEP_OUTPUT"
    )
    audit = [(r.data["record"], r.data["action"], r.data["actor"])
             for r in metadata["audit"].value.records if r.data["action"] != "dead_lettered"]
    assert audit == [(i, action, who) for i in (1, 2, 3) for action, who in
                     (("replay_skipped", "dagster-ui"), ("replay_requested", "alice"))]
