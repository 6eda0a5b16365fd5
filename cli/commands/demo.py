"""``sekali demo``: stampede, duplicate delivery and retry storm, naive against guarded."""

from __future__ import annotations

import argparse

from proof.demo import run_demo


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = sub.add_parser(
        "demo",
        help="a before/after tour on embedded backends (about 15 s on an idle machine, longer on"
        " a busy one; progress on stderr)",
    )
    demo.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    return run_demo()
