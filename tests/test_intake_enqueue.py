"""``enqueue`` and ``sekali enqueue``: validation naming the field, nothing lost, no duplicates."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.intake import enqueue
from engine.requests import RequestStatus, RequestStore
from resources.errors import IdempotencyConflict, ValidationError
from resources.storage.db import Database

EMAIL = {"template": "welcome", "user_id": "u-1", "date": "2026-11-29", "to": "u1@example.com"}
SEKALI = str(Path(sys.executable).with_name("sekali"))


def test_key_defaults_to_the_job_types_intent_and_duplicates_are_no_ops(db: Database) -> None:
    """Catches: a key derived from the message instead of the intent; a duplicate request."""
    first = enqueue("send_email", EMAIL, correlation_id="c-1", db=db)
    again = enqueue("send_email", {**EMAIL, "user_id": " u-1 "}, db=db)  # normalised: same intent
    assert first.created and first.key == "email:welcome:u-1:2026-11-29"
    assert again.duplicate and again.id == first.id
    stored = RequestStore(db).get(first.id)
    assert stored is not None and stored.queue == "light" and stored.correlation_id == "c-1"
    assert stored.status is RequestStatus.PENDING


def test_same_key_other_payload_is_a_conflict_naming_the_key(db: Database) -> None:
    enqueue("send_email", EMAIL, key="my-key", db=db)
    with pytest.raises(IdempotencyConflict) as info:
        enqueue("send_email", {**EMAIL, "to": "other@example.com"}, key="my-key", db=db)
    assert info.value.key == "my-key" and "my-key" in str(info.value)


@pytest.mark.parametrize(
    ("job_type", "payload", "field"),
    [
        ("send_email", {**EMAIL, "date": "yesterday"}, "date"),
        ("send_email", {**EMAIL, "date": "2026-13-45"}, "date"),  # well-formed, no such day
        ("send_email", "{not json", "payload"),
        ("charge_payment", {"order_id": "o-1", "currency": "EUR"}, "amount_cents"),
        ("no_such_job", {}, "job_type"),
    ],
)
def test_bad_input_names_the_field_and_is_kept(
    db: Database, job_type: str, payload: object, field: str
) -> None:
    """Catches: bad input that is rejected without a trace, or an error that hides the field."""
    with pytest.raises(ValidationError) as info:
        enqueue(job_type, payload, db=db)  # type: ignore[arg-type]
    assert info.value.field == field
    store = RequestStore(db)
    assert [r["field"] for r in store.rejections()] == [field]
    assert sum(store.counts().values()) == 0


def test_enqueue_joins_the_callers_transaction(db: Database) -> None:
    """Catches: an outbox enqueue that commits on its own (a job for a change that never was)."""
    with pytest.raises(RuntimeError), db.transaction() as conn:
        made = enqueue("send_email", EMAIL, conn=conn)
        assert made.created
        raise RuntimeError("business change failed")
    assert RequestStore(db).get_by_key("email:welcome:u-1:2026-11-29") is None
    with db.transaction() as conn:
        made = enqueue("send_email", EMAIL, conn=conn)
    assert RequestStore(db).get(made.id) is not None


def _cli(db_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DATABASE_URL": db_url}
    return subprocess.run(
        [SEKALI, "enqueue", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_cli_enqueue_prints_the_request_and_exits_2_on_bad_input(sqlite_url: str) -> None:
    """Catches: a CLI that swallows validation errors or exits 0 on bad input."""
    payload = '{"template": "welcome", "user_id": "u-2", "date": "2026-11-29", "to": "a@b.io"}'
    made = _cli(sqlite_url, "send_email", "--payload", payload, "--correlation-id", "cli-1")
    assert made.returncode == 0, made.stderr
    assert "key=email:welcome:u-2:2026-11-29" in made.stdout and "(created)" in made.stdout
    again = _cli(sqlite_url, "send_email", "--payload", payload)
    assert again.returncode == 0 and "(duplicate)" in again.stdout
    bad = _cli(sqlite_url, "send_email", "--payload", payload.replace('"user_id": "u-2", ', ""))
    assert bad.returncode == 2 and bad.stderr.startswith("error: user_id: required")
    db = Database.from_url(sqlite_url)
    try:
        store = RequestStore(db)
        assert store.counts()["pending"] == 1
        assert [r["field"] for r in store.rejections()] == ["user_id"]
    finally:
        db.dispose()
