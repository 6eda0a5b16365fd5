"""The chaos harness in CI: short runs of real worker processes, real faults, real stores.

Each run starts its own redis-server, gateway, mail sink and app database, several worker
processes with two consumer threads each, and SIGKILLs, SIGSTOPs, restarts Redis, drops gateway
answers and feeds poison payloads while every request is delivered several times. The checker
reads the gateway, the mail sink, the idempotency records, ``job_attempts`` and the DLQ.

The guarded runs must end with zero violations; the naive run (defences off) must show
duplicates and losses, which proves the checker can see a violation when there is one.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from cli.main import main as sekali
from engine.context import SEND_BOUND
from proof.chaos import (
    FAULTS,
    ChaosConfig,
    ChaosConfigError,
    ChaosReport,
    ChaosWorld,
    Coordinator,
    Request,
    build_workload,
    check,
    format_table,
    parse_faults,
    run_chaos,
)
from resources.dlq import DlqStore
from sandbox.postgres_server import PostgresUnavailable, postgres_bindir
from tests.conftest import PG_URL, _postgres_error, need_server

pytestmark = pytest.mark.slow


def _explain(report: ChaosReport) -> str:
    return (
        format_table(report.rows)
        + f"\nstats {json.dumps(report.stats, sort_keys=True)}\n"
        + "\n".join(report.violations[:20])
        + f"\nlate reports {report.late_reports[:10]}"
        + f"\ndead letters {report.dead_letters[:10]}"
    )


def _row(report: ChaosReport, fault: str) -> dict[str, int]:
    return next(r for r in report.rows if r["fault"] == fault)


def _assert_guarded(report: ChaosReport, *, min_deliveries: int) -> None:
    why = _explain(report)
    assert report.finished, why
    assert report.ok, why
    total = _row(report, "all")
    assert total["duplicates"] == 0 and total["lost"] == 0, why
    assert report.stats["dispatches"] >= min_deliveries, why
    assert report.stats.get("unplanned_deaths", 0) == 0, why  # every death was a planned kill
    poison = _row(report, "poison")
    assert poison["requests"] > 0 and poison["dead_lettered"] == poison["requests"], why
    assert poison["effects"] == 0, why
    # a dead letter is a poison payload, or a transient failure that exhausted its retries
    # (Redis restarting, the gateway's answer dropped) and says why; few, never "unknown"
    requests = report.config["requests"]
    assert len(report.dead_letters) <= max(1, requests // 20), why
    for dl in report.dead_letters:
        assert dl["class"] == "transient" and dl["reason"], why
    # everything else took effect exactly once
    assert report.stats["clean_effects"] == report.stats["clean_requests"], why
    assert report.stats["clean_requests"] == (
        requests - poison["requests"] - len(report.dead_letters)), why


@pytest.mark.timeout(240)
def test_guarded_run_on_sqlite_keeps_every_invariant_under_every_fault() -> None:
    """Catches: a second charge/mail/reservation after a kill, a stop, a dropped answer or a
    Redis restart; a request that ends nowhere; a stale holder's write accepted; a poison
    payload retried or not dead-lettered."""
    report = run_chaos(ChaosConfig(
        requests=700, workers=3, threads=2, redelivery=3, kills=8, stops=2, redis_restarts=2,
        drop_rate=0.06, poison_rate=0.05, seed=11, timeout=200,
    ))
    _assert_guarded(report, min_deliveries=2100)
    why = _explain(report)
    stats = report.stats
    # the faults really struck, so "no violation" means something
    assert stats.get("kills", 0) >= 3, why
    assert stats.get("stops", 0) >= 1, why
    # a stop only meets a takeover when the redelivery comes while it is frozen: the rejected
    # stale write is proven deterministically in test_jobs_crash; here it is counted, not required
    assert stats.get("redis-restart", 0) == 2 and not stats.get("redis-restart_failed"), why
    # a dropped answer: GatewayUnavailable, or PaymentNotSettled when the POST may have charged
    dropped = stats.get("error:GatewayUnavailable", 0) + stats.get("error:PaymentNotSettled", 0)
    assert dropped >= 1, why
    # the Redis restarts came while requests were in flight (whether a worker's call met the
    # down window is timing: a refused or unanswered call is counted, not required)
    restarted = next(r for r in report.rows if r["fault"] == "redis-restart")
    assert restarted["requests"] >= 1 and restarted["lost"] == 0, why
    assert any(r["fault"].startswith("kill:") for r in report.rows), why


@pytest.mark.postgres
@pytest.mark.timeout(180)
def test_guarded_run_on_postgres_keeps_every_invariant() -> None:
    """The same invariants with the app store on Postgres (a schema of its own, dropped after)."""
    error = _postgres_error()
    if error is not None:
        need_server("PostgreSQL", error)
    report = run_chaos(ChaosConfig(
        requests=160, workers=3, threads=2, redelivery=3, kills=3, stops=1, redis_restarts=1,
        backend="postgres", database_url=PG_URL, seed=5, timeout=150,
    ))
    _assert_guarded(report, min_deliveries=480)
    assert report.stats.get("kills", 0) >= 1, _explain(report)


@pytest.mark.timeout(120)
def test_naive_run_shows_the_duplicates_and_losses_the_defences_prevent() -> None:
    """Proof that the checker sees violations: with no claim, no lock, no Idempotency-Key and
    the ack before the work, redelivered requests charge twice and poison payloads vanish."""
    report = run_chaos(ChaosConfig(
        requests=50, workers=2, threads=2, redelivery=2, kills=2, stops=0,
        faults=("kill", "drop-response", "poison"), poison_rate=0.1, naive=True, seed=3,
        timeout=90,
    ))
    why = _explain(report)
    assert report.finished, why
    assert not report.ok, why
    total = _row(report, "all")
    assert total["duplicates"] >= 20, why
    assert total["lost"] >= 1, why
    assert any(v.startswith("duplicate effect") for v in report.violations), why
    assert any(v.startswith("poison not dead-lettered") for v in report.violations), why


@pytest.mark.timeout(120)
def test_cli_json_on_stdout_report_file_and_exit_zero_when_the_invariants_hold(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``sekali chaos --json --out PATH`` end to end: stdout is the JSON report and nothing
    else (the table and the summary go to stderr), the same report is written to PATH, exit
    code 0 in guarded mode."""
    out = tmp_path / "chaos.json"
    code = sekali([
        "chaos", "--requests", "30", "--workers", "2", "--redelivery", "2",
        "--faults", "poison,drop-response", "--json", "--out", str(out), "--no-progress",
    ])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    data = json.loads(captured.out)
    assert data["ok"] is True and data["violations"] == []
    assert data["config"]["delivery"] == "resident"  # the platform's default delivery
    assert data["deliveries"] >= 28  # every valid request claimed by a resident worker
    assert {r["fault"] for r in data["rows"]} >= {"all", "poison"}
    assert json.loads(out.read_text())["stats"] == data["stats"]
    assert "every invariant held" in captured.err


