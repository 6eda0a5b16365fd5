"""Run every benchmark suite in one go: ``sekali bench [--quick] [--json] [--markdown]
[--only NAME]``.

Each suite is a module in ``benchmarks/`` with ``run(quick: bool) -> dict``. A suite reports its
numbers under ``"summary"``: rows of ``{"metric", "value", "unit", "baseline", "ratio",
"target", "ok"}``, each ratio measured against its floor or peer in the same run (the machines
are shared and noisy: absolute numbers travel badly, ratios less so), and its headline figures
under ``"headline"``. The runner merges those into one ``headline`` object (every name of
:data:`HEADLINE`, null when its suite did not run) with each target's verdict, records how busy
the machine was (load averages before and after), writes everything to
``benchmarks/results/latest.json`` and keeps the plots the suites draw there.

``--json`` prints that report, and nothing else, on stdout (progress, the suites' own output
and their subprocesses' go to stderr); ``--out PATH`` writes it to ``PATH`` as well. The servers
come from :mod:`benchmarks.backends`: the Postgres database is created when missing, and with no
Postgres the suites run the embedded backend alone (said on stderr, the report's ``backends``
says which ran). ``--markdown`` prints the headline as the README's table,
with the command that produced it; ``--from FILE`` renders a saved report instead of running,
and ``--readme README.md`` writes the table between the README's ``bench:start`` and
``bench:end`` markers.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import shlex
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks.backends import postgres_url
from benchmarks.plotting import RESULTS

SUITES = ["idempotency", "locks", "stampede", "retry_storm", "intake", "chaos", "observability",
          "outbox", "flow", "intake_flow", "tracing", "cluster", "retention", "upgrade"]
RESULTS_DIR = RESULTS

HEADLINE: dict[str, tuple[str, float, str]] = {
    "idempotency_pg_pair_ratio_1t": (
        ">=", 0.85, "Postgres begin+complete over two raw statements, 1 thread"
    ),
    "idempotency_pg_pair_ratio_8t": (
        ">=", 0.8, "Postgres begin+complete over two raw statements, 8 threads"
    ),
    "idempotency_sqlite_pair_ratio_1t": (
        ">=", 0.7, "SQLite begin+complete over two raw statements, 1 thread"
    ),
    "intake_micro_batch_ratio": (
        ">=", 2.0, "micro-batch jobs/s over the per-key handler loop (lower backend)"
    ),
    "stampede_cohort_peak_over_mean_default": (
        "<=", 1.5, "1,000 keys loaded together, loader peak over mean, defaults"
    ),
    "cache_hit_ratio_vs_get": (">=", 0.9, "cache hit path over a raw GET"),
    "cold_waiter_p99_past_loader_ms": (
        "<=", 10.0, "cold waiters' p99 past the 200 ms loader, ms"
    ),
    "metrics_snapshot_over_read": (
        "<=", 2.0, "metrics snapshot over a bare read of the rows (worse backend)"
    ),
    "upgrade_longest_exclusive_hold_s": (
        "<=", 1.0, "Postgres upgrade from the previous release, 2 M requests: longest ACCESS "
        "EXCLUSIVE hold on job_requests, s"
    ),
}
"""Headline figure -> (comparison, target, what it is). Suites report them under "headline"."""


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_suites(names: list[str], *, quick: bool) -> dict[str, Any]:
    report: dict[str, Any] = {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "quick": quick,
        "machine": {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_before": _load(),
        },
        "suites": {},
    }
    postgres_url()  # decided (database created, or the fallback said) before any suite runs
    for name in names:
        started = time.monotonic()
        print(f"== {name} ...", file=sys.stderr, flush=True)
        try:
            module = importlib.import_module(f"benchmarks.{name}")
            result = module.run(quick=quick)
            status = "ok"
        except Exception as exc:  # noqa: BLE001 - one failing suite must not hide the rest
            result = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
            status = "error"
        result["_status"] = status
        result["_seconds"] = round(time.monotonic() - started, 1)
        report["suites"][name] = result
        print(f"   {status} in {result['_seconds']} s", file=sys.stderr, flush=True)
    report["backends"] = {"postgres": postgres_url() is not None}
    report["machine"]["load_after"] = _load()
    report["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    report["headline"], report["headline_targets"] = headline(report)
    return report


def headline(report: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The suites' headline figures merged (null where a suite did not run), and each target's
    verdict."""
    values: dict[str, Any] = dict.fromkeys(HEADLINE)
    for result in report["suites"].values():
        if result.get("_status") == "ok":
            values.update(result.get("headline", {}))
    verdicts = {}
    for name, (op, target, what) in HEADLINE.items():
        value = values[name]
        ok = None if value is None else (value >= target if op == ">=" else value <= target)
        verdicts[name] = {"target": f"{op} {target:g}", "ok": ok, "what": what}
    return values, verdicts


