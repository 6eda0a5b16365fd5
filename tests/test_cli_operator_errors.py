"""What the CLI says to an operator, in one line each: a state folder whose database was never
created, a job type this process does not know, a dead letter's failure, a replay that cannot
run here or will fail again, ids with gaps, and the papercuts a first user met (``refused:
refused:``, ``requests_command``, attempt 0 of 1, a ``fix:`` under a passed check, Dagster's
community dialog over the dev UI).

Runs ``sekali`` in process (``cli.main.main``) against the test's database on both backends, and
the real binary where the environment (``SEKALI_JOB_MODULES``, the state folder) is the point.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from engine.attempts import AttemptRecorder, Outcome
from engine.intake import enqueue
from engine.replay import Selection, Verdict, bulk_replay
from engine.requests import RequestStore
from resources.dlq import DlqStatus, DlqStore, FailureClass, FailureInfo
from resources.storage.db import Database
from tests.cli_support import one_line, run_cli

ROOT = Path(__file__).resolve().parents[1]
SEKALI = str(Path(sys.executable).with_name("sekali"))
PAYMENT = {"order_id": "o-op", "amount_cents": 990, "currency": "EUR"}
TRACE = ("Traceback (most recent call last):\n"
         + "".join(f'  File "/srv/app/step_{n}.py", line {n}, in step_{n}\n    go()\n'
                   for n in range(20))
         + "pipelines.domain.inventory.UnknownSku: sku 'nope' is not stocked")


def _dead_letter(db: Database, n: int, *, job_type: str = "reserve_inventory",
                 error_class: FailureClass = FailureClass.PERMANENT,
                 trace: str | None = TRACE) -> int:
    payload = {"cart_id": f"c-{n}", "items": [{"sku": "nope", "quantity": 1}]}
    return DlqStore(db).record_failure(FailureInfo(
        job_type=job_type, dedupe_key=f"request:{n}", error_type="UnknownSku",
        message="sku 'nope' is not stocked", run_id=f"run-{n}", error_class=error_class,
        idempotency_key=f"inventory-reserve:c-{n}", payload=payload, trace=trace,
    )).record.id


READERS = [
    ["requests"], ["requests", "list"], ["requests", "show", "1"],
    ["requests", "cancel", "1", "--reason", "r"],
    ["dlq", "list"], ["dlq", "show", "1"], ["dlq", "replay", "1", "--dry-run"],
    ["dlq", "discard", "1", "--reason", "r"],
    ["rejections", "list"], ["rejections", "show", "1"],
    ["outbox", "dead"], ["outbox", "replay", "1"], ["outbox", "discard", "1", "--reason", "r"],
    ["tenants", "list"], ["tenants", "set", "acme", "--weight", "2"],
    ["doctor"], ["metrics", "show"], ["db", "contract"],
]


@pytest.mark.parametrize("argv", READERS, ids=lambda argv: " ".join(argv))
def test_every_subcommand_on_a_database_never_created_says_so_in_one_line(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
) -> None:
    """Catches: ``no such table: job_requests`` with a SQLAlchemy traceback (or a doctor of 8
    failed checks) on a fresh state folder, and a reader that creates the SQLite file on the
    way. The line names the command that creates the database; nothing is written."""
    monkeypatch.setenv("DATABASE_URL", db_url)
    code, out, err = run_cli(capsys, *argv)
    line = one_line(err)
    assert code == 2 and out == "", (code, out, err)
    assert "no sekali database" in line and "`sekali db upgrade`" in line, line
    if db_url.startswith("sqlite"):
        assert not Path(db_url.removeprefix("sqlite:///")).exists()


def test_the_real_binary_on_an_empty_state_folder_exits_2_and_creates_nothing(
    tmp_path: Path,
) -> None:
    """The same through the installed ``sekali`` with only ``SEKALI_STATE_DIR`` set."""
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    env["SEKALI_STATE_DIR"] = str(tmp_path / "state")
    done = subprocess.run([SEKALI, "dlq", "list", "--json"], env=env, capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert one_line(done.stderr).startswith(
        f"error: no sekali database at {tmp_path / 'state' / 'app.db'} yet")
    assert not (tmp_path / "state").exists()


def test_sekali_requests_alone_lists_and_a_missing_subcommand_is_named_by_its_choices(
    db: Database, db_url: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Catches: ``the following arguments are required: requests_command``."""
    monkeypatch.setenv("DATABASE_URL", db_url)
    enqueue("charge_payment", PAYMENT, db=db)
    alone = run_cli(capsys, "requests")
    listed = run_cli(capsys, "requests", "list")
    assert alone[0] == 0 and alone == listed and "payment:o-op" in alone[1]
    code, _, err = run_cli(capsys, "dlq")
    assert code == 2
    assert one_line(err).endswith("required: {list,show,replay,discard}")
    assert "_command" not in err