@pytest.mark.timeout(120)
def test_cli_out_path_it_cannot_write_is_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--out`` means what it means in every command: a path that cannot be written is exit 2
    and one line naming it, not a traceback."""
    out = tmp_path / "missing" / "chaos.json"
    code = sekali([
        "chaos", "--requests", "10", "--workers", "1", "--redelivery", "1",
        "--faults", "poison", "--json", "--out", str(out), "--no-progress",
    ])
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert f"--out {out}" in captured.err and "Traceback" not in captured.err
    assert captured.out == ""


def test_faults_all_means_every_fault_the_run_can_strike() -> None:
    """``--faults all``: every fault, but pg-restart only where the run can start its own
    cluster, and a note saying why it was left out."""
    faults, notes = parse_faults("all", backend="sqlite", database_url=None)
    assert set(faults) == set(FAULTS) - {"pg-restart", "pg-failover"} and notes
    faults, notes = parse_faults("all", backend="postgres", database_url=PG_URL)
    assert "pg-restart" not in faults and any("did not start" in n for n in notes)
    assert parse_faults("kill, stop", backend="sqlite", database_url=None) == (
        ("kill", "stop"), [])


def test_cli_refuses_unknown_faults_with_exit_code_2() -> None:
    assert sekali(["chaos", "--faults", "kill,meteor"]) == 2
    assert sekali(["chaos", "--faults", "pg-restart", "--backend", "sqlite"]) == 2


def test_pg_restart_refuses_a_database_it_did_not_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches a pg-restart that restarts whatever cluster ``pg_lsclusters`` lists first: with
    the run's database on a server the run did not start (here the shared test server) it must
    refuse before anything starts, with exit code 2, and restart nothing.

    The configuration is checked before the CLI is called, so this test never restarts a shared
    server even on code that lacks the check."""
    shared = ChaosConfig(faults=("pg-restart",), backend="postgres", database_url=PG_URL)
    with pytest.raises(ChaosConfigError, match="private cluster"):
        shared.validate()
    monkeypatch.setenv("DATABASE_URL", PG_URL)
    with pytest.raises(ChaosConfigError, match="private cluster"):
        ChaosConfig(faults=("pg-restart",), backend="postgres").validate()
    assert sekali(["chaos", "--backend", "postgres", "--faults", "pg-restart", "--requests", "5",
                   "--no-progress"]) == 2
    monkeypatch.delenv("DATABASE_URL")
    assert sekali(["chaos", "--backend", "postgres", "--faults", "pg-restart", "--requests", "5",
                   "--database-url", PG_URL, "--no-progress"]) == 2


