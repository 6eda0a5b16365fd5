"""``sekali bench``: one JSON document on stdout with the headline object, progress on stderr;
the README's table rendered from a saved report; exit 2 for a report it cannot read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sqlalchemy import create_engine, text

from benchmarks.suite import DEFAULT_SUITES, HEADLINE, SUITES, target_text
from sandbox.postgres_server import PostgresServer, PostgresUnavailable
from tests.conftest import need_server

ROOT = Path(__file__).resolve().parents[1]
SEKALI = [sys.executable, "-m", "cli.main"]


def bench(
    *args: str, cwd: Path = ROOT, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*SEKALI, "bench", *args], cwd=cwd, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
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
    assert report["backends"] == {"postgres": True}


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
            name: {"target": target_text(op, t), "ok": None, "what": what}
            for name, (op, t, what) in HEADLINE.items()
        }
        | {"cache_hit_ratio_vs_get": {"target": ">= 0.9", "ok": True, "what": "hit path"}},
        "headline_spread": {
            "cache_hit_ratio_vs_get": {"median": 0.93, "min": 0.88, "max": 0.95,
                                       "runs": [0.93, 0.88, 0.95]},
        },
    }
    saved = tmp_path / "report.json"
    saved.write_text(json.dumps(report))
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- bench:start -->\nold table\n<!-- bench:end -->\noutro\n")

    proc = bench("--markdown", "--from", str(saved), "--readme", str(readme))

    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("`sekali bench --quick` (quick run, 2026-11-30T12:00:00Z")
    assert ("| hit path (`cache_hit_ratio_vs_get`) | 0.93 | 0.88-0.95 (3 runs) | >= 0.9 | yes |"
            in proc.stdout)
    assert "(`intake_micro_batch_ratio`) | not run |" in proc.stdout
    text = readme.read_text()
    assert text.startswith("intro\n<!-- bench:start -->\n`sekali bench --quick`")
    assert "old table" not in text and text.endswith("<!-- bench:end -->\noutro\n")


def test_several_reports_render_as_one_with_the_later_suites_winning(tmp_path: Path) -> None:
    """Catches a README table that mixes a partial re-run with a full run by hand: the headline
    is taken again from the merged suites, a re-run suite replacing the earlier one."""
    def report(command: str, suites: dict[str, float]) -> Path:
        path = tmp_path / f"{len(suites)}-{command.split()[-1]}.json"
        path.write_text(json.dumps({
            "command": command, "started_at": "2026-12-01T10:00:00Z", "headline": {},
            "machine": {"cpus": 2, "load_before": [1, 1, 1], "load_after": [2, 2, 2]},
            "suites": {name: {"_status": "ok", "headline": {key: value}}
                       for name, (key, value) in suites.items()},
        }))
        return path

    full = report("sekali bench", {"stampede": ("cache_hit_ratio_vs_get", 0.8),
                                   "observability": ("metrics_snapshot_over_read", 0.5)})
    again = report("sekali bench --only=stampede", {"stampede": ("cache_hit_ratio_vs_get", 0.95)})
    proc = bench("--markdown", "--from", str(full), "--from", str(again))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("`sekali bench + sekali bench --only=stampede`")
    assert "(`cache_hit_ratio_vs_get`) | 0.95 |" in proc.stdout
    assert "(`metrics_snapshot_over_read`) | 0.5 |" in proc.stdout


def test_an_unreadable_report_is_bad_input(tmp_path: Path) -> None:
    proc = bench("--markdown", "--from", str(tmp_path / "missing.json"))
    assert proc.returncode == 2
    assert proc.stdout == "" and "cannot read" in proc.stderr


def test_without_postgres_it_runs_the_embedded_backend_says_so_and_writes_out(
    tmp_path: Path,
) -> None:
    """Catches a bench that dies (or prints a traceback into the JSON) on a machine without
    the Postgres it expects, one that leaves the fallback unsaid, and an ``--out`` that
    writes something other than the document printed on stdout."""
    out = tmp_path / "report.json"
    proc = bench(
        "--json", "--quick", "--only", "observability", "--out", str(out),
        env={"SEKALI_BENCH_PG_URL": "postgresql+psycopg://postgres@127.0.0.1:1/nowhere"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert json.loads(out.read_text()) == report
    assert report["backends"] == {"postgres": False}
    assert "the embedded backend (SQLite) runs alone" in proc.stderr
    suite = report["suites"]["observability"]
    assert set(suite["backends"]) == {"sqlite"} and "postgres" in suite["skipped"]
    assert isinstance(report["headline"]["metrics_snapshot_over_read"], float)


def test_a_missing_database_is_created_on_a_fresh_server(tmp_path: Path) -> None:
    """Catches a bench that needs its database made by hand: on a private, fresh cluster it
    creates the database named by its URL, says so, and measures Postgres there."""
    try:
        server = PostgresServer().start()
    except PostgresUnavailable as exc:
        need_server("a private PostgreSQL cluster (initdb, pg_ctl)", exc)
        raise
    try:
        url = server.url("bench_fresh")
        proc = bench(
            "--json", "--quick", "--only", "observability",
            env={"SEKALI_BENCH_PG_URL": url},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "created database 'bench_fresh'" in proc.stderr
        report = json.loads(proc.stdout)
        assert report["backends"] == {"postgres": True}
        assert "error" not in report["suites"]["observability"]["backends"]["postgres"]
        assert isinstance(report["headline"]["metrics_snapshot_over_read_postgres"], float)
        engine = create_engine(server.url())
        with engine.connect() as conn:
            names = conn.execute(text("SELECT datname FROM pg_database")).scalars().all()
        engine.dispose()
        assert "bench_fresh" in names
    finally:
        server.stop()


def test_a_missing_peer_library_is_one_line_and_sekalis_side_is_still_measured(
    tmp_path: Path,
) -> None:
    """Catches a suite that dies on a machine with only the README's install (the locks suite
    imported python-redis-lock at the top and errored), or that says nothing about what it
    left out. The package is hidden by a stand-in that fails to import, as a missing one does."""
    hidden = tmp_path / "hidden" / "redis_lock"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('python-redis-lock is hidden')\n")
    proc = bench(
        "--json", "--quick", "--only", "locks",
        env={"PYTHONPATH": f"{hidden.parent}:{ROOT}"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stderr.splitlines() if "python-redis-lock" in line]
    assert len(said) == 1 and "pip install -e '.[bench]'" in said[0]
    suite = json.loads(proc.stdout)["suites"]["locks"]
    assert "python-redis-lock" not in suite["uncontended"]
    assert suite["uncontended"]["sekali RedisLock (no renewal)"]["ops_per_s"] > 0
    assert " INFO " not in proc.stderr  # the peers' and servers' INFO lines stay off stderr


def test_the_cluster_suite_runs_only_when_named() -> None:
    """Catches a default run that builds network namespaces as root without being asked."""
    assert "cluster" in SUITES and "cluster" not in DEFAULT_SUITES
    assert "peers" in DEFAULT_SUITES


def test_out_into_a_missing_folder_is_bad_usage_before_anything_runs(tmp_path: Path) -> None:
    proc = bench("--json", "--only", "observability", "--out", str(tmp_path / "no" / "r.json"))
    assert proc.returncode == 2 and proc.stdout == ""
    assert "no such folder" in proc.stderr and "== observability" not in proc.stderr


def test_the_benchmarks_run_resources_cover_every_resource_the_measured_jobs_need() -> None:
    """Catches a downstream declared after the benchmarks were written: its resource missing
    from the runs they build (``resource with key ... not provided`` in the intake and peers
    suites of a fresh clone's ``sekali bench --quick``)."""
    from benchmarks.intake import run_resources
    from pipelines.ops import all_jobs
    from pipelines.ops.batch import BATCH_JOBS

    given = set(run_resources("sqlite://", 9, "t", redis="redis://127.0.0.1:9/0"))
    for job in [*BATCH_JOBS, *all_jobs]:
        needed = {key for node in job.graph.node_defs for key in node.required_resource_keys}
        assert needed <= given, (job.name, sorted(needed - given))


def test_a_quick_stampede_summary_has_the_cohort_rows_it_ran_and_the_headline_row() -> None:
    """Catches a quick run that measures fewer cohort configurations but whose summary still
    asks for every one (a KeyError failed the suite), or that drops the headline's row."""
    from benchmarks.stampede import COHORT_CONFIGS, QUICK_COHORT_CONFIGS, summary

    assert "default" in QUICK_COHORT_CONFIGS and set(QUICK_COHORT_CONFIGS) < set(COHORT_CONFIGS)
    ratios = {"sekali_cold_p99_minus_loader_ms": 4.0, "dogpile_cold_p99_minus_loader_ms": None,
              "sekali_stale_p99_over_hit_p99": 1.2,
              **{f"peak_over_mean_{label}": 1.2 for label in QUICK_COHORT_CONFIGS}}
    rows = summary({}, {"p99_ms": 1.0}, {"sekali_hit_per_s": 1000.0, "ratio": 0.95}, ratios)
    cohort = [r["metric"].rsplit(", ", 1)[1] for r in rows if "loaded together" in r["metric"]]
    assert cohort == list(QUICK_COHORT_CONFIGS)
    assert next(r for r in rows if r["metric"].endswith(", default"))["ok"] is True
