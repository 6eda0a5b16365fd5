"""``sekali enqueue --wait`` and ``sekali dlq replay --wait``: the CLI follows the work to its end.

The CLI runs as a subprocess (its contract is stdout, stderr and the exit code); the test drives
the request meanwhile: with the real intake sensor and a run executed in-process on a real
(ephemeral) Dagster instance for the success, through the owner stores for the failures (a
failed run and its dead letter, a replay that fails again or succeeds).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import dagster as dg
import pytest

from cli.commands.follow import record_progress, request_progress
from engine import tags as tag
from engine.intake import enqueue
from engine.requests import RequestStatus, RequestStore
from pipelines.definitions import intake_sensor
from pipelines.ops import send_email_job
from resources.dlq import DlqStore, FailureClass, FailureInfo
from resources.storage.db import Database
from sandbox.mailsink import MailSink
from sensors.intake import RequestsResource
from tests.job_workers import dagster_resources

SEKALI = str(Path(sys.executable).with_name("sekali"))
EMAIL = {"template": "welcome", "user_id": "u-7", "date": "2026-11-29", "to": "u7@example.com"}
KEY = "email:welcome:u-7:2026-11-29"
T = TypeVar("T")


def start(db_url: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "DATABASE_URL": db_url}
    return subprocess.Popen([SEKALI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=180)
    return proc.returncode, out, err


def until(what: str, probe: Callable[[], T | None], proc: subprocess.Popen[str]) -> T:
    """Poll ``probe`` until truthy; fail with the CLI's output if the CLI ended first."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"CLI ended before {what}: {proc.communicate()}")
        time.sleep(0.1)
    raise AssertionError(f"never saw {what}")