@pytest.mark.postgres
@pytest.mark.timeout(240)
def test_pg_restart_restarts_the_runs_own_private_cluster() -> None:
    """``pg-restart`` runs on a private cluster the run starts itself (initdb on a free port),
    and each restart it reports is one the run's database saw: its postmaster start time changed
    that many times. The shared server's start time stays as it was."""
    error = _postgres_error()
    if error is not None:
        need_server("PostgreSQL", error)
    try:
        postgres_bindir()
    except PostgresUnavailable as exc:
        need_server("a private PostgreSQL cluster (initdb, pg_ctl)", exc)
    engine = create_engine(PG_URL)
    with engine.connect() as conn:
        shared_started = conn.execute(text("SELECT pg_postmaster_start_time()")).scalar_one()
    report = run_chaos(ChaosConfig(
        requests=60, workers=2, threads=2, redelivery=2, faults=("pg-restart", "poison"),
        backend="postgres", pg_restarts=2, seed=11, timeout=180,
    ))
    why = _explain(report)
    _assert_guarded(report, min_deliveries=120)
    assert report.stats["pg-restart"] == 2 and report.stats["pg-restart_not_struck"] == 0, why
    assert report.stats["pg_restarts_seen"] == report.stats["pg-restart"], why
    with engine.connect() as conn:
        assert conn.execute(text("SELECT pg_postmaster_start_time()")).scalar_one() == (
            shared_started
        )
    engine.dispose()


@pytest.mark.timeout(120)
@contextlib.contextmanager
def _clean_run() -> Iterator[tuple[ChaosWorld, Coordinator, list[Request]]]:
    """A small guarded run with poison only, run to its end, its world still up: the stores
    a checker test doctors behind the checker's back."""
    config = ChaosConfig(requests=40, workers=2, threads=2, redelivery=2,
                         faults=("poison",), poison_rate=0.1, seed=7, timeout=90)
    config.validate()
    requests = build_workload(config)
    with ChaosWorld(config) as world:
        world.seed_stock(requests)
        coordinator = Coordinator(config, world, requests)
        assert coordinator.run()
        yield world, coordinator, requests


