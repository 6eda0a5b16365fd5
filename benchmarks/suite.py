"""Run every benchmark suite in one go: ``sekali bench [--quick] [--json] [--markdown]
[--only NAME]``.

Each suite is a module in ``benchmarks/`` with ``run(quick: bool) -> dict``. A suite reports its
numbers under ``"summary"``: rows of ``{"metric", "value", "unit", "baseline", "ratio",
"target", "ok"}``, each ratio measured against its floor or peer in the same run (the machines
are shared and noisy: absolute numbers travel badly, ratios less so), and its headline figures
under ``"headline"``: each a median of interleaved repetitions (:mod:`benchmarks.spread`),
with its min-max spread under ``"headline_spread"``. The runner merges those into one
``headline`` object (every name of :data:`HEADLINE`, null when its suite did not run) with each
target's verdict and one ``headline_spread``, records how busy the machine was (load averages
before and after), writes everything to ``benchmarks/results/latest.json`` and keeps the plots
the suites draw there.

Without ``--only`` every suite runs except those of :data:`ON_REQUEST` (the cluster suite, which
builds network namespaces as root): said in one line on stderr. A suite whose peer library is
not installed (the ``bench`` extra: ``pip install -e '.[bench]'``) says so in one line and
measures sekali's own side; its peer's figures are null. The servers' and peers' INFO logging
stays off stderr (``sekali -v bench`` shows it).

Exit status: 0 when every suite that ran finished; 1 when one failed (each named on stderr in
one line, ``sekali bench: suite failed: NAME: error``), and with ``--strict`` also when a
headline target was missed; 2 for bad usage or an unreadable report. Missed targets are listed
on stderr in any case, one line each (``sekali bench: target missed: NAME = value (target)``).

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
import logging
import os
import platform
import shlex
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks.backends import postgres_url
from benchmarks.plotting import RESULTS

SUITES = ["idempotency", "locks", "stampede", "retry_storm", "intake", "chaos", "observability",
          "outbox", "flow", "intake_flow", "tracing", "peers", "cluster", "retention", "upgrade",
          "fairness", "dlq_sensor", "overload", "adaptive"]
ON_REQUEST = {"cluster": "it builds network namespaces as root and takes about 10 minutes",
              "overload": "it drains two bursts of 50,000 requests through sekali dev",
              "adaptive": "it runs worker processes through a shifting load twice (about 7 "
                          "minutes with --quick, 15 without)"}
"""Suites left out of a run unless named with ``--only``, and why."""
DEFAULT_SUITES = [name for name in SUITES if name not in ON_REQUEST]
RESULTS_DIR = RESULTS

HEADLINE: dict[str, tuple[str, float | None, str]] = {
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
    "peers_sekali_over_celery": (
        "sekali>=", 1.0, "send_email jobs/s through the real launcher (resident workers), per "
        "deployment (sekali dev on SQLite, the production profile on Postgres) over Celery "
        "(Redis broker, acks late), same handler and worker processes"
    ),
    "peers_sekali_over_procrastinate": (
        "", None, "the same over procrastinate (Postgres), per deployment"
    ),
    "peers_duplicates_under_kills": (
        "zero", 0, "mails sent twice and intents never sent, 3 SIGKILLs of workers (and one of "
        "the Dagster daemon, production profile), per system"
    ),
    "peers_latency_p50_ms": (
        "sekali<=", 50.0, "enqueue-to-mail latency p50 at 50 jobs/s offered, ms, per system"
    ),
    "peers_latency_p99_ms": (
        "sekali<=", 500.0, "enqueue-to-mail latency p99 at 50 jobs/s offered, ms, per system"
    ),
    "first_effect_idle_ms": (
        "sekali<=", 1000.0, "one request into an idle system to its mail, ms, per system"
    ),
    "peers_dead_letter_after_decision_ms": (
        "sekali<=", 1000.0, "a permanently failing request in a worker run: its dead letter "
        "after its decision, ms, per deployment"
    ),
    "peers_dead_letter_run_kept_going": (
        "", None, "that worker run still STARTED after it, and the requests after it sent"
    ),
    "fairness_small_tenant_wait_p99_s": (
        "", None, "a small tenant's wait p99 behind a large tenant's 5,000 requests, s (5 s ticks)"
    ),
    "fairness_share_error_max": (
        "<=", 0.05, "largest gap between a tenant's claimed share and its settings' share, "
        "windows of 200 claims"
    ),
    "fairness_claim_cost_ratio": (
        "<=", 1.5, "claim cost with fair share over claim_rank order alone (worse backend)"
    ),
    "upgrade_longest_exclusive_hold_s": (
        "<=", 1.0, "Postgres upgrade from the previous release, 2 M requests: longest ACCESS "
        "EXCLUSIVE hold on job_requests, s"
    ),
    "overload_dead_letters": (
        "<=", 0.0, "a burst of 50,000 under a minute of failed launches and a killed worker: "
        "requests dead-lettered"
    ),
    "overload_drain_ratio": (
        ">=", None, "that burst's drain rate over the same burst with no fault"
    ),
    "overload_oldest_waiting_s": (
        "<=", None, "that burst: the oldest request's wait, s"
    ),
    "overload_peak_rss_mb": (
        "<=", None, "that burst: the largest process's peak resident memory, MB"
    ),
    "adaptive_live_takeovers": (
        "<=", 0.0, "durations shifting from 50 ms to a heavy tail, then a 10x burst: takeovers "
        "of live holders with adaptive leases after the adaptation window"
    ),
    "adaptive_wait_p99_ratio": (
        "<=", 0.5, "that burst's queue wait p99, adaptive leases and workers over fixed ones"
    ),
    "adaptive_scale_down_s": (
        "<=", 120.0, "seconds from the burst's end until the adaptive workers are back at the "
        "base load's count"
    ),
    "adaptive_duplicates_lost": (
        "zero", 0, "effects twice for one key and requests neither completed nor dead-lettered, "
        "fixed and adaptive"
    ),
}
"""Headline figure -> (comparison, target, what it is). Suites report them under "headline".
Comparisons: ``>=`` / ``<=`` a number; ``sekali>=`` / ``sekali<=``: an object per system whose
sekali entries (``sekali``, ``sekali_postgres``) each meet it; ``zero``: an object per system
whose sekali entries have no ``duplicates`` and nothing ``lost``; empty: reported, no
target."""


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
    report["headline_spread"] = headline_spread(report)
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
        verdicts[name] = {"target": target_text(op, target), "ok": met(op, target, values[name]),
                          "what": what}
    return values, verdicts


def headline_spread(report: dict[str, Any]) -> dict[str, Any]:
    """Each headline ratio's min-max spread over its repetitions (``benchmarks.spread``)."""
    spread: dict[str, Any] = {}
    for result in report["suites"].values():
        if result.get("_status") == "ok":
            spread.update(result.get("headline_spread", {}))
    return spread


