"""``sekali model check [--json] [--out PATH] [--variant NAME ...]``: verify the SPIN model of
the ledger protocol (``proof/model/``).

Runs every check (or those named with ``--variant``), one exhaustive verification each: the
real model must verify, every broken variant and the code before each finding's fix must be
refuted by a counterexample, which is printed as a timeline. Prints per check the states
stored, transitions, depth, memory and seconds, with the command that ran it. Progress goes
to stderr. Exit status: 0 when every check came out as expected, 1 when one did not (the real
model failed, or a broken variant verified), 2 for bad usage or when spin or gcc is missing.
"""

from __future__ import annotations

import argparse
import datetime as dt
from typing import Any

from cli.commands.output import add_output_arguments, console, emit, err_console
from proof.model.runner import CHECKS, Result, ToolMissing, require_tools, run_checks


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    model = sub.add_parser("model", help="the SPIN model of the ledger protocol")
    verbs = model.add_subparsers(dest="verb", required=True)
    check = verbs.add_parser(
        "check",
        help="verify the model and refute its broken variants (a few minutes on 2 cores)",
    )
    check.add_argument(
        "--variant", action="append", metavar="NAME", choices=[c.name for c in CHECKS],
        help="run only this check (repeatable): " + ", ".join(c.name for c in CHECKS),
    )
    add_output_arguments(check)
    check.set_defaults(func=_check)


def _check(args: argparse.Namespace) -> int:
    err = err_console()
    try:
        require_tools()
    except ToolMissing as exc:
        err.print(f"sekali model check: {exc}")
        return 2
    started = dt.datetime.now().astimezone()

    def heard(result: Result) -> None:
        verdict = "ok" if result.passed else "UNEXPECTED"
        err.print(f"sekali model check: {result.name}: {result.outcome} ({verdict}, "
                  f"{result.wall_seconds:.1f} s)")

    results = run_checks(args.variant, progress=heard)
    report: dict[str, Any] = {
        "started": started.isoformat(timespec="seconds"),
        "passed": all(r.passed for r in results),
        "checks": [r.as_dict() for r in results],
    }
    code = emit(args, report, lambda: _show(results))
    if code:
        return code
    return 0 if report["passed"] else 1


def _show(results: list[Result]) -> None:
    out = console()
    out.print(f"{'check':<22} {'role':<8} {'expected':<9} {'outcome':<9} {'states':>11} "
              f"{'transitions':>12} {'depth':>6} {'MB':>7} {'s':>7}")
    for r in results:
        mark = "" if r.passed else "  <- not as expected"
        out.print(f"{r.name:<22} {r.role:<8} {r.expect:<9} {r.outcome:<9} "
                  f"{_n(r.states_stored):>11} {_n(r.transitions):>12} {_n(r.depth):>6} "
                  f"{_f(r.memory_mb):>7} {_f(r.wall_seconds):>7}{mark}")
    for r in results:
        if r.error:
            out.print(f"\n{r.name}: {r.error}")
        if r.timeline:
            out.print(f"\n{r.name} ({r.role}): {r.says}")
            for line in r.timeline:
                out.print(f"    {line}")
    failed = [r.name for r in results if not r.passed]
    out.print("\nevery check came out as expected" if not failed
              else f"\nnot as expected: {', '.join(failed)}")


def _n(value: int | None) -> str:
    return "" if value is None else f"{value:,}"


def _f(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"