def test_checker_reports_stale_writes_unknown_dead_letters_and_duplicate_mail() -> None:
    """The checker's blocks fire: a clean run, then the store doctored behind its back (an
    order's payment fence one below its record's, a DLQ row of class unknown, a mail resent
    with no after-effect fault to excuse it, a second charge) must each be reported; a second
    charge is never excused, even once reconciliation marked it for a refund (it is counted in
    ``double_charges_refund_marked``)."""
    with _clean_run() as (world, coordinator, requests):
        verdicts, violations = check(world, coordinator)
        assert violations == []
        charge = next(v for v in verdicts if v.job_type == "charge_payment"
                      and v.status == "completed" and not v.poison)
        mail = next(v for v in verdicts if v.job_type == "send_email"
                    and v.status == "completed" and not v.poison)
        poison = next(v for v in verdicts if v.poison)
        order_id = requests[charge.id].payload["order_id"]
        with world.db.transaction() as conn:
            conn.execute(text("UPDATE orders SET payment_fence = payment_fence - 1"
                              " WHERE order_id = :o"), {"o": order_id})
            conn.execute(text("UPDATE dlq_records SET error_class = 'unknown'"
                              " WHERE request_id = :r"), {"r": poison.id + 1})
        real_messages = world.sink.messages

        def resent() -> list[dict[str, object]]:
            out = real_messages()
            return out + [m for m in out if m.get("correlation_id") == f"chaos-req-{mail.id}"]

        world.sink.messages = resent
        _, violations = check(world, coordinator)
        assert any(v.startswith(f"stale write: request {charge.id} ") and "order fence" in v
                   for v in violations), violations
        assert any(v.startswith("dead letter of class unknown") and f"request {poison.id} " in v
                   for v in violations), violations
        assert any(v.startswith(f"duplicate mail: request {mail.id} ") for v in violations), \
            violations
        # the same resend is excused once a kill struck between the SMTP accept and the record
        requests[mail.id].struck["kill:after_effect"] += 1
        _, violations = check(world, coordinator)
        assert not any(v.startswith("duplicate mail") for v in violations), violations

        # a second charge: a violation whatever struck the request (the stop inside the charge
        # call is closed by the send bound), and still one once reconciliation marked a refund
        real_charges = world.gateway.charges
        cid = f"chaos-req-{charge.id}"

        def doubled() -> list[dict[str, object]]:
            out = real_charges()
            return out + [dict(c, charge_id="ch_extra") for c in out
                          if c.get("correlation_id") == cid]

        world.gateway.charges = doubled
        requests[charge.id].struck["stop:before_effect"] += 1
        requests[charge.id].faults.add("slow-provider")
        _, violations = check(world, coordinator)
        assert any(v.startswith(f"duplicate effect: request {charge.id} ") for v in violations)
        with world.db.transaction() as conn:
            conn.execute(text(
                "INSERT INTO reconciliation_actions (action_key, kind, subject, detail,"
                " created_at) VALUES (:k, 'refund_pending', :o, '', 0)"),
                {"k": f"compensate:refund-pending:{order_id}:ch_extra", "o": order_id})
        _, violations = check(world, coordinator)
        assert any(v.startswith(f"duplicate effect: request {charge.id} ") for v in violations)
        assert coordinator.stats["double_charges_refund_marked"] == 1


def test_the_judge_counts_a_holder_found_taken_over_alive_among_the_deaths_a_claim_counted(
) -> None:
    """A claim counts a crash for every takeover of a holder that ran alone, dead or alive (a
    lease that ran out by a skewed clock, a pause): the holder that comes back takes it back,
    but a claim in between may decide crash_loop on it. Catches a judge that calls such a dead
    letter unearned, one that excuses it without the stall, and one that counts a stopped
    holder's own return twice: a clean run, then a request doctored to a crash_loop dead
    letter beside two deaths, then one of its attempts ended ``lease_lost``, then a delivery
    that met the database restarting."""
    with _clean_run() as (world, coordinator, requests):
        assert check(world, coordinator)[1] == []
        poison = next(r for r in requests if r.poison)

        def unearned() -> list[str]:
            return [v for v in check(world, coordinator)[1]
                    if v.startswith("dead-lettered as crash_loop")
                    and f"request {poison.id} " in v]

        with world.db.transaction() as conn:
            conn.execute(text("UPDATE dlq_records SET error_class = 'crash_loop'"
                              " WHERE request_id = :r"), {"r": poison.row_id})
        poison.struck.update({"kill:after_effect": 1, "died_with_worker": 1})
        assert unearned() and "after 2 death(s)" in unearned()[0], unearned()
        with world.db.transaction() as conn:
            conn.execute(text(
                "UPDATE job_attempts SET outcome = 'lease_lost' WHERE attempt_id ="
                " (SELECT MIN(attempt_id) FROM job_attempts WHERE request_id = :r)"),
                {"r": poison.row_id})
        assert unearned() == []  # two deaths and a holder taken over alive: three
        # a stop instead of the kill: the stopped holder's return is that same stall
        poison.struck.pop("kill:after_effect")
        poison.struck["stop:before_effect"] += 1
        assert unearned() and "after 2 death(s)" in unearned()[0], unearned()
        # a holder cut off by a database restart records neither its outcome nor its end
        poison.struck["pg-restart:outage"] += 1
        assert unearned() == []


