"""``sekali bench``: one JSON document on stdout with the headline object, progress on stderr;
the README's table rendered from a saved report; exit 2 for a report it cannot read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.suite import HEADLINE

ROOT = Path(__file__).resolve().parents[1]
SEKALI = [sys.executable, "-m", "pipelines.cli"]


def bench(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*SEKALI, "bench", *args], cwd=cwd, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_json_is_the_only_thing_on_stdout_and_holds_every_headline_name() -> None:
    """Catches progress lines (or a suite's prints) mixed into the JSON, and a headline that
    leaves out a name because its suite did not run."""
    proc = bench("--json", "--quick", "--only", "observability")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert set(report["headline"]) >= set(HEADLINE)
    assert isinstance(report["headline"]["metrics_snapshot_over_read"], float)
    assert report["headline"]["intake_micro_batch_ratio"] is None  # not run: null, not absent
    assert report["headline_targets"]["metrics_snapshot_over_read"]["target"] == "<= 2"
    assert len(report["machine"]["load_before"]) == 3
    assert "== observability" in proc.stderr


def test_markdown_table_from_a_saved_report_and_into_the_readme(tmp_path: Path) -> None:
    """Catches a README table written by hand: it is rendered from the report's headline, with
    the command that produced it, between the README's markers (and nothing else changes)."""
    report = {
        "command": "sekali bench --quick",
        "quick": True,
        "started_at": "2026-11-30T12:00:00Z",
        "machine": {"cpus": 2, "load_before": [3.5, 3, 3], "load_after": [4.25, 3, 3]},
        "suites": {},
        "headline": dict.fromkeys(HEADLINE, None) | {"cache_hit_ratio_vs_get": 0.93},
        "headline_targets": {
            name: {"target": f"{op} {t:g}", "ok": None, "what": what}
            for name, (op, t, what) in HEADLINE.items()
        }
        | {"cache_hit_ratio_vs_get": {"target": ">= 0.9", "ok": True, "what": "hit path"}},
    }
    saved = tmp_path / "report.json"
    saved.write_text(json.dumps(report))
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- bench:start -->\nold table\n<!-- bench:end -->\noutro\n")

    proc = bench("--markdown", "--from", str(saved), "--readme", str(readme))

    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("`sekali bench --quick` (quick run, 2026-11-30T12:00:00Z")
    assert "| hit path (`cache_hit_ratio_vs_get`) | 0.93 | >= 0.9 | yes |" in proc.stdout
    assert "(`intake_micro_batch_ratio`) | not run |" in proc.stdout
    text = readme.read_text()
    assert text.startswith("intro\n<!-- bench:start -->\n`sekali bench --quick`")
    assert "old table" not in text and text.endswith("<!-- bench:end -->\noutro\n")


def test_an_unreadable_report_is_bad_input(tmp_path: Path) -> None:
    proc = bench("--markdown", "--from", str(tmp_path / "missing.json"))
    assert proc.returncode == 2
    assert proc.stdout == "" and "cannot read" in proc.stderr
