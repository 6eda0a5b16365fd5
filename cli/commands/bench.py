"""``sekali bench``: every benchmark suite in one run, as ratios against floors and peers."""

from __future__ import annotations

import argparse

from benchmarks.suite import add_arguments, run_from_args


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser("bench", help="run benchmarks/ and print ratios (JSON and plots too)")
    add_arguments(bench)
    bench.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    return run_from_args(args)
