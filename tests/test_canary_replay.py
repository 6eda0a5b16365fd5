"""Canary replay (``sekali dlq replay ... --canary N [--canary-timeout S]`` and
``dlq_operations`` with ``canary``), SQLite and Postgres: N records are replayed first and
followed to their end; only when every canary resolved is the rest requested. A canary that
fails again, or has not ended by the timeout, leaves the rest open (an audit line saying why)
and the command exits 1 (the job's run fails).

The test plays the replay sensor and the replay runs by moving the records through the DLQ
store: from the injected ``sleep`` for the engine, from the test's own process (or a thread)
while the CLI (a subprocess) or the job waits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from cli.main import main as cli
from engine.canary import canary_replay
from engine.replay import Selection
from pipelines.ops.dlq_ops import dlq_operations
from resources.dagster_resources import DlqResource
from resources.dlq import DlqStatus, DlqStore, FailureClass, FailureInfo
from resources.errors import ValidationError
from resources.idempotency import IdempotencyStore
from resources.storage.db import Database

SEKALI = str(Path(sys.executable).with_name("sekali"))
ROOT = Path(__file__).resolve().parents[1]
NOW = time.time()
RECORDS = 4


def _key(i: int) -> str:
    return f"email:welcome:u{i}:2026-12-02"


def _info(i: int, run_id: str, dlq_id: int | None = None) -> FailureInfo:
    return FailureInfo(
        job_type="send_email", dedupe_key=f"request:{i}", error_type="SMTPDataError",
        message="550 mailbox", error_class=FailureClass.PERMANENT, run_id=run_id,
        idempotency_key=_key(i), failed_at=NOW - 3600, dlq_id=dlq_id,
    )


def _seed(db: Database) -> DlqStore:
    """Records 1-4: open send_email dead letters, their keys failed in the ledger."""
    store, ledger = DlqStore(db), IdempotencyStore(db)
    for i in range(1, RECORDS + 1):
        ledger.fail(ledger.begin(_key(i)), "boom", "permanent")
        store.record_failure(_info(i, f"r{i}"))
    return store


def _status(store: DlqStore) -> dict[int, str]:
    return {i: str(store.get(i).status) for i in range(1, RECORDS + 1)}


def _end_replays(store: DlqStore, fail: set[int]) -> list[int]:
    """What the replay sensor and the replay runs do: claim the requested records, then each
    resolves, or fails again (the record is open again)."""
    claimed = [r.id for r in store.claim_for_replay(10)]
    for i in claimed:
        if i in fail:
            store.record_failure(_info(i, f"replay-{i}", dlq_id=i))
        else:
            store.resolve(i, actor="test")
    return claimed


class Sensor:
    """The injected clock and sleep: each sleep moves time on and plays one sensor tick (unless
    ``ends`` is ``never``), noting what the other records looked like at that moment."""

    def __init__(self, store: DlqStore, ends: str, fail: set[int] | None = None) -> None:
        self.store, self.ends, self.fail = store, ends, fail or set()
        self.now = 1000.0
        self.seen: list[dict[int, str]] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.seen.append(_status(self.store))
        if self.ends != "never":
            _end_replays(self.store, self.fail)


def test_resolved_canaries_let_the_rest_replay(db: Database) -> None:
    """Catches: the rest requested together with the canaries (before their outcome is known),
    or never requested after they resolved."""
    store = _seed(db)
    sensor = Sensor(store, "resolve")
    done = canary_replay(store, Selection(job_type="send_email"), canary=2, actor="ops",
                         canary_timeout=30, clock=sensor.clock, sleep=sensor.sleep)
    assert done.canaries == [1, 2]
    assert sensor.seen[0] == {1: "replay_requested", 2: "replay_requested", 3: "open",
                              4: "open"}
    assert not done.stopped and not done.held
    assert done.outcomes == {1: "canary resolved", 2: "canary resolved",
                             3: "replay requested", 4: "replay requested"}
    assert _status(store) == {1: "resolved", 2: "resolved", 3: "replay_requested",
                              4: "replay_requested"}


def test_a_canary_failing_again_holds_the_rest_open(db: Database) -> None:
    """Catches: the rest replayed although a canary failed again (the cause is not fixed), a
    held record left without an audit line saying why, or its key reset anyway."""
    store = _seed(db)
    sensor = Sensor(store, "fail", fail={2})
    done = canary_replay(store, Selection(job_type="send_email"), canary=2, actor="ops",
                         canary_timeout=30, clock=sensor.clock, sleep=sensor.sleep)
    assert done.canaries == [1, 2] and done.held == [3, 4]
    assert "canary 2 failed again" in done.stopped
    assert done.outcomes == {1: "canary resolved", 2: "canary failed again",
                             3: "not replayed: canary failed", 4: "not replayed: canary failed"}
    assert _status(store) == {1: "resolved", 2: "open", 3: "open", 4: "open"}
    ledger = IdempotencyStore(db)
    for i in (3, 4):
        last = store.audit(i)[-1]
        assert (last["action"], last["actor"]) == ("replay_skipped", "ops")
        assert "canary 2 failed again" in last["detail"]
        assert ledger.get(_key(i)).status == "failed"


def test_a_canary_not_ended_by_the_timeout_holds_the_rest(db: Database) -> None:
    """Catches: a canary wait with no bound (hangs while no sensor runs), or a timeout that lets
    the rest go as if the canary had resolved."""
    store = _seed(db)
    sensor = Sensor(store, "never")
    start = sensor.now
    done = canary_replay(store, Selection(ids=[1, 2, 3]), canary=1, actor="ops",
                         canary_timeout=5, clock=sensor.clock, sleep=sensor.sleep)
    assert 5 <= sensor.now - start < 7  # the injected clock: the bound, not much later
    assert done.timed_out and done.canaries == [1] and done.held == [2, 3]
    assert "not ended after 5s" in done.stopped
    assert done.outcomes == {1: "canary not ended", 2: "not replayed: canary timed out",
                             3: "not replayed: canary timed out"}
    assert _status(store) == {1: "replay_requested", 2: "open", 3: "open", 4: "open"}
    assert "not ended after 5s" in store.audit(2)[-1]["detail"]


def test_the_guard_and_the_dry_run_pick_the_canaries(db: Database) -> None:
    """Catches: a record the guard refuses counted as a canary (nothing would be proven), or a
    dry run that changes something or does not say which records would be the canaries."""
    store = _seed(db)
    audit = {i: len(store.audit(i)) for i in range(1, RECORDS + 1)}
    dry = canary_replay(store, Selection(job_type="send_email"), canary=2, actor="ops",
                        dry_run=True, allow_repeat=[2, 3, 4])
    assert dry.canaries == [2, 3]
    assert dry.outcomes[2] == dry.outcomes[3] == "would be a canary"
    assert dry.outcomes[4] == "would replay after the canaries resolve"
    assert dry.outcomes[1].startswith("would be refused")
    assert {i: len(store.audit(i)) for i in range(1, RECORDS + 1)} == audit
    assert set(_status(store).values()) == {"open"}

    sensor = Sensor(store, "resolve")
    done = canary_replay(store, Selection(job_type="send_email"), canary=2, actor="ops",
                         allow_repeat=[2, 3, 4], canary_timeout=30, clock=sensor.clock,
                         sleep=sensor.sleep)
    assert done.canaries == [2, 3] and done.replay.refused == [1]
    assert done.outcomes[1].startswith("refused")
    assert _status(store) == {1: "open", 2: "resolved", 3: "resolved", 4: "replay_requested"}


@pytest.mark.parametrize(("field", "config"), [
    ("canary", {"canary": 0}),
    ("canary_timeout", {"canary": 1, "canary_timeout": 0}),
])
def test_bad_canary_settings_name_the_field(
    db: Database, field: str, config: dict[str, Any]
) -> None:
    """Catches: a canary of 0 (nothing proven, everything replayed) or a wait of no time."""
    store = _seed(db)
    with pytest.raises(ValidationError) as refused:
        canary_replay(store, Selection(job_type="send_email"), actor="ops", **config)
    assert refused.value.field == field
    assert set(_status(store).values()) == {"open"}


# -- the CLI -----------------------------------------------------------------------------------


def start(db_url: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "DATABASE_URL": db_url, "PYTHONPATH": str(ROOT)}  # this tree's code
    env.pop("SEKALI_SMTP_LOG_URL", None)
    return subprocess.Popen([SEKALI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


REPLAY = ["dlq", "replay", "--job-type", "send_email", "--allow-repeat", "1,2,3,4", "--json"]


@pytest.mark.parametrize("ends", ["resolved", "fails_again"])
def test_cli_canary_replays_the_rest_only_after_the_canary_resolved(
    db: Database, db_url: str, ends: str
) -> None:
    """Catches: a --canary that does not wait for the canary, replays the rest after it failed
    again, exits 0 when it stopped the rest, or whose --json lacks each record's outcome."""
    store = _seed(db)
    proc = start(db_url, *REPLAY, "--canary", "1", "--canary-timeout", "60")
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:  # the follower has seen the canary requested: the wait began
        seen.append(line)
        if "dead letter 1: replay requested" in line:
            break
    assert _status(store) == {1: "replay_requested", 2: "open", 3: "open", 4: "open"}, seen
    _end_replays(store, fail={1} if ends == "fails_again" else set())
    code, out, err = finish(proc)
    err = "".join(seen) + err
    data = json.loads(out)  # stdout is only the JSON
    outcomes = {d["id"]: d["outcome"] for d in data["decisions"]}
    assert data["canary"]["ids"] == [1]
    if ends == "resolved":
        assert code == 0, err
        assert outcomes == {1: "canary resolved", 2: "replay requested",
                            3: "replay requested", 4: "replay requested"}
        assert _status(store) == {1: "resolved", 2: "replay_requested", 3: "replay_requested",
                                  4: "replay_requested"}
        assert not data["canary"]["stopped"]
    else:
        assert code == 1, err
        assert outcomes == {1: "canary failed again", 2: "not replayed: canary failed",
                            3: "not replayed: canary failed", 4: "not replayed: canary failed"}
        assert _status(store) == {1: "open", 2: "open", 3: "open", 4: "open"}
        assert "canary 1 failed again" in data["canary"]["stopped"]
        assert "canary 1 failed again" in err and "not replayed: [2, 3, 4]" in err
    assert "dead letter 1: replay requested" in err  # the follower's progress, on stderr