def merged(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Several saved reports as one: a later report's suites replace an earlier one's, the
    headline is taken again from the suites, and the commands, times and machine loads of all
    are kept (``command`` joins the commands with " + ")."""
    out: dict[str, Any] = {**reports[-1], "suites": {}}
    for report in reports:
        out["suites"].update(report.get("suites", {}))
    out["command"] = " + ".join(r.get("command", "sekali bench") for r in reports)
    out["started_at"] = min(r.get("started_at", "") for r in reports)
    out["machine"] = {**reports[-1].get("machine", {}),
                      "load_before": reports[0].get("machine", {}).get("load_before", ["?"])}
    out["merged_from"] = [{k: r.get(k) for k in ("command", "started_at", "finished_at")}
                          for r in reports]
    out["headline"], out["headline_targets"] = headline(out)
    out["headline_spread"] = headline_spread(out)
    return out


def target_text(op: str, target: float | None) -> str:
    if op == "zero":
        return "sekali: 0 and 0"
    if op.startswith("sekali") and target is not None:
        return f"sekali {op[len('sekali'):]} {target:g}"
    return "" if target is None else f"{op} {target:g}"


def met(op: str, target: float | None, value: Any) -> bool | None:
    if value is None or target is None:
        return None
    if op == "zero":
        mine = [v for k, v in value.items() if k.startswith("sekali") and isinstance(v, dict)]
        return bool(mine) and all(not v.get("duplicates") and not v.get("lost") for v in mine)
    if op.startswith("sekali"):
        ours = [v for k, v in value.items() if k.startswith("sekali")]
        if not ours:
            return None
        return all(v is not None and met(op[len("sekali"):], target, v) for v in ours)
    return bool(value >= target if op == ">=" else value <= target)


def missed_targets(report: dict[str, Any]) -> list[str]:
    """One line per headline target that was measured and missed."""
    lines = []
    for name, verdict in report.get("headline_targets", {}).items():
        if verdict.get("ok") is False:
            value = _fmt(report["headline"].get(name))
            lines.append(f"target missed: {name} = {value} (target {verdict['target']})")
    return lines


def render_markdown(report: dict[str, Any], command: str) -> str:
    """The headline as a Markdown table, with the command, date and machine load behind it."""
    m = report.get("machine", {})
    lines = [
        f"`{command}` ({'quick' if report.get('quick') else 'full'} run, "
        f"{report.get('started_at', '?')}, {m.get('cpus', '?')} CPUs, load average "
        f"{m.get('load_before', ['?'])[0]} before and {m.get('load_after', ['?'])[0]} after):",
        "",
        "| headline | value | spread (min-max) | target | met |",
        "|---|---|---|---|---|",
    ]
    targets = report.get("headline_targets", {})
    spreads = report.get("headline_spread", {})
    for name, value in report.get("headline", {}).items():
        t = targets.get(name, {})
        shown = "not run" if value is None else _fmt(value)
        verdict = {True: "yes", False: "no", None: ""}[t.get("ok")]
        what, target = t.get("what", name), t.get("target", "")
        s = spreads.get(name)
        spread = "" if s is None else f"{_fmt(s['min'])}-{_fmt(s['max'])} ({len(s['runs'])} runs)"
        lines.append(f"| {what} (`{name}`) | {shown} | {spread} | {target} | {verdict} |")
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
    if isinstance(value, dict):
        return ", ".join(
            f"{k} ({_fmt(v)})" if isinstance(v, dict) else f"{k} {_fmt(v)}"
            for k, v in value.items()
        )
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
        "--from", dest="from_file", metavar="FILE", action="append",
        help="render a saved report, do not run; given again, later reports' suites replace "
             "earlier ones'",
    )
    parser.add_argument(
        "--readme", metavar="PATH", help="write the table between PATH's bench markers"
    )
    parser.add_argument(
        "--only", action="append", choices=SUITES,
        help="run only these (repeatable); the cluster suite runs only when named here",
    )
    parser.add_argument("--out", metavar="PATH", help="write the JSON report to PATH too")
    parser.add_argument(
        "--strict", action="store_true", help="exit 1 when a headline target is missed too"
    )


def run_from_args(args: argparse.Namespace) -> int:
    if args.out and not Path(args.out).resolve().parent.is_dir():
        print(f"sekali bench: --out {args.out}: no such folder", file=sys.stderr)
        return 2
    if args.from_file:
        reports = []
        for name in args.from_file:
            try:
                reports.append(json.loads(Path(name).read_text()))
            except (OSError, ValueError) as exc:
                print(f"sekali bench: cannot read {name}: {exc}", file=sys.stderr)
                return 2
            if "headline" not in reports[-1]:
                print(f"sekali bench: {name} has no headline", file=sys.stderr)
                return 2
        report = reports[0] if len(reports) == 1 else merged(reports)
        command = report.get("command", "sekali bench")
        ok = True
    else:
        argv = ["sekali", "bench", *(["--quick"] if args.quick else [])]
        argv += [f"--only={name}" for name in args.only or []]
        command = shlex.join(argv)
        if not getattr(args, "verbose", False):  # the suites' servers and peers log at INFO
            logging.getLogger().setLevel(logging.WARNING)
            warnings.simplefilter("ignore")  # Dagster's beta notices say nothing of the numbers
            os.environ["PYTHONWARNINGS"] = "ignore"  # nor in the suites' worker processes
        names = args.only or DEFAULT_SUITES
        for name, why in ON_REQUEST.items():
            if not args.only:
                print(f"sekali bench: the {name} suite is left out ({why}): "
                      f"--only {name} runs it", file=sys.stderr)
        with _stdout_to_stderr() as real_stdout:
            report = run_suites(names, quick=args.quick)
            report["command"] = command
            RESULTS_DIR.mkdir(parents=True, exist_ok=True)
            out = RESULTS_DIR / "latest.json"
            out.write_text(json.dumps(report, indent=2, default=str))
            print(f"full results: {out}; plots: {RESULTS_DIR}/*.png", flush=True)
            if not args.json and not args.markdown:
                with os.fdopen(os.dup(real_stdout), "w") as stdout:
                    print(render_table(summary_rows(report)), file=stdout)
        failed = [f"suite failed: {name}: {r.get('error')}" for name, r in report["suites"].items()
                  if r.get("_status") != "ok"]
        missed = missed_targets(report)
        for line in failed + missed:
            print(f"sekali bench: {line}", file=sys.stderr)
        ok = not failed and not (args.strict and missed)
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
