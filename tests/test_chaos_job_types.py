"""``sekali chaos --job-type``: a registered job type under every fault a run can strike, its
effects counted at its sandbox stand-in through its own lookup hook.

Small runs (tens of requests, two worker processes) on SQLite and Postgres; the checker's
sensitivity is shown by doctoring the downstream after a clean run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cli.main import main as sekali
from engine.registry import get_job_type
from pipelines.domain.payments import GATEWAY
from proof.chaos import ChaosConfig, ChaosWorld, Coordinator, build_workload, check
from proof.chaos_typed import TYPED_FAULTS, varied

pytestmark = pytest.mark.slow


def _chaos(*args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any], str]:
    code = sekali(["chaos", *args, "--json", "--no-progress"])
    captured = capsys.readouterr()
    return code, json.loads(captured.out) if captured.out else {}, captured.err


def _assert_clean(code: int, report: dict[str, Any], err: str) -> None:
    why = err[-3000:] + "\n" + "\n".join(report.get("violations", [])[:20])
    assert code == 0 and report["ok"], why
    total = next(r for r in report["rows"] if r["fault"] == "all")
    assert total["duplicates"] == 0 and total["lost"] == 0, why
    poison = next(r for r in report["rows"] if r["fault"] == "poison")
    assert poison["dead_lettered"] == poison["requests"] > 0 and poison["effects"] == 0, why
    stats = report["stats"]
    assert stats["clean_effects"] == stats["clean_requests"] > 0, why
    # one request's every run killed its worker: after the bound it is dead-lettered as
    # crash_loop with no effect, and no other request was (the judge checks both)
    assert stats["crash-loop"] == 1 and not stats.get("crash-loop_not_struck"), why
    assert stats["crash-loop_deaths"] == report["config"]["crash_loop_limit"] + 1, why
    loop = next(r for r in report["rows"] if r["fault"] == "crash-loop")
    assert loop["dead_lettered"] >= 1 and loop["lost"] == 0 and loop["duplicates"] == 0, why
    # an outbox event whose consumer always fails went to the outbox dead letters; the other
    # aggregates' events were all consumed, the one behind it waits (the judge checks each)
    assert stats["poison-outbox"] == 1 and stats["outbox_dead_lettered"] == 1, why
    assert stats["outbox_consumed"] == stats["outbox_events"] - 2, why
    # Redis switched to allkeys-lru mid-run: a client's first use refused it, the doctor's
    # reading saw it; what a worker refused then was replayed once noeviction was back
    assert stats["evicting-redis"] == 1 and stats["eviction_refused"] == 1, why
    assert stats["eviction_seen"] >= 1 and not stats.get("evicting-redis_failed"), why
    evicting = next(r for r in report["rows"] if r["fault"] == "evicting-redis")
    assert evicting["lost"] == 0 and evicting["duplicates"] == 0, why
    # a kill planned late can miss a run that settled first: at least one struck
    assert stats["kills"] >= 1, why
    assert stats["longest_delivery_ms"] <= stats["stall_bound_ms"], why


ALL_ARGS = ("--requests", "40", "--workers", "2", "--redelivery", "2", "--faults", "all",
            "--kills", "3", "--stops", "1", "--timeout", "240")


@pytest.mark.timeout(300)
def test_a_builtin_job_type_under_every_fault_on_sqlite(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, report, err = _chaos("--job-type", "charge_payment", *ALL_ARGS, capsys=capsys)
    _assert_clean(code, report, err)
    assert report["config"]["job_types"] == ["charge_payment"]
    assert set(report["config"]["faults"]) == set(TYPED_FAULTS) - {"pg-restart"}
    assert "pg-restart left out" in err
    # the retry budget's own Redis died while failures were being decided: each decision
    # still ended (a retry spending nothing), nothing was dead-lettered for it
    stats = report["stats"]
    assert stats["budget-redis-down"] == 1 and not stats.get("budget-redis-down_failed"), stats
    assert stats["budget_unavailable_decisions"] >= 1, stats


@pytest.mark.postgres
@pytest.mark.timeout(300)
def test_a_builtin_job_type_under_every_fault_on_postgres(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("DATABASE_URL", raising=False)  # pg-restart needs the run's own cluster
    code, report, err = _chaos("--job-type", "charge_payment", "--backend", "postgres",
                               *ALL_ARGS, capsys=capsys)
    _assert_clean(code, report, err)
    if "pg-restart" in report["config"]["faults"]:
        assert report["stats"]["pg_restarts_seen"] >= 1


def test_the_payloads_vary_the_fields_that_make_the_key() -> None:
    jt = get_job_type("send_email")
    a, b = varied(jt, 1), varied(jt, 2)
    assert jt.keying.key_for(jt.validate(dict(a))) != jt.keying.key_for(jt.validate(dict(b)))
    example = jt.presentation.example
    assert a["template"] == b["template"] == example["template"]  # a choice stays valid


def test_job_types_that_cannot_be_judged_are_refused_with_what_to_declare(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert sekali(["chaos", "--job-type", "no_such_type"]) == 2
    assert "no such job type" in capsys.readouterr().err
    assert sekali(["chaos", "--job-type", "reserve_inventory"]) == 2
    assert "declares no lookup hook" in capsys.readouterr().err
    assert sekali(["chaos", "--job-type", "charge_payment", "--faults", "slow-provider"]) == 2
    assert "built-in mix" in capsys.readouterr().err


@pytest.mark.timeout(180)
def test_the_checker_counts_a_second_effect_through_the_lookup_hook() -> None:
    """A clean run, then one more charge at the stand-in under one request's reference (the
    job type's own lookup finds it): the checker must report the duplicate."""
    config = ChaosConfig(requests=12, workers=2, threads=2, redelivery=2, faults=("poison",),
                         poison_rate=0.0, seed=3, timeout=120, job_types=("charge_payment",))
    config.validate()
    requests = build_workload(config)
    with ChaosWorld(config) as world:
        coordinator = Coordinator(config, world, requests)
        assert coordinator.run()
        verdicts, violations = check(world, coordinator)
        assert violations == [] and all(v.effects == 1 for v in verdicts), violations
        jt = get_job_type("charge_payment")
        target = requests[5]
        clean = jt.validate(dict(target.payload))
        key = jt.keying.key_for(clean)
        [effect] = jt.effects(world.sandboxes.clients().__getitem__, key, clean)
        gateway = world.sandboxes.clients()[GATEWAY.name]
        gateway.charge(reference=effect.detail["reference"], amount_cents=clean["amount_cents"],
                       currency=clean["currency"], idempotency_key=None,
                       correlation_id="doctored")
        _, violations = check(world, coordinator)
        assert any(v.startswith(f"duplicate effect: request {target.id} ") for v in violations), \
            violations


