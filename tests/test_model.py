"""The SPIN model of the ledger protocol (proof/model/): every check, exhaustively, with the
real spin and gcc (``.ci/run`` installs them).

Each real check would fail if a protocol step the model names were weakened so that one of
its properties broke (the broken variants show SPIN catching exactly that: each removes one
defence and must be refuted). Each broken variant would fail if its defence stopped mattering
to the model (a model too coarse to see the race). Each finding pins the counterexample SPIN
found on the code before its fix (proof/model/README.md, "Findings"): the fix is the default
model, which the real checks verify, and the code before it stays a variant that must be
refuted, so a change that brought the old behaviour back to the model would fail here.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from cli.main import main
from proof.model.runner import CHECKS, find_check, run_check

pytestmark = pytest.mark.skipif(
    (shutil.which("spin") is None or shutil.which("gcc") is None) and not os.environ.get("CI"),
    reason="spin and gcc are not installed (apt-get install spin gcc); CI installs them",
)

BROKEN_PROPERTY = {
    "no_fence_check": "P3",
    "no_send_bound": "P4",
    "resend_no_lookup": "P1",
    "no_settle_wait": "P1",
    "settle_provider_only": "P1",
    "redis_no_floor": "P7",
    "cancel_at_once": "P5",
    "cancel_point_skips_recovery": "P5",
    "finding_cancel": "P5",
    "finding_settle_window": "P1",
}
"""The property each refuted check must break: the one its missing defence keeps."""


@pytest.mark.timeout(900)  # the largest check stores 17 million states: about 1-4 min
@pytest.mark.parametrize("name", [c.name for c in CHECKS])
def test_check_comes_out_as_expected(name: str) -> None:
    check = find_check(name)
    result = run_check(check)
    assert result.error is None, result.error
    assert result.passed, (result.outcome, result.violated, result.timeline)
    assert set(BROKEN_PROPERTY) == {c.name for c in CHECKS if c.expect == "refuted"}
    assert result.states_stored and result.states_stored > 0
    assert result.transitions and result.transitions >= result.states_stored
    assert result.depth and result.depth > 0
    if check.expect == "refuted":
        # the counterexample is readable: a timeline of steps ending in the property broken
        assert len(result.timeline) >= 3
        assert result.timeline[-1].startswith("->    violated: P")
        assert all(line.startswith(("t=", "->")) for line in result.timeline)
        assert result.property is not None
        assert result.property.startswith(BROKEN_PROPERTY[name]), result.property
    else:
        assert result.timeline == []


def test_cli_json_prints_only_json_and_exits_by_expectation(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["model", "check", "--json", "--variant", "redis_fence",
                 "--variant", "redis_no_floor"])
    out = capsys.readouterr().out
    report = json.loads(out)
    assert code == 0 and report["passed"] is True
    by_name = {c["name"]: c for c in report["checks"]}
    assert by_name["redis_fence"]["outcome"] == "verified"
    assert by_name["redis_no_floor"]["outcome"] == "refuted"
    assert by_name["redis_no_floor"]["timeline"][-1].startswith("->    violated: P7")
    assert "spin -a -DREDIS_NO_FLOOR redis_fence.pml" in by_name["redis_no_floor"]["command"]


def test_cli_bad_variant_is_bad_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["model", "check", "--variant", "no_such_check"])
    assert exc.value.code == 2
    assert "no_such_check" in capsys.readouterr().err