def render_markdown(report: dict[str, Any], command: str) -> str:
    """The headline as a Markdown table, with the command, date and machine load behind it."""
    m = report.get("machine", {})
    lines = [
        f"`{command}` ({'quick' if report.get('quick') else 'full'} run, "
        f"{report.get('started_at', '?')}, {m.get('cpus', '?')} CPUs, load average "
        f"{m.get('load_before', ['?'])[0]} before and {m.get('load_after', ['?'])[0]} after):",
        "",
        "| headline | value | target | met |",
        "|---|---|---|---|",
    ]
    targets = report.get("headline_targets", {})
    for name, value in report.get("headline", {}).items():
        t = targets.get(name, {})
        shown = "not run" if value is None else _fmt(value)
        met = {True: "yes", False: "no", None: ""}[t.get("ok")]
        what, target = t.get("what", name), t.get("target", "")
        lines.append(f"| {what} (`{name}`) | {shown} | {target} | {met} |")
    return "\n".join(lines)


def write_readme(path: Path, table: str) -> None:
    """Replace what lies between ``<!-- bench:start -->`` and ``<!-- bench:end -->``."""
    text = path.read_text()
    start, end = "<!-- bench:start -->", "<!-- bench:end -->"
    if start not in text or end not in text:
        raise SystemExit(f"{path}: no {start} ... {end} markers to write the table between")
    head, _, rest = text.partition(start)
    _, _, tail = rest.partition(end)
    path.write_text(f"{head}{start}\n{table}\n{end}{tail}")


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[int]:
    """While the suites run, file descriptor 1 (and ``sys.stdout``) is stderr, so nothing they
    or their subprocesses print can mix into the JSON; yields a descriptor of the real stdout."""
    sys.stdout.flush()
    real = os.dup(1)
    os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield real
    finally:
        sys.stdout.flush()
        os.dup2(real, 1)
        os.close(real)


def summary_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for name, result in report["suites"].items():
        if result.get("_status") != "ok":
            rows.append({"suite": name, "metric": "ERROR", "value": result.get("error")})
            continue
        for row in result.get("summary", []):
            rows.append({"suite": name, **row})
    return rows


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return "" if value is None else str(value)


def render_table(rows: list[dict[str, Any]]) -> str:
    header = ["suite", "metric", "value", "unit", "baseline", "ratio", "target", "ok"]
    cells = [[_fmt(r.get(h)) for h in header] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h)
              for i, h in enumerate(header)]
    lines = [" | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("-|-".join("-" * w for w in widths))
    lines += [" | ".join(c.ljust(w) for c, w in zip(cell, widths, strict=True)) for cell in cells]
    return "\n".join(lines)


def module_main(
    doc: str | None,
    run: Callable[..., dict[str, Any]],
    render: Callable[[dict[str, Any]], None],
    argv: list[str] | None = None,
) -> int:
    """The ``python -m benchmarks.NAME [--quick] [--json]`` entry point every suite shares."""
    parser = argparse.ArgumentParser(description=(doc or "").strip().splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--json", action="store_true", help="print the raw results as JSON")
    args = parser.parse_args(argv)
    result = run(quick=args.quick)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        render(result)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sekali bench")
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="small sizes (a few minutes)")
    parser.add_argument(
        "--json", action="store_true", help="print the JSON report (only it) on stdout"
    )
    parser.add_argument(
        "--markdown", action="store_true", help="print the headline as the README's table"
    )
    parser.add_argument(
        "--from", dest="from_file", metavar="FILE", help="render a saved report, do not run"
    )
    parser.add_argument(
        "--readme", metavar="PATH", help="write the table between PATH's bench markers"
    )
    parser.add_argument("--only", action="append", choices=SUITES, help="run only these")
    parser.add_argument("--out", metavar="PATH", help="write the JSON report to PATH too")


def run_from_args(args: argparse.Namespace) -> int:
    if args.out and not Path(args.out).resolve().parent.is_dir():
        print(f"sekali bench: --out {args.out}: no such folder", file=sys.stderr)
        return 2
    if args.from_file:
        try:
            report = json.loads(Path(args.from_file).read_text())
        except (OSError, ValueError) as exc:
            print(f"sekali bench: cannot read {args.from_file}: {exc}", file=sys.stderr)
            return 2
        if "headline" not in report:
            print(f"sekali bench: {args.from_file} has no headline", file=sys.stderr)
            return 2
        command = report.get("command", "sekali bench")
        ok = True
    else:
        argv = ["sekali", "bench", *(["--quick"] if args.quick else [])]
        argv += [f"--only={name}" for name in args.only or []]
        command = shlex.join(argv)
        with _stdout_to_stderr() as real_stdout:
            report = run_suites(args.only or SUITES, quick=args.quick)
            report["command"] = command
            RESULTS_DIR.mkdir(parents=True, exist_ok=True)
            out = RESULTS_DIR / "latest.json"
            out.write_text(json.dumps(report, indent=2, default=str))
            print(f"full results: {out}; plots: {RESULTS_DIR}/*.png", flush=True)
            if not args.json and not args.markdown:
                with os.fdopen(os.dup(real_stdout), "w") as stdout:
                    print(render_table(summary_rows(report)), file=stdout)
        ok = all(r.get("_status") == "ok" for r in report["suites"].values())
    table = render_markdown(report, command)
    if args.out:
        try:
            Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")
        except OSError as exc:
            print(f"sekali bench: cannot write {args.out}: {exc}", file=sys.stderr)
            return 2
        print(f"sekali bench: report written to {args.out}", file=sys.stderr)
    if args.readme:
        write_readme(Path(args.readme), table)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    elif args.markdown:
        print(table)
    elif args.from_file:
        print(render_table(summary_rows(report)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