@pytest.mark.timeout(300)
def test_run_under_faults_is_the_chaos_proof_from_a_users_test() -> None:
    """What a user's CI calls: a report with the invariants' verdict, and a refusal raised with
    what to declare."""
    from engine.testing import ChaosRunFailed, run_under_faults

    report = run_under_faults(get_job_type("charge_payment"), faults="kill,poison",
                              requests=12, timeout=200)
    assert report.ok, report.violations
    assert report.duplicates == 0 and report.lost == 0
    assert report.stats["kills"] >= 1
    with pytest.raises(ChaosRunFailed, match="declares no lookup hook"):
        run_under_faults("reserve_inventory", requests=4)


@pytest.mark.timeout(600)
def test_dagster_mode_real_runs_with_dagsters_retries_and_the_run_failure_sensor() -> None:
    """``--dagster``: each delivery is a real run of the per-request job on a persistent
    instance; a poison payload's run fails (Failure, no retry) and the run-failure sensor's
    own function dead-letters it as permanent; a kill mid-run is redelivered as a new run."""
    from proof.chaos import run_chaos

    report = run_chaos(ChaosConfig(
        requests=6, workers=2, threads=1, redelivery=2, faults=("kill", "poison"), kills=1,
        poison_rate=0.3, seed=7, timeout=480, job_types=("charge_payment",), dagster=True,
    ))
    why = "\n".join(report.violations[:20]) + f"\n{report.stats}\n{report.rows}"
    assert report.ok and report.finished, why
    total = next(r for r in report.rows if r["fault"] == "all")
    assert total["duplicates"] == 0 and total["lost"] == 0, why
    poison = next(r for r in report.rows if r["fault"] == "poison")
    assert poison["dead_lettered"] == poison["requests"] > 0, why
    # the poison runs failed in Dagster and the sensor's path, not the harness, recorded them
    assert report.stats["dagster_runs_failed"] >= poison["requests"], why
    assert report.stats["dagster_runs_dead_lettered"] == report.stats["dagster_runs_failed"], why
    assert report.stats["kills"] == 1, why


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_the_guides_example_under_every_fault(tmp_path: Path, backend: str) -> None:
    """docs/job-types.md's example, saved in a package outside the tree and named in
    ``SEKALI_JOB_MODULES``, proven as a user's CI would: ``run_under_faults`` with every fault
    (``pg-restart`` on Postgres only), its credits counted at its own stand-in through its own
    lookup hook. ``stop`` freezes a worker between its lease confirmation and the credit call
    until it is taken over: the example's client must refuse to send past the send bound."""
    from engine.testing import run_under_faults
    from tests.guide_example import JOB_TYPE, ROOT, install_example

    module = install_example(tmp_path / "site")
    report = run_under_faults(
        JOB_TYPE, faults=[f for f in TYPED_FAULTS if backend == "postgres" or f != "pg-restart"],
        requests=30, backend=backend, timeout=300,
        env={"PYTHONPATH": f"{tmp_path / 'site'}:{ROOT}", "SEKALI_JOB_MODULES": module},
    )
    assert report.ok, report.violations[:20]
    assert report.duplicates == 0 and report.lost == 0
    assert report.raw["config"]["job_types"] == [JOB_TYPE]
    assert report.stats["kills"] >= 1 and report.stats["clean_effects"] >= 1
    assert report.stats["stops"] >= 1, report.stats


@pytest.mark.timeout(300)
def test_run_under_faults_takes_a_job_type_by_name_from_a_module_the_test_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The guides' CI example passes the job type's name, not its ``JobType``: a test process
    that imported the module (and has no ``SEKALI_JOB_MODULES``) must still get a run of it,
    the module added to the child's ``SEKALI_JOB_MODULES``. Catches the module reaching the
    child only for a ``JobType`` object (the child then refuses: unknown job type)."""
    import importlib

    from engine.testing import run_under_faults
    from tests.guide_example import JOB_TYPE, ROOT, install_example

    module = install_example(tmp_path / "site", package="namedjobs")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delenv("SEKALI_JOB_MODULES", raising=False)
    importlib.import_module(module)
    report = run_under_faults(JOB_TYPE, faults="kill", requests=6, workers=1, timeout=120,
                              env={"PYTHONPATH": f"{tmp_path / 'site'}:{ROOT}"})
    assert report.ok, report.violations[:20]
    assert report.raw["config"]["job_types"] == [JOB_TYPE]
    assert report.stats["clean_effects"] >= 1