@pytest.fixture
def world(db: Database, db_url: str, tmp_path: Path, redis_url: str, namespace: str,
          redis_client: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    monkeypatch.setenv("SEKALI_INTAKE_MODE", "per_request")  # a run of its own, followed
    sink = MailSink(f"sqlite:///{tmp_path / 'sink.db'}").start()
    resources = dagster_resources(db_url=db_url, redis_url=redis_url, namespace=namespace,
                                  smtp_port=sink.port)
    resources["requests"] = RequestsResource(database_url=db_url)
    try:
        with dg.DagsterInstance.ephemeral() as instance:
            yield {"resources": resources, "instance": instance, "sink": sink}
    finally:
        sink.stop()


@pytest.mark.dagster
def test_enqueue_wait_follows_the_request_through_a_real_run_to_completed(
    db: Database, db_url: str, world: dict[str, Any]
) -> None:
    """Catches: a --wait that returns before the work ends, or misses the run that did it."""
    proc = start(db_url, "enqueue", "send_email", "--payload", json.dumps(EMAIL), "--wait",
                 "--timeout", "150", "--json")
    store = RequestStore(db)
    until("the request", lambda: store.get_by_key(KEY), proc)
    instance, resources = world["instance"], world["resources"]

    def tick(cursor: str | None = None) -> dg.SensorResult:
        result = intake_sensor(dg.build_sensor_context(
            instance=instance, cursor=cursor, resources={"requests": resources["requests"]}))
        assert isinstance(result, dg.SensorResult)
        return result

    first = tick()
    (run_request,) = first.run_requests
    until("claimed", lambda: store.get_by_key(KEY).status is RequestStatus.LAUNCHED, proc)
    executed = send_email_job.execute_in_process(
        run_config=run_request.run_config, instance=instance, resources=resources,
        tags={**run_request.tags, "dagster/run_key": run_request.run_key or ""},
    )
    assert executed.success
    tick(first.cursor)
    code, out, err = finish(proc)
    assert code == 0, err
    final = json.loads(out)  # stdout is only the JSON
    assert final["state"] == "completed" and final["ok"] and not final["timed_out"]
    assert final["run_id"] == executed.run_id
    assert final["request"]["key"] == KEY and final["request"]["status"] == "completed"
    assert "u7@example.com" not in out  # the personal field is masked
    assert "queued" in err and "completed" in err and executed.run_id in err
    assert int(run_request.tags[tag.REQUEST_ID]) == final["id"]


def _fail_with_dead_letter(db: Database, request_id: int, run_id: str) -> int:
    """What a failed run leaves: the request failed, a dead letter keeping it."""
    store = RequestStore(db)
    store.claim_for_launch(10)
    store.mark_running(request_id, run_id=run_id)
    store.mark_failed(request_id, "SmtpRefused: 550 no such user", run_id=run_id)
    recorded = DlqStore(db).record_failure(FailureInfo(
        job_type="send_email", dedupe_key=f"request:{request_id}", error_type="SmtpRefused",
        message="550 no such user", run_id=run_id, error_class=FailureClass.PERMANENT,
        idempotency_key=KEY, request_id=request_id, payload=EMAIL))
    return recorded.record.id


def test_enqueue_wait_exits_1_when_the_request_is_dead_lettered(
    db: Database, db_url: str
) -> None:
    """Catches: a --wait that exits 0 (or never ends) when the work failed for good."""
    proc = start(db_url, "enqueue", "send_email", "--payload", json.dumps(EMAIL), "--wait",
                 "--timeout", "150")
    store = RequestStore(db)
    request = until("the request", lambda: store.get_by_key(KEY), proc)
    record_id = _fail_with_dead_letter(db, request.id, "run-failed-1")
    code, out, err = finish(proc)
    assert code == 1, (out, err)
    assert f"request {request.id}: dead-lettered" in err
    assert f"sekali dlq show {record_id}" in err
    assert "run-failed-1" in err
    assert "dead-lettered" in out


def test_enqueue_wait_times_out_saying_where_it_stood(sqlite_url: str) -> None:
    """Catches: a --wait with nothing driving it that hangs, or exits 0."""
    proc = start(sqlite_url, "enqueue", "send_email", "--payload", json.dumps(EMAIL), "--wait",
                 "--timeout", "1", "--json")
    code, out, err = finish(proc)
    assert code == 1
    assert "timed out after 1s: request 1 still queued (attempts 0, no run yet)" in err
    final = json.loads(out)
    assert final["timed_out"] and final["state"] == "queued" and not final["ok"]


def test_enqueue_without_wait_json_is_only_json(sqlite_url: str) -> None:
    """Catches: progress or log lines mixed into --json stdout."""
    proc = start(sqlite_url, "enqueue", "send_email", "--payload", json.dumps(EMAIL), "--json")
    code, out, err = finish(proc)
    assert code == 0, err
    assert json.loads(out) == {"id": 1, "key": KEY, "status": "pending", "created": True,
                               "job_type": "send_email"}


@pytest.mark.parametrize("replay_ends", ["resolved", "fails_again"])
def test_dlq_replay_wait_follows_the_record_to_its_end(
    db: Database, db_url: str, replay_ends: str
) -> None:
    """Catches: a replay --wait that does not see the replay end, or reads a failure as done."""
    from engine.intake import enqueue

    request = enqueue("send_email", EMAIL, db=db).request
    record_id = _fail_with_dead_letter(db, request.id, "run-failed-1")
    # no mail log to ask: the guard cannot tell whether the mail went, so the replay is allowed
    proc = start(db_url, "dlq", "replay", str(record_id), "--allow-repeat", str(record_id),
                 "--wait", "--timeout", "150", "--json")
    dlq, store = DlqStore(db), RequestStore(db)
    until("replay requested", lambda: str(dlq.get(record_id).status) == "replay_requested", proc)
    # the follower's first look at the record (before the replay runs) is on stderr first
    assert proc.stderr is not None
    said: list[str] = []
    for line in proc.stderr:
        said.append(line)
        if f"dead letter {record_id}: replay requested" in line:
            break
    (claimed,) = dlq.claim_for_replay(5)
    store.requeue(request.id)
    store.mark_running(request.id, run_id="run-replay-1")
    if replay_ends == "resolved":
        store.mark_completed(request.id, run_id="run-replay-1")
        dlq.resolve(record_id, actor="test")
    else:
        store.mark_failed(request.id, "SmtpRefused: 550 again", run_id="run-replay-1")
        dlq.record_failure(FailureInfo(
            job_type="send_email", dedupe_key=f"request:{request.id}", error_type="SmtpRefused",
            message="550 again", run_id="run-replay-1", error_class=FailureClass.PERMANENT,
            idempotency_key=KEY, request_id=request.id, payload=EMAIL, dlq_id=record_id))
    code, out, rest = finish(proc)
    err = "".join(said) + rest
    data = json.loads(out)
    (final,) = data["final"]
    assert final["run_id"] == "run-replay-1"
    if replay_ends == "resolved":
        assert code == 0, err
        assert final["state"] == "completed" and final["ok"]
    else:
        assert code == 1, err
        assert final["state"] == "dead-lettered" and not final["ok"]
        assert f"dead letter {record_id} ended dead-lettered: replay failed" in err
    # before the replay runs, the run shown is not the one that failed before
    assert f"dead letter {record_id}: replay requested, attempts 1, no run yet" in err


@pytest.mark.parametrize("timeout", ["0", "-3", "nan", "soon"])
def test_a_timeout_that_is_not_a_positive_number_is_bad_usage(
    sqlite_url: str, timeout: str
) -> None:
    """Catches: a --wait that never waits (0, negative) or a traceback for a bad number."""
    done = finish(start(sqlite_url, "enqueue", "send_email", "--payload", json.dumps(EMAIL),
                        "--wait", "--timeout", timeout))
    assert done[0] == 2 and done[1] == ""
    assert done[2].strip().splitlines() == [
        f"sekali enqueue: error: argument --timeout: {timeout!r} is not a positive number of "
        "seconds"]


def test_enqueue_wait_on_a_failed_request_waits_for_its_dead_letter(
    db: Database, db_url: str
) -> None:
    """Catches: a --wait that ends on ``failed`` between the run's failure and its dead letter
    (the DLQ sensor writes it ticks later), so the user never learns the record's id."""
    proc = start(db_url, "enqueue", "send_email", "--payload", json.dumps(EMAIL), "--wait",
                 "--timeout", "150")
    store = RequestStore(db)
    request = until("the request", lambda: store.get_by_key(KEY), proc)
    store.claim_for_launch(10)
    store.mark_running(request.id, run_id="run-failed-1")
    store.mark_failed(request.id, "SmtpRefused: 550 no such user", run_id="run-failed-1")
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:  # the CLI has seen the failure before the dead letter exists
        seen.append(line)
        if f"request {request.id}: failed" in line:
            break
    recorded = DlqStore(db).record_failure(FailureInfo(
        job_type="send_email", dedupe_key=f"request:{request.id}", error_type="SmtpRefused",
        message="550 no such user", run_id="run-failed-1", error_class=FailureClass.PERMANENT,
        idempotency_key=KEY, request_id=request.id, payload=EMAIL))
    code, out, err = finish(proc)
    assert code == 1, (seen, out, err)
    assert f"request {request.id}: dead-lettered" in err, (seen, err)
    assert f"sekali dlq show {recorded.record.id}" in err


def test_a_failed_request_without_a_dead_letter_ends_failed_after_the_grace(
    db: Database
) -> None:
    """Catches: a --wait that hangs to its timeout when nothing dead-letters the failure (no
    DLQ sensor running)."""
    from cli.commands.follow import request_progress
    from engine.intake import enqueue

    request = enqueue("send_email", EMAIL, db=db).request
    store = RequestStore(db)
    store.claim_for_launch(10)
    store.mark_running(request.id, run_id="run-failed-1")
    store.mark_failed(request.id, "SmtpRefused: 550 no such user", run_id="run-failed-1")
    now = [100.0]
    probe = request_progress(store, DlqStore(db), request.id, grace=30, clock=lambda: now[0])
    first = probe()
    assert first.state == "failed" and not first.done
    now[0] += 29
    assert not probe().done
    now[0] += 1
    last = probe()
    assert last.state == "failed" and last.done and not last.ok
    assert "waiting" not in last.detail and "550 no such user" in last.detail


def test_dlq_replay_patch_wait_follows_the_new_version_to_completed(
    db: Database, db_url: str
) -> None:
    """Catches: an amended replay that cannot be followed (``--patch`` refused ``--wait``), or a
    --wait that follows the superseded request instead of the new version."""
    from engine.intake import enqueue

    request = enqueue("send_email", EMAIL, db=db).request
    record_id = _fail_with_dead_letter(db, request.id, "run-failed-1")
    proc = start(db_url, "dlq", "replay", str(record_id), "--patch",
                 json.dumps({"to": "u7b@example.com"}), "--wait", "--timeout", "150", "--json")
    store = RequestStore(db)
    amended = until("the new version", lambda: store.get_by_key(f"{KEY}#v2"), proc)
    store.claim_for_launch(10)
    store.mark_running(amended.id, run_id="run-amended-1")
    store.mark_completed(amended.id, run_id="run-amended-1")
    code, out, err = finish(proc)
    assert code == 0, (out, err)
    data = json.loads(out)
    assert data["key"] == f"{KEY}#v2" and data["request_id"] == amended.id
    (final,) = data["final"]
    assert final["state"] == "completed" and final["ok"] and final["run_id"] == "run-amended-1"
    assert f"request {amended.id}: completed" in err


def test_a_followed_replay_of_a_record_without_a_request_names_its_run(db: Database) -> None:
    """Catches: ``dlq replay N --wait`` saying "dead-lettered, no run yet" after the replay run
    of a record with no request (a run launched by hand) ran and failed again; and a cancelled
    request that ``--wait`` cannot name."""
    dlq, store = DlqStore(db), RequestStore(db)
    info = FailureInfo(
        job_type="send_email", dedupe_key=f"key:send_email:{KEY}", error_type="SmtpRefused",
        message="550", run_id="run-by-hand", error_class=FailureClass.PERMANENT,
        idempotency_key=KEY, payload=EMAIL)
    record_id = dlq.record_failure(info).record.id
    dlq.request_replay([record_id], actor="test")
    dlq.claim_for_replay(5)
    dlq.record_failure(FailureInfo(**{**vars(info), "run_id": "run-replay-1",
                                      "dlq_id": record_id}))
    ended = record_progress(dlq, store, record_id)()
    assert (ended.state, ended.done, ended.run_id) == ("dead-lettered", True, "run-replay-1")
    assert "no run yet" not in ended.line()

    request = enqueue("send_email", {**EMAIL, "user_id": "u-8"}, db=db).request
    store.cancel(request.id, by="t", reason="not needed")
    cancelled = request_progress(store, dlq, request.id)()
    assert (cancelled.state, cancelled.done, cancelled.ok) == ("cancelled", True, False)
