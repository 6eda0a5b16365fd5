"""Run every benchmark suite in one go: ``sekali bench [--quick] [--json] [--only NAME]``.

Each suite is a module in ``benchmarks/`` with ``run(quick: bool) -> dict``. A suite reports its
headline numbers under ``"summary"``: rows of ``{"metric", "value", "unit", "baseline", "ratio",
"target", "ok"}``, each ratio measured against its floor or peer in the same run (the machines
are shared and noisy: absolute numbers travel badly, ratios less so). The runner prints those
rows, writes everything to ``benchmarks/results/latest.json``, and keeps the plots the suites
draw under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from benchmarks.plotting import RESULTS

SUITES = ["idempotency", "locks", "stampede", "retry_storm", "intake", "chaos", "observability",
          "outbox", "flow", "tracing", "cluster", "retention"]
RESULTS_DIR = RESULTS


def run_suites(names: list[str], *, quick: bool) -> dict[str, Any]:
    report: dict[str, Any] = {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "quick": quick,
        "machine": {"python": sys.version.split()[0], "platform": platform.platform()},
        "suites": {},
    }
    for name in names:
        started = time.monotonic()
        print(f"== {name} ...", flush=True)
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
        print(f"   {status} in {result['_seconds']} s", flush=True)
    return report


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
    parser.add_argument("--json", action="store_true", help="print the full JSON report")
    parser.add_argument("--only", action="append", choices=SUITES, help="run only these")


def run_from_args(args: argparse.Namespace) -> int:
    names = args.only or SUITES
    report = run_suites(names, quick=args.quick)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = RESULTS_DIR / "latest.json"
    out.write_text(json.dumps(report, indent=2, default=str))
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(render_table(summary_rows(report)))
        print(f"\nfull results: {out}; plots: {RESULTS_DIR}/*.png")
    return 0 if all(r.get("_status") == "ok" for r in report["suites"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
