"""The demo's claims hold: what it prints for "guarded" is what the defences actually did."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from proof import demo


@pytest.mark.slow
def test_stampede_scene_loads_once_guarded_and_per_caller_naive(redis_url: str) -> None:
    rows = {row[0]: row for row in demo.stampede(redis_url, processes=2, threads=10)}
    assert rows["guarded"][2] == 1
    assert rows["naive"][2] > 1


def test_duplicate_delivery_scene_charges_once_per_order_guarded(
    redis_url: str, tmp_path: Path
) -> None:
    rows = {row[0]: row for row in demo.duplicate_delivery(redis_url, tmp_path, orders=8)}
    naive, guarded = rows["naive"], rows["guarded"]
    assert naive[3] == 24 and naive[4] == 16  # every delivery charged
    assert guarded[3] == 8 and guarded[4] == 0  # one charge per order
    assert guarded[5] == 16  # the other deliveries were suppressed duplicates


def test_retry_storm_scene_jitter_and_budget_flatten_the_peak() -> None:
    rows = {row[0]: row for row in demo.retry_storm()}
    assert rows["full jitter + budget"][1] * 5 < rows["no jitter"][1]


def test_each_scene_reports_its_progress_while_it_runs(redis_url: str, tmp_path: Path) -> None:
    """Catches: a demo silent for the seconds a scene takes (the steps come before the table)."""
    said: list[str] = []
    rows = demo.duplicate_delivery(redis_url, tmp_path, orders=4, progress=said.append)
    assert said[0] == "naive: delivering 12 payments (3 per order)"
    assert "naive: 12 of 12 delivered" in said and "guarded: 12 of 12 delivered" in said
    assert said[-1] == "guarded: the gateway holds 4 charges for 4 orders"
    assert {row[0] for row in rows} == {"naive", "guarded"}
    storm: list[str] = []
    demo.retry_storm(progress=storm.append)
    assert [s.split(":")[0] for s in storm] == ["no jitter"] * 2 + ["full jitter + budget"] * 2


def test_progress_lines_stay_whole_in_a_log_file() -> None:
    """Catches: progress lines cut at 80 columns when stderr is a pipe or a log file, so one
    event reads as two lines."""
    buf = io.StringIO()
    line = "[  9.5s] 2/3 duplicate delivery: naive: the gateway holds 90 charges for 30 orders"
    demo.progress_console(buf).print(line + " " + "x" * 60)
    assert buf.getvalue().splitlines() == [line + " " + "x" * 60]


@pytest.mark.slow
def test_the_demo_leaves_no_state_behind(tmp_path: Path) -> None:
    """Catches: every ``sekali demo`` leaving its databases and Redis folder in the temp dir."""
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    env["TMPDIR"] = str(tmp_path)
    sekali = str(Path(sys.executable).with_name("sekali"))
    done = subprocess.run([sekali, "demo"], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "(done in" in done.stdout
    assert list(tmp_path.glob("sekali-demo-*")) == []
