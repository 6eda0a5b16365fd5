"""The ``sekali`` command. Each subcommand lives in its own module with a ``register(sub)``
function that adds its parser and sets ``func``; this file only lists them."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

# Modules providing subcommands, each with ``register(subparsers) -> None``.
COMMAND_MODULES: list[str] = [
    "pipelines.commands.db",
    "pipelines.commands.dev",
    "pipelines.commands.bench",
    "pipelines.commands.demo",
    "pipelines.commands.enqueue",
    "pipelines.commands.dlq",
    "pipelines.commands.doctor",
    "pipelines.commands.metrics",
    "pipelines.commands.chaos",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sekali", description="Jobs that stay right under at-least-once delivery."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
