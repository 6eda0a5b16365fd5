"""The CLI at its edges: ``sekali enqueue --payload @FILE | -``, ``sekali rejections list|show``,
and every id argument bounded (exit 2 and one line, never a traceback)."""

from __future__ import annotations

import datetime as dt
import io
import json
import sys
from pathlib import Path

import pytest

from engine.requests import RequestStore
from resources.dlq import DlqStore, FailureInfo
from resources.storage.db import Database
from tests.cli_support import one_line, run_cli

PAYMENT = '{"order_id": "o-cli", "amount_cents": 990, "currency": "EUR"}'


@pytest.mark.parametrize(
    "argv",
    [
        ["dlq", "show", "99999999999999999999"],
        ["dlq", "replay", "99999999999999999999"],
        ["dlq", "discard", "99999999999999999999", "--reason", "r"],
        ["dlq", "show", "-1"],
        ["dlq", "show", "abc"],
        ["rejections", "show", "99999999999999999999"],
        ["rejections", "show", "0"],
        ["rejections", "list", "--limit", "99999999999999999999"],
    ],
    ids=lambda argv: " ".join(argv),
)
def test_every_id_argument_is_bounded(
    db: Database, db_url: str, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    """Catches: ``sekali dlq show|replay|discard 99999999999999999999`` raising OverflowError
    (SQLite) or a driver error (Postgres) with a traceback."""
    code, out, err = run_cli(capsys, *argv, "--url", db_url)
    assert code == 2 and out == ""
    assert "id" in one_line(err) or "limit" in err


@pytest.mark.parametrize(
    "argv",
    [["dlq", "show", "4242"], ["dlq", "discard", "4242", "--reason", "r"],
     ["dlq", "replay", "4242"], ["rejections", "show", "4242"]],
    ids=lambda argv: " ".join(argv),
)
def test_a_missing_record_is_exit_2_and_one_line(
    db: Database, db_url: str, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    code, out, err = run_cli(capsys, *argv, "--url", db_url)
    assert code == 2 and out == ""
    assert "4242" in one_line(err)


def test_enqueue_reads_the_payload_from_a_file_or_stdin(
    db: Database, db_url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Catches: ``--payload @file`` or ``-`` taken as JSON text (a payload too large for a
    command line cannot be sent at all)."""
    path = tmp_path / "payload.json"
    path.write_text(PAYMENT)
    code, out, err = run_cli(capsys, "enqueue", "charge_payment", "--payload", f"@{path}",
                          "--url", db_url)
    assert code == 0, err
    assert "key=payment:o-cli" in out and "(created)" in out

    other = PAYMENT.replace("o-cli", "o-stdin")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(other.encode())))
    code, out, err = run_cli(capsys, "enqueue", "charge_payment", "--payload", "-", "--url", db_url)
    assert code == 0, err
    assert "key=payment:o-stdin" in out

    code, out, err = run_cli(capsys, "enqueue", "charge_payment", "--payload",
                          f"@{tmp_path / 'missing.json'}", "--url", db_url)
    assert code == 2 and "missing.json" in one_line(err)

    path.write_bytes(b'{"order_id": "o-\xff", "amount_cents": 5}')  # not UTF-8
    code, out, err = run_cli(capsys, "enqueue", "charge_payment", "--payload", f"@{path}",
                          "--url", db_url)
    assert code == 2 and "order_id" in one_line(err) and "surrogate" in err
    assert RequestStore(db).counts()["pending"] == 2


def test_rejections_list_and_show_say_what_was_refused(
    db: Database, db_url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Catches: refusals that can only be read with SQL, or a view that prints the 1 MB."""
    path = tmp_path / "big.json"
    big = json.dumps({"order_id": "o-big", "amount_cents": 5, "note": "x" * 1_000_000})
    path.write_text(big)
    code, _, err = run_cli(capsys, "enqueue", "charge_payment", "--payload", f"@{path}",
                        "--url", db_url)
    assert code == 2 and "payload_bytes" in one_line(err)
    code, _, err = run_cli(capsys, "enqueue", "charge_payment", "--payload", '{"order_id": 1}',
                        "--url", db_url)
    assert code == 2 and "amount_cents: required" in one_line(err)

    code, out, _ = run_cli(capsys, "rejections", "list", "--json", "--url", db_url)
    assert code == 0
    listed = json.loads(out)
    assert [r["field"] for r in listed] == ["amount_cents", "payload"]  # newest first
    assert {r["source"] for r in listed} == {"cli"}
    dt.datetime.fromisoformat(listed[0]["created_at"])

    code, out, _ = run_cli(capsys, "rejections", "show", str(listed[1]["id"]), "--json",
                        "--url", db_url)
    shown = json.loads(out)
    assert shown["payload_size"] == len(big) and len(shown["payload_sha256"]) == 64
    assert json.loads(shown["payload"]) == {"amount_cents": "<int>", "note": "<str 1000000>",
                                            "order_id": "<str 5>"}

    code, out, _ = run_cli(capsys, "rejections", "list", "--url", db_url)
    assert code == 0 and "payload" in out and "amount_cents" in out and len(out) < 4000
    code, out, _ = run_cli(capsys, "rejections", "show", str(listed[1]["id"]), "--url", db_url)
    assert code == 0 and "o-big" not in out and "<str 5>" in out and len(out) < 8000


def test_dlq_show_prints_a_record_that_held_nul_and_surrogates(
    db: Database, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stored failure with escaped NUL and surrogates is readable from the CLI."""
    recorded = DlqStore(db).record_failure(
        FailureInfo(job_type="charge_payment", dedupe_key="request:1", error_type="DataError",
                    message="a\x00b \ud800", run_id="r-1", payload={"order_id": "o\x00\ud800"})
    )
    for extra in ([], ["--json"]):
        code, out, err = run_cli(capsys, "dlq", "show", str(recorded.record.id), *extra,
                              "--url", db_url)
        assert code == 0, err
        assert "\\u0000" in out
