"""The adaptive benchmark's machinery (:mod:`benchmarks.adaptive`) on a short plan: real worker
processes running the engine's resident worker, sized every tick by the supervisor's own
function, against the run's database and Redis. It asserts what must hold in any run (no
duplicate, nothing lost, everything drained, the fixed count kept, the sized one scaled up for
the burst and back after it); the benchmark itself reports the comparison."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.adaptive import MODES, Plan, run_mode
from benchmarks.adaptive_jobs import duration_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SHORT = Plan(rate=2.0, warm_s=6, tail_s=8, burst_s=6, calm_s=8, burst_factor=8,
             kill_after_s=4, adapt_s=4, tick_s=1.0, drain_s=120,
             env={"SEKALI_ARRIVAL_WINDOW": "6", "SEKALI_SCALE_DOWN_AFTER": "3"})


def test_the_probes_tail_is_heavy_and_the_same_for_every_attempt() -> None:
    """Catches a tail that is not the one the benchmark names (p99 4 s) and a draw that
    changes between attempts of one request (a retry would then hide the stall)."""
    tail = sorted(duration_of("tail", n) for n in range(20_000))
    assert 3.5 < tail[int(0.99 * len(tail))] < 4.5 and tail[len(tail) // 2] < 0.2
    assert duration_of("tail", 7) == duration_of("tail", 7) and duration_of("fast", 7) == 0.05


@pytest.mark.parametrize("mode", list(MODES))
def test_a_short_run_drains_with_no_duplicate_and_nothing_lost(
    mode: str, tmp_path: Path
) -> None:
    """Catches a harness that loses requests (a killed worker's never given back), counts a
    duplicate, leaves workers running, or a supervisor that does not follow its targets (the
    fixed count kept, the sized queue up for the burst and back after)."""
    result = run_mode(mode, SHORT, tmp_path)
    assert result["drained"], result
    assert result["duplicates"] == 0 and result["lost"] == 0, result
    assert sum(result["statuses"].values()) == result["requests"] == len(SHORT.schedule())
    assert result["killed_worker"] is not None
    counts = [n for _, n in result["workers_over_time"]]
    if mode == "fixed":
        assert max(counts) == 2 and result["workers_settled"] == 2
    else:
        assert max(counts) > 1 and counts[0] == 1
        assert result["scale_down_s"] is not None
