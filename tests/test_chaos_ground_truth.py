"""``sekali chaos --job-type`` cannot be fooled by the job type it judges.

Each bad job type is the guide's example (docs/job-types.md) with one defect, saved beside it in
a package outside the tree, as a user's would be, and run through ``run_under_faults`` for three
seeds; every run must fail with a verdict naming the cause:

- a lookup that under-reports (at most one effect per intent): the calibration made three
  credits per key on purpose, the stand-in's record holds three, the lookup reports one;
- a lookup that never finds anything: not "lost" requests, the lookup named;
- a handler that sends without ``ctx.confirm_lease()``: every arrival at the stand-in lies
  outside any send bound a holder of its key confirmed, whatever the faults struck.

The example itself passes (counted by its stand-in's record, calibrated, every arrival inside a
bound), and a job type whose stand-in declares no record is judged through its lookup with a
verdict that says so.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.testing import ChaosRunFailed, ChaosVerdict, run_under_faults
from tests.guide_example import JOB_TYPE, ROOT, install_example

pytestmark = pytest.mark.slow

BAD = '''
"""The guide's example with one defect each (tests/test_chaos_ground_truth.py)."""

import os
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from engine import (
    Calls, ClientOptions, Downstream, Effect, JobContext, Keying, Sandbox, formatted,
)
from resources.storage.settings import Settings

from PACKAGE import loyalty as ex


def lookup_first_only(client: Any, key: str, payload: Any) -> list[Effect]:
    return ex.lookup(client, key, payload)[:1]


def lookup_nothing(client: Any, key: str, payload: Any) -> list[Effect]:
    return []


def award_unconfirmed(ctx: JobContext, p: ex.Award) -> dict[str, Any]:
    ledger = ctx.client(ex.LEDGER.name)
    made = ledger.credits(ctx.key)
    credit = made[0] if made else ledger.credit(account_id=p.account_id, points=p.points,
                                                 key=ctx.key)
    return {"credit_id": credit["credit_id"], "points": p.points}


def _url() -> str:
    return os.environ.get("SEKALI_UNRECORDED_LEDGER_URL", "http://127.0.0.1:8092")


def _address(settings: Settings) -> tuple[str, int, str]:
    parts = urlsplit(_url())
    return parts.hostname or "127.0.0.1", parts.port or 80, "SEKALI_UNRECORDED_LEDGER_URL"


def _start(settings: Settings, state: Path) -> ex.LedgerServer:
    host, port, _ = _address(settings)
    return ex.LedgerServer(state / "unrecorded.db", host, port).start()


UNRECORDED = Downstream(
    name="unrecorded_ledger",
    build=lambda settings, options: ex.LedgerClient(options.address or _url()),
    calls=("credit", "credits"),
    sandbox=Sandbox("a ledger that keeps no record to count by", _address, _start),
)


def award_unrecorded(ctx: JobContext, p: ex.Award) -> dict[str, Any]:
    ledger = ctx.client(UNRECORDED.name)
    made = ledger.credits(ctx.key)
    credit = made[0] if made else ledger.credit(account_id=p.account_id, points=p.points,
                                                 key=ctx.key, send_by=ctx.confirm_lease())
    return {"credit_id": credit["credit_id"], "points": p.points}


def lookup_unrecorded(client: Any, key: str, payload: Any) -> list[Effect]:
    return [Effect(c["credit_id"], c["at"]) for c in client(UNRECORDED.name).credits(key)]


def keyed(prefix: str) -> Keying:
    return replace(ex.JOB_TYPE.keying, key_for=formatted(prefix + ":{account_id}:{reason}"))