def test_cli_canary_timeout_holds_the_rest_and_says_so(db: Database, db_url: str) -> None:
    """Catches: a canary wait that outlives --canary-timeout, or lets the rest go after it."""
    store = _seed(db)
    code, out, err = finish(start(db_url, *REPLAY, "--canary", "2", "--canary-timeout", "1"))
    assert code == 1, err
    data = json.loads(out)
    assert data["canary"]["ids"] == [1, 2] and data["canary"]["timed_out"]
    assert {d["id"]: d["outcome"] for d in data["decisions"]} == {
        1: "canary not ended", 2: "canary not ended", 3: "not replayed: canary timed out",
        4: "not replayed: canary timed out"}
    assert "not ended after 1s" in err
    assert _status(store) == {1: "replay_requested", 2: "replay_requested", 3: "open",
                              4: "open"}


def test_cli_canary_dry_run_names_the_canaries_and_bad_usage_exits_2(
    db: Database, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches: a dry run that does not say which records would be the canaries, or a bad
    --canary / --canary-timeout taken silently."""
    store = _seed(db)
    code, out, err = finish(start(db_url, "dlq", "replay", "--job-type", "send_email",
                                  "--allow-repeat", "2,3,4", "--canary", "2", "--dry-run"))
    assert code == 0, err
    assert "1  would be refused: unknown" in out  # the guard would refuse it: not a canary
    assert "2  would be a canary" in out and "3  would be a canary" in out
    assert "4  would replay after the canaries resolve" in out
    assert "canaries: [2, 3]" in out
    assert set(_status(store).values()) == {"open"}
    for bad, flag in ((["--canary", "0"], "--canary"), (["--canary", "x"], "--canary"),
                      (["--canary", "1", "--canary-timeout", "-1"], "--canary-timeout"),
                      (["--canary-timeout", "5"], "--canary-timeout"),
                      (["--canary", "1", "--patch", "{}"], "--canary")):
        try:
            code = cli(["dlq", "replay", "1", *bad, "--url", db_url])
        except SystemExit as usage:
            code = usage.code  # type: ignore[assignment]
        out, err = capsys.readouterr()
        assert code == 2 and out == "", (bad, err)
        assert flag in err, (bad, err)
    assert set(_status(store).values()) == {"open"}


# -- the Dagster job ---------------------------------------------------------------------------


@pytest.mark.parametrize("ends", ["resolved", "fails_again", "never"])
def test_dlq_operations_with_a_canary(db: Database, db_url: str, ends: str) -> None:
    """Catches: the UI job ignoring ``canary`` (everything requested at once), replaying the
    rest after a failed or unfinished canary, or succeeding when the canary stopped the rest."""
    store = _seed(db)
    stop = threading.Event()
    while_waiting: list[dict[int, str]] = []

    def sensor() -> None:  # the replay sensor and runs, beside the waiting job
        while not stop.is_set():
            if _status(store)[1] == "replay_requested":
                while_waiting.append(_status(store))
                _end_replays(store, fail={1} if ends == "fails_again" else set())
                return
            time.sleep(0.05)

    thread = threading.Thread(target=sensor, daemon=True)
    if ends != "never":
        thread.start()
    try:
        result = dlq_operations.execute_in_process(
            run_config={"ops": {"dlq_operation": {"config": {
                "action": "replay", "job_type": "send_email", "dry_run": False,
                "allow_repeat": [1, 2, 3, 4], "canary": 1,
                "canary_timeout": 1 if ends == "never" else 60}}}},
            resources={"dlq": DlqResource(database_url=db_url)},
            instance=dg.DagsterInstance.ephemeral(),
            raise_on_error=False,
        )
    finally:
        stop.set()
        if ends != "never":
            thread.join(timeout=10)
    if ends != "never":  # the rest stayed open while the canary was out
        assert while_waiting == [{1: "replay_requested", 2: "open", 3: "open", 4: "open"}]
    if ends == "resolved":
        assert result.success
        out = result.output_for_node("dlq_operation")
        assert out["canaries"] == [1] and out["changed"] == [1, 2, 3, 4]
        assert _status(store) == {1: "resolved", 2: "replay_requested", 3: "replay_requested",
                                  4: "replay_requested"}
        return
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    message = str(failure.event_specific_data.error)  # type: ignore[union-attr]
    assert ("canary 1 failed again" if ends == "fails_again" else "not ended after 1s") in message
    assert "not replayed: [2, 3, 4]" in message
    assert _status(store) == {1: "open" if ends == "fails_again" else "replay_requested",
                              2: "open", 3: "open", 4: "open"}
    assert store.audit(2)[-1]["action"] == "replay_skipped"


def test_dlq_operations_refuses_a_bad_canary_naming_the_field(db: Database, db_url: str) -> None:
    store = _seed(db)
    result = dlq_operations.execute_in_process(
        run_config={"ops": {"dlq_operation": {"config": {
            "action": "replay", "job_type": "send_email", "dry_run": False, "canary": 0}}}},
        resources={"dlq": DlqResource(database_url=db_url)},
        instance=dg.DagsterInstance.ephemeral(),
        raise_on_error=False,
    )
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert "canary" in str(failure.event_specific_data.error)  # type: ignore[union-attr]
    assert set(_status(store).values()) == {"open"}
    assert DlqStatus.OPEN is store.get(1).status
