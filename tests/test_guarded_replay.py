"""Guarded bulk replay (``sekali dlq replay``), SQLite and Postgres, against the real sandbox
gateway: each record's verdict says whether replaying it would repeat its side effect, with the
evidence (the ledger's completed key, the charge the job type's lookup finds at the gateway, a
downstream that cannot be asked), and a real replay refuses the records whose effect was found or
cannot be ruled out unless ``--allow-repeat`` names them, replaying the others."""

from __future__ import annotations

import json
import time

import pytest

from cli.main import main as cli
from pipelines.domain.payments import HttpPaymentGateway
from pipelines.jobs.payment import reference_for
from resources.dlq import DlqStatus, DlqStore, FailureClass, FailureInfo
from resources.idempotency import IdempotencyStore
from resources.storage.db import Database
from sandbox.gateway import GatewayServer

KEYS = {
    1: ("charge_payment", "payment:o-done"),  # completed in the ledger
    2: ("charge_payment", "payment:o-charged"),  # charged at the gateway, record kept
    3: ("charge_payment", "payment:o-never"),  # never charged
    4: ("send_email", "email:welcome:u4:2026-12-01"),  # the mail record cannot be read
}


def _seed(db: Database, gateway: GatewayServer) -> DlqStore:
    store, ledger = DlqStore(db), IdempotencyStore(db)
    for i, (job_type, key) in KEYS.items():
        claim = ledger.begin(key)
        if i == 1:
            ledger.complete(claim, {"charge_id": "ch-1"})  # type: ignore[arg-type]
        else:
            ledger.fail(claim, "boom", "permanent")  # type: ignore[arg-type]
        store.record_failure(
            FailureInfo(
                job_type=job_type,
                dedupe_key=f"request:{i}",
                error_type="GatewayUnavailable",
                message="timeout",
                error_class=FailureClass.TRANSIENT,
                run_id=f"r{i}",
                idempotency_key=key,
                failed_at=time.time() - 60,
            )
        )
    HttpPaymentGateway(gateway.url).charge(
        reference=reference_for(KEYS[2][1]), amount_cents=700, currency="EUR",
        idempotency_key="first-attempt",
    )
    return store


def test_dry_run_gives_verdicts_and_a_replay_refuses_a_possible_repeat(
    db: Database, db_url: str, gateway: GatewayServer, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Catches: a dry run that cannot tell a completed key or a charge already at the gateway
    from a safe record, a verdict "safe" for a downstream that cannot be asked, a real replay
    that repeats a found or unknowable effect without being told to, or one refusal that stops
    the safe records too."""
    monkeypatch.setenv("SEKALI_GATEWAY_URL", gateway.url)
    monkeypatch.delenv("SEKALI_SMTP_LOG_URL", raising=False)
    store = _seed(db, gateway)
    ids = [str(i) for i in KEYS]
    url = ["--url", db_url]

    assert cli(["dlq", "replay", *ids, "--dry-run", "--json", *url]) == 0
    out = json.loads(capsys.readouterr().out)
    verdicts = {d["id"]: d["verdict"] for d in out["decisions"]}
    assert verdicts == {1: "completed", 2: "effect_found", 3: "safe", 4: "unknown"}
    evidence = {d["id"]: d for d in out["decisions"]}
    assert "stored result" in evidence[1]["evidence"]
    assert evidence[2]["effects"] == [c["charge_id"] for c in gateway.charges()]
    assert "cannot answer" in evidence[4]["evidence"]
    assert all(store.get(i).status is DlqStatus.OPEN for i in KEYS)

    assert cli(["dlq", "replay", *ids, "--json", *url]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["refused"] == [2, 4]
    assert "--allow-repeat 2,4" in captured.err
    for i in (2, 4):
        assert store.get(i).status is DlqStatus.OPEN
        assert store.audit(i)[-1]["action"] == "replay_skipped"
        assert IdempotencyStore(db).get(KEYS[i][1]).status == "failed"
    assert store.get(3).status is DlqStatus.REPLAY_REQUESTED

    assert cli(["dlq", "replay", "2", "--allow-repeat", "2", *url]) == 0
    assert store.get(2).status is DlqStatus.REPLAY_REQUESTED
    assert store.get(4).status is DlqStatus.OPEN
    assert len(gateway.charges()) == 1  # asking never charges

    with pytest.raises(SystemExit) as usage:
        cli(["dlq", "replay", "4", "--allow-repeat", "x", *url])
    assert usage.value.code == 2
    assert cli(["dlq", "replay", "4", "--allow-repeat", "3", *url]) == 2
    assert "allow_repeat" in capsys.readouterr().err