NEW_FAULTS = ("redis-freeze", "redis-rollback", "redis-failover", "slow-provider",
              "drip-provider", "clock-skew", "retention-travel")


def _assert_new_faults_struck(report: ChaosReport) -> None:
    """Each production fault really struck, so that "no violation" means something."""
    stats, why = report.stats, _explain(report)
    for name in NEW_FAULTS:
        assert stats.get(f"{name}_scheduled", 0) >= 1, (name, why)
        assert stats.get(name, 0) >= 1 and stats.get(f"{name}_not_struck") == 0, (name, why)
        assert not stats.get(f"{name}_failed"), (name, why)
    # the provider misbehaved while a charge was under way: a charge in its window, or a call
    # it cut (GatewayUnavailable) or left unsettled (PaymentNotSettled)
    for name in ("slow-provider", "drip-provider"):
        assert stats.get(f"{name}_charges", 0) + stats.get(f"{name}_felt", 0) >= 1, (name, why)
    # retention ran "days later" with dead letters open and purged completed keys, and the
    # planted records (success report lost after the key completed) resolved, not replayed
    assert stats["travel_open_dead_letters"] >= 1 and stats["travel_purged_keys"] >= 1, why
    assert stats["travel_planted"] >= 2 and stats["travel_resolved"] >= 1, why
    # the planted records nothing proves the same intent stay open: their completed keys
    # survive the purge and their replays find them completed
    assert stats["travel_kept_keys"] >= 1 and stats["travel_replayed"] >= 1, why
    assert stats["longest_delivery_ms"] <= stats["stall_bound_ms"], why


def _new_faults_config(**overrides: object) -> ChaosConfig:
    base: dict[str, object] = dict(
        requests=100, workers=3, threads=2, redelivery=3, kills=3, stops=1, redis_restarts=1,
        faults=("kill", "stop", "redis-restart", "drop-response", "poison", *NEW_FAULTS),
        seed=21, timeout=200,
    )
    base.update(overrides)
    return ChaosConfig(**base)  # type: ignore[arg-type]


@pytest.mark.timeout(260)
def test_production_faults_on_sqlite_keep_every_invariant() -> None:
    """Catches: a fence handed out twice after Redis lost writes (rollback to an older
    snapshot, failover to a lagging replica), a stall without bound while Redis is frozen, a
    second charge from a provider that ignores keys and commits after the client gave up, a
    call held by a dripping provider, a takeover of a live lease by a worker whose clock runs
    ahead, and a replay after the retention purge repeating an effect. Each of those faults
    must strike at least once, with 0 duplicates, 0 lost, 0 violations."""
    report = run_chaos(_new_faults_config())
    _assert_guarded(report, min_deliveries=300)
    _assert_new_faults_struck(report)


@pytest.mark.postgres
@pytest.mark.timeout(260)
def test_production_faults_on_postgres_keep_every_invariant() -> None:
    """The same faults with the app store on Postgres (a schema of its own, dropped after)."""
    error = _postgres_error()
    if error is not None:
        need_server("PostgreSQL", error)
    report = run_chaos(_new_faults_config(backend="postgres", database_url=PG_URL, seed=22))
    _assert_guarded(report, min_deliveries=300)
    _assert_new_faults_struck(report)