def test_cancelling_a_completed_request_says_refused_once(
    db: Database, db_url: str, capsys: pytest.CaptureFixture[str],
) -> None:
    """Catches: ``payment:o-op: refused: refused: it had completed``."""
    made = enqueue("charge_payment", PAYMENT, db=db).request
    store = RequestStore(db)
    store.mark_running(made.id, run_id="run-1")
    store.mark_completed(made.id, run_id="run-1")
    code, out, _ = run_cli(capsys, "requests", "cancel", made.key, "--reason", "late",
                        "--url", db_url)
    assert code == 1
    assert out.startswith(f"{made.key}: refused: it had completed (at "), out
    assert "refused: refused" not in out


def test_attempts_are_numbered_from_one_as_the_attempts_count(
    db: Database, db_url: str, capsys: pytest.CaptureFixture[str],
) -> None:
    """Catches: ``attempts 1`` above an attempts table whose only row is numbered 0."""
    made = enqueue("charge_payment", PAYMENT, db=db).request
    store, attempts = RequestStore(db), AttemptRecorder(db)
    store.mark_running(made.id, run_id="run-1")
    row = attempts.start(attempts.new("charge_payment", attempt=0, idempotency_key=made.key,
                                      run_id="run-1", request_id=made.id))
    attempts.finish(row, Outcome.COMPLETED)
    store.mark_completed(made.id, run_id="run-1")
    code, out, _ = run_cli(capsys, "requests", "show", made.key, "--json", "--url", db_url)
    shown = json.loads(out)
    assert code == 0 and shown["request"]["attempts"] == 1
    assert [a["attempt"] for a in shown["attempts"]] == [1]
    code, out, _ = run_cli(capsys, "requests", "show", made.key, "--url", db_url)
    row_line = next(line for line in out.splitlines() if "run-1" in line and "completed" in line)
    assert " 1 " in row_line and " 0 " not in row_line, row_line


def _rejections(db: Database) -> int:
    with db.statement() as conn:
        return int(conn.execute(text("SELECT COUNT(*) FROM job_rejections")).scalar())


@pytest.mark.parametrize("modules", ["", "tests.crash_jobs"])
def test_enqueue_of_an_unregistered_job_type_exits_2_naming_the_variable_and_keeps_nothing(
    db: Database, db_url: str, tmp_path: Path, modules: str,
) -> None:
    """Catches: ``unknown job type (known: ...)`` with no hint at ``SEKALI_JOB_MODULES``, and
    a rejection row kept for an operator's mistake (the UI, with the variable set, knows it)."""
    env = {k: v for k, v in os.environ.items() if k != "SEKALI_JOB_MODULES"}
    if modules:
        env["SEKALI_JOB_MODULES"] = modules
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [SEKALI, "enqueue", "issue_refund", "--payload", '{"order_id": "o-1"}', "--url", db_url],
        env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    line = one_line(done.stderr)
    assert done.returncode == 2 and done.stdout == ""
    assert line.startswith('error: unknown job type "issue_refund"'), line
    assert "SEKALI_JOB_MODULES" in line and "charge_payment" in line
    assert "pipelines.jobs" in line
    assert (f"SEKALI_JOB_MODULES={modules}" if modules else "SEKALI_JOB_MODULES is not set") in line
    assert _rejections(db) == 0


