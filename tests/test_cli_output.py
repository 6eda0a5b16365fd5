"""Every ``--json`` means JSON on stdout and ``--out PATH`` writes the same JSON to a file
(doctor, metrics show, dlq list/show, rejections, requests, enqueue); in dev the doctor counts the
charges of ``sekali dev``'s sandbox gateway without being told where they are."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
from sqlalchemy import create_engine

from engine.intake import enqueue
from resources.dlq import DlqStore, FailureInfo
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from sandbox.gateway import ChargeLedger

SEKALI = str(Path(sys.executable).with_name("sekali"))
PAYMENT = {"order_id": "o-out", "amount_cents": 990, "currency": "EUR"}


def sekali(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SEKALI, *argv], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=180)


@pytest.fixture
def db(sqlite_url: str) -> Iterator[Database]:
    """SQLite only: these are the CLI's contracts, the stores are proven on both elsewhere."""
    database = Database.from_url(sqlite_url)
    upgrade(database)
    try:
        yield database
    finally:
        database.dispose()


@pytest.fixture
def db_url(sqlite_url: str) -> str:
    return sqlite_url


@pytest.fixture
def env(db: Database, db_url: str, redis_url: str, tmp_path: Path) -> dict[str, str]:
    request = enqueue("charge_payment", PAYMENT, db=db).request
    DlqStore(db).record_failure(FailureInfo(
        job_type="charge_payment", dedupe_key=f"request:{request.id}", error_type="Declined",
        message="declined", run_id="r-1", request_id=request.id, payload=PAYMENT))
    enqueue_bad = sekali({"DATABASE_URL": db_url}, "enqueue", "charge_payment", "--payload", "{}")
    assert enqueue_bad.returncode == 2
    state = tmp_path / "state"
    state.mkdir()
    return {"DATABASE_URL": db_url, "REDIS_URL": redis_url, "SEKALI_STATE_DIR": str(state),
            "SEKALI_GATEWAY_URL": "http://127.0.0.1:9"}


@pytest.mark.parametrize("argv", [
    ["doctor", "--check", "dlq"],
    ["metrics", "show"],
    ["dlq", "list"],
    ["dlq", "show", "1"],
    ["rejections", "list"],
    ["rejections", "show", "1"],
    ["requests", "list"],
    ["requests", "show", "1"],
    ["enqueue", "charge_payment", "--payload", json.dumps(PAYMENT)],
])
def test_json_is_only_json_on_stdout_and_out_writes_the_same(
    env: dict[str, str], tmp_path: Path, argv: list[str]
) -> None:
    """Catches: a --json stdout with a progress line in it; a command without --out; a time
    printed as epoch seconds (the README promises ISO-8601 with the zone)."""
    printed = sekali(env, *argv, "--json")
    assert printed.returncode in (0, 1), printed.stderr  # doctor: 1 when a check fails
    data = json.loads(printed.stdout)
    for key, value in _times(data):
        assert isinstance(value, str), (key, value)
        assert datetime.fromisoformat(value).tzinfo is not None, (key, value)
    out = tmp_path / "out.json"
    written = sekali(env, *argv, "--out", str(out))
    assert written.returncode == printed.returncode, written.stderr
    assert set(_keys(json.loads(out.read_text()))) == set(_keys(data))
    if argv[0] != "enqueue":  # the human view is not JSON
        with pytest.raises(json.JSONDecodeError):
            json.loads(written.stdout)


def _times(data: object) -> list[tuple[str, object]]:
    """Every (key, value) under a time key (``*_at``, ``at``), outside payloads."""
    if isinstance(data, list):
        return [t for item in data for t in _times(item)]
    if not isinstance(data, dict):
        return []
    found = [(k, v) for k, v in data.items() if (k == "at" or k.endswith("_at")) and v is not None]
    return found + [t for k, v in data.items() if k != "payload" for t in _times(v)]


def _keys(data: object) -> list[str]:
    if isinstance(data, list):
        return [k for item in data[:1] for k in _keys(item)]
    return list(data) if isinstance(data, dict) else []


def test_doctor_counts_the_sandbox_gateway_charges_of_sekali_dev_by_default(
    db: Database, db_url: str, redis_url: str, tmp_path: Path
) -> None:
    """Catches: a doctor in dev that never sees the sandbox gateway's double charge."""
    state = tmp_path / "state"
    state.mkdir()
    engine = create_engine(f"sqlite:///{state / 'gateway.db'}")  # where `sekali dev` keeps it
    ledger = ChargeLedger(engine)
    for _ in range(2):  # a provider that ignored the key: one intent, two charges
        ledger.charge(reference="ord-1", amount_cents=5, currency="EUR", idempotency_key="k",
                      correlation_id=None, honour_key=False)
    engine.dispose()
    base = {"DATABASE_URL": db_url, "REDIS_URL": redis_url, "SEKALI_STATE_DIR": str(state)}
    env = {k: v for k, v in os.environ.items() if k != "SEKALI_GATEWAY_URL"}
    run = subprocess.run([SEKALI, "doctor", "--check", "real_duplicates", "--json"],
                         capture_output=True, text=True, env={**env, **base}, timeout=180)
    (finding,) = json.loads(run.stdout)
    assert not finding["passed"] and "gateway_charges" in finding["found"], finding
    assert run.returncode == 1
    assert "sandbox gateway" in run.stderr
    # Another downstream configured: its charges are not the sandbox file's.
    other = subprocess.run([SEKALI, "doctor", "--check", "real_duplicates", "--json"],
                           capture_output=True, text=True, timeout=180,
                           env={**env, **base, "SEKALI_GATEWAY_URL": "https://pay.example"})
    (finding,) = json.loads(other.stdout)
    assert finding["passed"] and "no downstream ledger" in finding["found"]


@pytest.mark.skipif(os.geteuid() != 0, reason="sekali cluster needs root")
def test_cluster_status_json_and_out(tmp_path: Path) -> None:
    """Catches: a cluster status whose --out is missing or differs from its --json."""
    state = str(tmp_path / "cluster")
    printed = sekali({}, "cluster", "status", "--state", state, "--json")
    assert json.loads(printed.stdout)["phase"] == "absent"
    out = tmp_path / "status.json"
    written = sekali({}, "cluster", "status", "--state", state, "--out", str(out))
    assert written.returncode == printed.returncode == 1  # absent is not healthy
    assert json.loads(out.read_text()) == json.loads(printed.stdout)
    assert written.stdout.startswith("no cluster recorded in ")


def test_dlq_replay_and_discard_json(env: dict[str, str], tmp_path: Path) -> None:
    """Catches: replay/discard decisions printed as text into --json stdout."""
    dry = sekali(env, "dlq", "replay", "1", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    # the dry run shows each record's verdict (the record names no key to look up: unknown,
    # so a real replay would need --allow-repeat)
    assert json.loads(dry.stdout) == {"decisions": [
        {"id": 1, "replay": True, "reason": "would replay (dry run)", "key_reset": False,
         "verdict": "unknown", "evidence": "the record names no idempotency key to look up",
         "effects": [], "fails_again": False}], "refused": [], "unregistered": [],
        "fails_again": []}
    out = tmp_path / "discard.json"
    gone = sekali(env, "dlq", "discard", "1", "--reason", "test", "--json", "--out", str(out))
    assert gone.returncode == 0, gone.stderr
    assert json.loads(gone.stdout) == json.loads(out.read_text()) == [
        {"id": 1, "discarded": True, "reason": "discarded"}]
