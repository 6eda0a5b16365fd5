"""``sekali demo``: stampede, duplicate delivery and retry storm, naive against guarded."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = sub.add_parser("demo", help="a two-minute before/after tour on embedded backends")
    demo.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from sandbox.demo import run_demo  # noqa: PLC0415

    return run_demo()