def test_exit_status_3_is_documented_where_a_user_looks(db: Database, db_url: str) -> None:
    """Catches: ``sekali enqueue`` exiting 3 (the key taken by another payload) with the status
    said nowhere a user reads (``--help``, the README)."""
    helped = subprocess.run([SEKALI, "enqueue", "--help"], capture_output=True, text=True,
                            timeout=60)
    assert "  3  conflict: the key is taken by a request with another payload" in helped.stdout
    readme = (ROOT / "README.md").read_text()
    assert "exit 3 when the key is taken by another payload" in readme
    first = [SEKALI, "enqueue", "charge_payment", "--url", db_url, "--payload"]
    assert subprocess.run([*first, json.dumps(PAYMENT)], capture_output=True,
                          timeout=60).returncode == 0
    other = subprocess.run([*first, json.dumps({**PAYMENT, "amount_cents": 991})],
                           capture_output=True, text=True, timeout=60)
    assert other.returncode == 3, other.stderr


def test_dlq_show_says_a_classified_failure_in_one_line_and_its_trace_behind_trace(
    db: Database, db_url: str, capsys: pytest.CaptureFixture[str],
) -> None:
    """Catches: about 45 lines of stack trace under a plain ``UnknownSku`` (a refusal the job
    type declared permanent), and a trace hidden for a bug (class ``unknown``)."""
    plain = _dead_letter(db, 1)
    bug = _dead_letter(db, 2, error_class=FailureClass.UNKNOWN)
    code, out, _ = run_cli(capsys, "dlq", "show", str(plain), "--url", db_url)
    assert code == 0
    assert out.splitlines()[0] == (
        f"dead letter {plain} (open): permanent: UnknownSku: sku 'nope' is not stocked")
    assert "Traceback" not in out and "step_3.py" not in out
    assert f"sekali dlq show {plain} --trace" in out
    code, traced, _ = run_cli(capsys, "dlq", "show", str(plain), "--trace", "--url", db_url)
    assert code == 0 and "Traceback (most recent call last)" in traced and "step_3.py" in traced
    code, out, _ = run_cli(capsys, "dlq", "show", str(bug), "--url", db_url)
    assert code == 0 and "step_3.py" in out  # a bug keeps its trace
    code, out, _ = run_cli(capsys, "dlq", "show", str(plain), "--json", "--url", db_url)
    assert json.loads(out)["trace"] == TRACE  # JSON keeps everything


def test_the_dead_letters_asset_shows_class_and_reason_without_a_trace(db: Database) -> None:
    """Catches: a run failure's ``Stack Trace:`` (the message Dagster gives a run that failed
    outside a step) flattened into the asset's reason column."""
    from pipelines.assets.dead_letters import dead_letter_metadata, snapshot

    store = DlqStore(db)
    store.record_failure(FailureInfo(
        job_type="charge_payment", dedupe_key="run:r1", error_type="RunFailure.RUN_EXCEPTION",
        message='Execution of run for "charge_payment" failed.\n\nStack Trace:\n'
                '  File "/srv/x.py", line 3, in go\n', run_id="r1",
        error_class=FailureClass.TRANSIENT, idempotency_key="payment:o-1",
    ))
    rows = dead_letter_metadata(snapshot(store), 0.0)["records"].value.records
    assert [(r.data["class"], r.data["reason"]) for r in rows] == [
        ("transient", 'RunFailure.RUN_EXCEPTION: Execution of run for "charge_payment" failed.')]