JOB_TYPES = [
    replace(ex.JOB_TYPE, name="award_under_reported", keying=keyed("under"),
            calls=replace(ex.JOB_TYPE.calls, lookup=lookup_first_only)),
    replace(ex.JOB_TYPE, name="award_never_found", keying=keyed("never"),
            calls=replace(ex.JOB_TYPE.calls, lookup=lookup_nothing)),
    replace(ex.JOB_TYPE, name="award_unconfirmed", handler=award_unconfirmed,
            keying=keyed("unconfirmed")),
    replace(ex.JOB_TYPE, name="award_unrecorded", handler=award_unrecorded,
            keying=keyed("unrecorded"),
            calls=Calls(clients=(UNRECORDED,), budget=UNRECORDED.name,
                        lookup=lookup_unrecorded)),
]
'''

SEEDS = (1, 2, 3)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The guide's example and the bad job types beside it, as a user's package."""
    root = tmp_path_factory.mktemp("site")
    example = install_example(root, package="truthjobs")
    (root / "truthjobs" / "bad.py").write_text(BAD.replace("PACKAGE", "truthjobs"))
    return {"PYTHONPATH": f"{root}:{ROOT}",
            "SEKALI_JOB_MODULES": f"{example},truthjobs.bad"}


def _run(name: str, env: dict[str, str], seed: int, **kwargs: object) -> ChaosVerdict:
    options: dict[str, object] = {"faults": "kill,stop", "requests": 10, "timeout": 200}
    options.update(kwargs)
    return run_under_faults(name, seed=seed, env=env, **options)  # type: ignore[arg-type]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", SEEDS)
def test_a_lookup_that_under_reports_fails_the_run_naming_the_lookup(
    site: dict[str, str], seed: int,
) -> None:
    """Catches: a checker that trusts the lookup (25 extra refunds over 21 keys passed as
    "OK: every invariant held")."""
    verdict = _run("award_under_reported", site, seed)
    assert not verdict.ok, verdict.raw
    assert any(v.startswith("lookup under-reports: award_under_reported's lookup hook "
                            "reported [1, 1, 1] effects for 3 keys whose stand-in record holds "
                            "[3, 3, 3]") for v in verdict.violations), verdict.violations
    assert not any(v.startswith("lost") for v in verdict.violations), verdict.violations
    [cal] = verdict.calibration
    assert [(k["made"], k["reported"]) for k in cal["keys"]] == [(3, 1)] * 3, cal
    assert verdict.counting == {"award_under_reported": "record"}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", SEEDS)
def test_a_lookup_that_never_finds_fails_the_run_naming_the_lookup_not_lost(
    site: dict[str, str], seed: int,
) -> None:
    """Catches: a never-finding lookup reported as every request "lost", hiding the cause."""
    verdict = _run("award_never_found", site, seed)
    assert not verdict.ok, verdict.raw
    assert any(v.startswith("lookup never finds: award_never_found's lookup hook reported 0 "
                            "effects") for v in verdict.violations), verdict.violations
    assert not any(v.startswith("lost") for v in verdict.violations), verdict.violations
    assert verdict.stats["calibration_failed"] == 1


@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", SEEDS)
def test_a_handler_that_sends_without_confirm_lease_fails_every_seed(
    site: dict[str, str], seed: int,
) -> None:
    """Catches: a send outside ``confirm_lease()`` found only when a stop happens to fall
    between a check and the send (one seed in several). The lookup is sound, so the
    calibration passes; the send bound fails on the evidence, seed after seed."""
    verdict = _run("award_unconfirmed", site, seed)
    assert not verdict.ok, verdict.raw
    [cal] = verdict.calibration
    assert cal["problem"] is None, cal
    outside = [v for v in verdict.violations if v.startswith("send outside the send bound")]
    assert outside and all("confirmed its lease" in v for v in outside), verdict.violations
    stats = verdict.stats
    assert stats["send_bound_violations"] == len(outside) >= stats["clean_requests"] // 2
    assert stats["send_bound_checked"] >= stats["clean_requests"] > 0, stats


@pytest.mark.timeout(600)
def test_the_guides_example_passes_counted_by_its_own_record(site: dict[str, str]) -> None:
    """The sound job type the bad ones are made from: counted at its stand-in's own record,
    its lookup reporting every one of the 3 x 3 credits the calibration made, every arrival
    inside a send bound (the stop faults freeze a holder between its confirmation and its
    send: its client refuses once the bound passed)."""
    verdict = _run(JOB_TYPE, site, 1)
    assert verdict.ok, verdict.violations
    assert verdict.verified and verdict.counting == {JOB_TYPE: "record"}
    [cal] = verdict.calibration
    assert [(k["made"], k["reported"]) for k in cal["keys"]] == [(3, 3)] * 3, cal
    stats = verdict.stats
    assert stats["send_bound_checked"] >= stats["clean_requests"] > 0, stats
    assert stats.get("send_bound_violations", 0) == 0
    assert verdict.duplicates == 0 and verdict.lost == 0


@pytest.mark.timeout(600)
def test_a_stand_in_without_a_record_is_judged_through_the_lookup_and_said_unverified(
    site: dict[str, str],
) -> None:
    """Catches: a verdict that reads as proof while its counts came from the code under test;
    and ``require_record`` letting such a job type through."""
    verdict = _run("award_unrecorded", site, 1, faults="kill")
    assert verdict.ok, verdict.violations
    assert verdict.counting == {"award_unrecorded": "lookup"} and not verdict.verified
    assert any("award_unrecorded: effects counted through its own lookup hook, unverified" in u
               for u in verdict.unverified), verdict.unverified
    assert "send_bound_checked" not in verdict.stats
    with pytest.raises(ChaosRunFailed, match="declares no record of its own"):
        run_under_faults("award_unrecorded", requests=4, env=site, require_record=True)


def test_the_send_bound_judge_on_timelines() -> None:
    """The judge alone, on hand-made evidence (lease 2 s, so the slack past a bound is 1 s):
    inside a confirmation passes; before any, past the bound plus slack, or with none fails;
    a key whose holder died unrecorded is counted unjudged, not failed."""
    from engine import Effect
    from proof.chaos_truth import SentUnder, judge_send_bounds

    bounds = SentUnder(((100.0, 100.8),), died=False)
    arrivals = {
        "k-in": ("in", [Effect("a", 100.05)]),
        "k-slack": ("slack", [Effect("b", 101.7)]),
        "k-late": ("late", [Effect("c", 104.6)]),
        "k-early": ("early", [Effect("d", 99.0)]),
        "k-none": ("none", [Effect("e", 100.1)]),
        "k-died": ("died", [Effect("f", 100.1)]),
    }
    senders = {"k-in": bounds, "k-slack": bounds, "k-late": bounds, "k-early": bounds,
               "k-none": SentUnder((), died=False), "k-died": SentUnder((), died=True)}
    violations, stats = judge_send_bounds(arrivals, senders, lease=2.0, skew=0.0)
    assert [v.split(":")[1].strip() for v in violations] == ["late", "early", "none"]
    assert "3.80s after the bound" in violations[0]
    assert "no holder of its key confirmed" in violations[2]
    assert stats == {"send_bound_checked": 6, "send_bound_violations": 3,
                     "send_bound_unjudged": 1}
    # the clocks of skewed workers: the same late arrival passes within the skew
    assert judge_send_bounds({"k": ("t", [Effect("g", 102.5)])}, {"k": bounds}, lease=2.0,
                             skew=0.8)[0] == []


def test_the_example_declares_a_record_that_counts_duplicates(tmp_path: Path) -> None:
    """The guide's stand-in record reads its own file: two credits under one key are two."""
    import importlib
    import sys

    module = install_example(tmp_path / "site", package="recordjobs")
    sys.path.insert(0, str(tmp_path / "site"))
    try:
        example = importlib.import_module(module)
    finally:
        sys.path.remove(str(tmp_path / "site"))
    server = example.LedgerServer(tmp_path / "ledger.db").start()
    try:
        client = example.LedgerClient(server.url)
        for _ in range(2):
            client.credit(account_id="a", points=1, key="k-twice")
        client.credit(account_id="a", points=1, key="k-once")
        record = example.LEDGER.sandbox.record
        assert [len(record(server, k, None)) for k in ("k-twice", "k-once", "k-none")] == [2, 1, 0]
        assert all(e.at is not None for e in record(server, "k-twice", None))
    finally:
        server.stop()
