"""What the CLI shows: ``sekali requests list|show``, ``dlq list|show``, and each error once.

Human output: times ISO-8601 in the local zone (the subprocesses run with ``TZ`` east of UTC, so
a UTC time would show), payloads as JSON, an error said once and whole (no class name twice, no
word cut in half). ``--json`` is only JSON on stdout; ``--out PATH`` writes the same JSON.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from cli.commands.dlq import error_text
from engine.attempts import AttemptRecorder, Outcome
from engine.intake import enqueue
from engine.requests import RequestStore
from resources.dlq import DlqStore, FailureClass, FailureInfo
from resources.storage.db import Database

SEKALI = str(Path(sys.executable).with_name("sekali"))
EAST = "Asia/Jakarta"  # UTC+7, no daylight saving
PAYMENT = {"order_id": "o-view", "amount_cents": 990, "currency": "EUR"}
LONG_ERROR = ("PaymentDeclined: the card issuer declined the charge for this order because the "
              "account holder has insufficient funds available today; ask for another card")


def sekali(db_url: str, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DATABASE_URL": db_url, "TZ": EAST}
    return subprocess.run([SEKALI, *argv], capture_output=True, text=True, env=env, timeout=120)


def local_iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, tz=dt.timezone(dt.timedelta(hours=7))).isoformat(
        timespec="seconds")


class GatewayDown(Exception):
    pass


@pytest.fixture
def story(db: Database) -> dict[str, int]:
    """A completed request with two attempts (one retried), a failed one with a dead letter."""
    done = enqueue("charge_payment", PAYMENT, db=db).request
    store, attempts = RequestStore(db), AttemptRecorder(db)
    store.mark_running(done.id, run_id="run-one")
    for n, (outcome, error) in enumerate([(Outcome.RETRIED, GatewayDown("503 from upstream")),
                                          (Outcome.COMPLETED, None)]):
        record = attempts.start(attempts.new("charge_payment", attempt=n,
                                             idempotency_key=done.key, run_id="run-one",
                                             request_id=done.id))
        attempts.finish(record, outcome, error=error)
    store.mark_completed(done.id, run_id="run-one")
    failed = enqueue("charge_payment", {**PAYMENT, "order_id": "o-bad"}, db=db).request
    store.mark_running(failed.id, run_id="run-two")
    store.mark_failed(failed.id, LONG_ERROR, run_id="run-two")
    letter = DlqStore(db).record_failure(FailureInfo(
        job_type="charge_payment", dedupe_key=f"request:{failed.id}",
        error_type="PaymentDeclined", message=LONG_ERROR, run_id="run-two",
        error_class=FailureClass.PERMANENT, idempotency_key=failed.key, request_id=failed.id,
        payload={**PAYMENT, "order_id": "o-bad"}))
    return {"done": done.id, "failed": failed.id, "letter": letter.record.id}


def test_requests_list_filters_and_prints_json_or_a_table(
    db: Database, db_url: str, story: dict[str, int], tmp_path: Path
) -> None:
    """Catches: requests readable only with SQL; a --json mixed with progress; --out ignored."""
    listed = sekali(db_url, "requests", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert [r["id"] for r in rows] == [story["failed"], story["done"]]  # newest first
    failed = sekali(db_url, "requests", "list", "--status", "failed", "--json")
    assert [r["id"] for r in json.loads(failed.stdout)] == [story["failed"]]
    assert json.loads(sekali(db_url, "requests", "list", "--job-type", "send_email",
                             "--json").stdout) == []
    assert len(json.loads(sekali(db_url, "requests", "list", "--limit", "1", "--json").stdout)) == 1
    out = tmp_path / "requests.json"
    table = sekali(db_url, "requests", "list", "--out", str(out))
    assert table.returncode == 0
    assert json.loads(out.read_text()) == rows
    created = RequestStore(db).get(story["done"])
    assert created is not None
    assert local_iso(created.updated_at) in table.stdout  # local zone, ISO-8601
    assert "payment:o-view" in table.stdout and "completed" in table.stdout
    bad = sekali(db_url, "requests", "list", "--status", "lost")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_requests_show_prints_every_field_attempts_runs_and_outcome(
    db: Database, db_url: str, story: dict[str, int]
) -> None:
    """Catches: a view missing the attempts, the runs, a field of the record, or the outcome."""
    by_key = sekali(db_url, "requests", "show", "payment:o-view", "--json")
    assert by_key.returncode == 0, by_key.stderr
    data = json.loads(by_key.stdout)
    request = RequestStore(db).get(story["done"])
    assert request is not None
    assert set(data["request"]) == set(vars(request))  # every field of the record, by name
    assert data["request"]["payload"] == PAYMENT
    assert data["runs"] == ["run-one"]
    assert [a["outcome"] for a in data["attempts"]] == ["retried", "completed"]
    assert data["attempts"][0]["error_reason"] == "503 from upstream"
    assert data["attempts"][0]["error_class"] == "GatewayDown"
    assert data["outcome"] == "completed (last attempt: completed)"

    human = sekali(db_url, "requests", "show", str(story["done"]))
    assert human.returncode == 0, human.stderr
    assert json.dumps(PAYMENT, sort_keys=True) in human.stdout  # JSON, not a Python dict
    assert local_iso(request.created_at) in human.stdout
    assert "503 from upstream" in human.stdout and "run-one" in human.stdout

    failed = json.loads(sekali(db_url, "requests", "show", str(story["failed"]), "--json").stdout)
    assert failed["outcome"] == "dead_lettered"
    assert [d["id"] for d in failed["dead_letters"]] == [story["letter"]]

    missing = sekali(db_url, "requests", "show", "no-such-key")
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        "error: no request with id or key 'no-such-key'; see `sekali requests list`"]


def test_requests_list_says_what_happened_and_cancel_says_what_it_did(
    db: Database, db_url: str, story: dict[str, int]
) -> None:
    """Catches: ``requests list`` saying ``failed`` for a dead-lettered request; a cancel that
    does not say per request what it did, exits 0 when one was refused, or is not kept (who,
    why, when) where ``requests show`` prints it."""
    rows = json.loads(sekali(db_url, "requests", "list", "--json").stdout)
    assert {r["id"]: r["state"] for r in rows} == {
        story["failed"]: "dead_lettered", story["done"]: "completed"}
    waiting = enqueue("charge_payment", {**PAYMENT, "order_id": "o-wait"}, db=db).request
    cancel = sekali(db_url, "requests", "cancel", str(waiting.id), "payment:o-view",
                    "--reason", "sent by mistake", "--by", "ops@example", "--json")
    assert cancel.returncode == 1, cancel.stderr  # the completed one was refused
    decided = json.loads(cancel.stdout)
    assert [(d["id"], d["cancel"]) for d in decided] == [
        (waiting.id, "cancelled"), (story["done"], "refused")]
    assert "completed" in decided[1]["detail"]
    shown = json.loads(sekali(db_url, "requests", "show", str(waiting.id), "--json").stdout)
    assert shown["outcome"] == "cancelled"
    assert shown["request"]["cancel_by"] == "ops@example"
    assert shown["request"]["cancel_reason"] == "sent by mistake"
    assert shown["request"]["cancel_decided_at"].startswith(local_iso(waiting.created_at)[:10])
    human = sekali(db_url, "requests", "cancel", str(waiting.id), "--reason", "again")
    assert human.returncode == 0 and human.stdout.startswith(f"{waiting.id}: cancelled: ")
    unknown = sekali(db_url, "requests", "cancel", "no-such-key", "--reason", "x")
    assert unknown.returncode == 2
    blank = sekali(db_url, "requests", "cancel", str(waiting.id), "--reason", " ")
    assert blank.returncode == 2 and "--reason" in blank.stderr


def test_dlq_show_and_list_print_times_in_the_local_zone_json_payloads_and_whole_words(
    db: Database, db_url: str, story: dict[str, int]
) -> None:
    """Catches: epoch floats, a Python dict, the class name twice, an error cut mid-word."""
    record = DlqStore(db).get(story["letter"])
    shown = sekali(db_url, "dlq", "show", str(record.id))
    assert shown.returncode == 0, shown.stderr
    assert local_iso(record.last_failed_at) in shown.stdout
    assert str(record.last_failed_at) not in shown.stdout
    assert json.dumps({**PAYMENT, "order_id": "o-bad"}, sort_keys=True) in shown.stdout
    listed = sekali(db_url, "dlq", "list")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.count("PaymentDeclined") == 1
    assert local_iso(record.last_failed_at) in listed.stdout
    words = " ".join(listed.stdout.split())  # the table may wrap the error between words
    assert LONG_ERROR.split(": ", 1)[1][:60] in words
    for word in LONG_ERROR.replace(";", "").split():
        assert f" {word}" in f" {words}", word  # every word whole
    assert json.loads(sekali(db_url, "dlq", "list", "--json").stdout)[0]["id"] == record.id


@pytest.mark.parametrize(("payload", "message"), [
    ({**PAYMENT, "amount_cents": "lots"}, 'amount_cents: must be an integer, got "lots"'),
    ({"order_id": "o-1"}, "amount_cents: required: an integer"),
    ({**PAYMENT, "currency": "EURO"},
     'currency: must be a three-letter ISO code such as EUR, got "EURO"'),
    ({**PAYMENT, "order_id": ""}, 'order_id: must be a non-empty string, got ""'),
])
def test_enqueue_says_each_error_once_and_what_is_wrong(
    sqlite_url: str, payload: dict[str, object], message: str
) -> None:
    """Catches: an error printed twice, or "required" said of a field that is present."""
    done = sekali(sqlite_url, "enqueue", "charge_payment", "--payload", json.dumps(payload))
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"error: {message} (kept as rejection ")


@pytest.mark.parametrize(
    ("message", "shown"),
    [
        ("pipelines.domain.inventory.UnknownSku: no sku nope", "UnknownSku: no sku nope"),
        ("UnknownSku: no sku nope", "UnknownSku: no sku nope"),
        ("no sku nope", "UnknownSku: no sku nope"),
    ],
)
def test_dlq_error_names_the_class_once(message: str, shown: str) -> None:
    """Catches: ``UnknownSku: pipelines.domain.inventory.UnknownSku: ...`` in ``dlq list``."""
    record = SimpleNamespace(error_type="UnknownSku")
    assert error_text(record, {"last_error": message}) == shown