def test_a_dry_run_never_offers_a_replay_this_process_cannot_run(
    db: Database, db_url: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Catches: ``unknown: 'issue_refund' is not a per-request job type`` followed by ``would
    replay`` (and a real replay requested) for a job type only the code location knows."""
    monkeypatch.delenv("SEKALI_JOB_MODULES", raising=False)
    foreign = _dead_letter(db, 1, job_type="issue_refund", error_class=FailureClass.TRANSIENT)
    code, out, err = run_cli(capsys, "dlq", "replay", str(foreign), "--dry-run", "--url", db_url)
    assert code == 2
    assert "would replay" not in out and f"{foreign}  would not replay: issue_refund" in out
    assert "not registered in this process" in out
    assert "SEKALI_JOB_MODULES" in one_line(err)
    code, out, err = run_cli(capsys, "dlq", "replay", str(foreign), "--url", db_url)
    assert code == 2 and "replay requested" not in out
    assert DlqStore(db).get(foreign).status is DlqStatus.OPEN


def test_a_dry_run_flags_a_replay_certain_to_fail_again_and_never_calls_it_safe(
    db: Database, db_url: str, capsys: pytest.CaptureFixture[str],
) -> None:
    """Catches: ``would replay ... safe`` for a permanent failure whose replay runs the same
    payload, so fails the same way. A transient one with no effect stays ``safe``."""
    again = _dead_letter(db, 1)
    passing = _dead_letter(db, 2, error_class=FailureClass.TRANSIENT)
    code, out, err = run_cli(capsys, "dlq", "replay", str(again), str(passing), "--dry-run",
                          "--url", db_url)
    assert code == 0, err
    lines = out.splitlines()
    verdict = lines[lines.index(next(x for x in lines if x.strip().startswith(f"{again} "))) + 1]
    assert verdict.strip().startswith("fails_again: ") and "safe" not in verdict
    assert "UnknownSku: sku 'nope' is not stocked" in verdict
    assert any(x.strip().startswith("safe: ") for x in lines)
    assert f"warning: [{again}] will fail again the same way" in err
    judged = bulk_replay(DlqStore(db), Selection(ids=[again, passing]), actor="t",
                         dry_run=True).assessments
    assert judged[again].verdict is Verdict.FAILS_AGAIN and judged[again].fails_again
    assert judged[passing].verdict is Verdict.SAFE and not judged[passing].fails_again


def test_a_failure_seen_again_spends_no_dlq_id_and_dlq_list_says_why_ids_have_gaps(
    db: Database, db_url: str, capsys: pytest.CaptureFixture[str],
) -> None:
    """Catches: ids 1, 3, 7 shown with nothing said, one of the reasons being an id spent by
    every sighting of a failure already dead-lettered (the sensor and the sweep both see it)."""
    first = _dead_letter(db, 1)
    for _ in range(3):
        assert _dead_letter(db, 1) == first  # the same failure, seen again
    second = _dead_letter(db, 2)
    third = _dead_letter(db, 3)
    assert (first, second, third) == (1, 2, 3)
    DlqStore(db).discard([second], actor="t", reason="stale")
    code, out, _ = run_cli(capsys, "dlq", "list", "--url", db_url)
    assert code == 0
    assert out.strip().splitlines()[-1].startswith(
        "ids not listed (2): records resolved or discarded (`--status all` lists them)")
    code, out, _ = run_cli(capsys, "dlq", "list", "--status", "all", "--url", db_url)
    assert "ids not listed" not in out


def test_a_passed_doctor_check_prints_no_fix_line(
    db: Database, db_url: str, capsys: pytest.CaptureFixture[str],
) -> None:
    """Catches: ``fix: Declare lookup= on the job types named, if any`` under check 3's PASS."""
    code, out, _ = run_cli(capsys, "doctor", "--check", "idempotency_coverage", "--url", db_url)
    assert code == 0, out
    body = [line for line in out.splitlines() if line.startswith("    ")]
    assert "PASS" in out and body and all(not x.strip().startswith("fix:") for x in body), out


@pytest.mark.parametrize("existing", [False, True], ids=["fresh-home", "existing-home"])
def test_the_dev_instance_opens_without_dagsters_community_dialog(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, existing: bool,
) -> None:
    """Catches: "Join the Dagster community" covering the UI on its first open. The UI shows it
    when the GraphQL field ``shouldShowNux`` is true (the instance's ``nux`` setting on, no
    ``.nux/nux.yaml`` under ``DAGSTER_HOME``); the home ``sekali dev`` prepares turns it off,
    also a home that already had a ``dagster.yaml`` of its own without that setting."""
    import dagster as dg
    from dagster_graphql.test.utils import define_out_of_process_context, execute_dagster_graphql

    from pipelines.instance import prepare_dagster_home

    if existing:
        (tmp_path / "home").mkdir()
        (tmp_path / "home" / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    home = prepare_dagster_home(tmp_path / "home", profile="embedded")
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    code = tmp_path / "defs.py"
    code.write_text("import dagster as dg\ndefs = dg.Definitions()\n")
    with dg.DagsterInstance.get() as instance:
        assert instance.nux_enabled is existing
        with define_out_of_process_context(str(code), None, instance) as context:
            answer: Any = execute_dagster_graphql(context, "query { shouldShowNux }")
    assert answer.errors is None and answer.data == {"shouldShowNux": False}
    # Off by setting where the profile's dagster.yaml was written, by Dagster's "seen" mark
    # where the home's own one stays.
    assert (home / ".nux" / "nux.yaml").exists() is existing