@pytest.mark.timeout(200)
def test_slow_provider_catches_a_settle_window_shorter_than_the_provider() -> None:
    """Proof that the slow-provider fault can see the break it stands for: with the workers'
    settle window (0.05 s) shorter than the provider's processing time (2.5 s, keys ignored),
    a retry's lookup finds nothing yet and charges again, and the checker reports it."""
    report = run_chaos(ChaosConfig(
        requests=60, workers=3, threads=2, redelivery=3, faults=("slow-provider",),
        settle=0.05, seed=5, timeout=150,
    ))
    why = _explain(report)
    assert report.stats.get("slow-provider", 0) == 1, why
    assert _row(report, "all")["duplicates"] >= 1, why
    assert any(v.startswith("duplicate effect") and "charge_payment" in v
               for v in report.violations), why


@pytest.mark.timeout(200)
def test_retention_travel_catches_a_purge_that_drops_keys_open_records_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Proof that retention-travel can see the break it stands for: with the purge's rule
    "keep every key an unresolved DLQ record names" taken out (the code before the fix), the
    day-8 replay of an open record runs against an empty ledger and mails a second time (with
    the first send's lookup off: that guard alone would find the mail and record it)."""
    monkeypatch.setattr(DlqStore, "unresolved_key_reference", staticmethod(lambda column: "1 = 0"))
    monkeypatch.setenv("SEKALI_LOOKUP_FIRST", "charge_payment=0,send_email=0")
    report = run_chaos(ChaosConfig(
        requests=80, workers=3, threads=2, redelivery=3, faults=("retention-travel", "poison"),
        seed=3, timeout=150,
    ))
    why = _explain(report)
    assert report.stats["travel_kept_keys"] == 0 and report.stats["travel_replayed"] >= 1, why
    assert any(v.startswith("duplicate mail") or v.startswith("duplicate effect")
               for v in report.violations), why


@pytest.mark.parametrize("seed", [13, 20])
def test_a_kill_planned_late_in_a_small_run_still_strikes(seed: int) -> None:
    """Catches a kill that never strikes because it was planned (by dispatch count) after the
    last request's first delivery, or armed on a delivery that reaches no crash point (a
    duplicate of a completed request, a reservation without a downstream call): the run then
    proves nothing about kills while its options say it does. Seeds 13 and 20 plan the kill at
    82% of the dispatches, when every request may have completed."""
    report = run_chaos(ChaosConfig(requests=4, workers=2, threads=1, redelivery=3,
                                   faults=("kill",), kills=1, seed=seed, timeout=120))
    assert report.ok, _explain(report)
    assert report.stats["kills"] == 1, report.stats
    assert report.stats["kills_not_struck"] == 0, report.stats


def _leases_in_force(state_dir: str) -> set[float]:
    """The leases the run's charges confirmed (each send bound is 0.4 of its lease)."""
    engine = create_engine(f"sqlite:///{Path(state_dir) / 'app.db'}")
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT send_bounds FROM job_attempts"
                                     " WHERE send_bounds IS NOT NULL")).all()
    finally:
        engine.dispose()
    return {round((bound - asked) / SEND_BOUND, 1)
            for (cell,) in rows for asked, bound in json.loads(cell)}


@pytest.mark.parametrize("adaptive", [False, True])
def test_the_run_times_its_faults_from_the_lease_its_claims_take(
    adaptive: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches a harness whose workers quietly take the adaptive lease (the platform's
    default) while it times stops, thaws and its stall bound from ``--lease``: a crash-looping
    request then waits out leases of tens of seconds and the run cannot settle. Without
    ``adaptive`` every claim takes ``--lease``; with it, the leases follow the durations."""
    monkeypatch.setenv("SEKALI_LEASE_MIN_SAMPLES", "1")  # adaptive from the first completion
    monkeypatch.setenv("SEKALI_DURATION_REFRESH", "0.2")
    report = run_chaos(ChaosConfig(requests=40, workers=2, threads=1, redelivery=2,
                                   faults=("kill",), kills=1, seed=5, timeout=200,
                                   adaptive=adaptive, keep_state=True))
    assert report.state_dir is not None
    try:
        assert report.ok, _explain(report)
        leases = _leases_in_force(report.state_dir)
        assert leases, "no charge confirmed its lease"
        if adaptive:
            assert leases != {2.0}, leases
            assert report.stats["stall_bound_ms"] >= 60_000
        else:
            assert leases == {2.0}, leases
    finally:
        shutil.rmtree(report.state_dir, ignore_errors=True)
