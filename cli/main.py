"""The ``sekali`` command. Each subcommand lives in its own module with a ``register(sub)``
function that adds its parser and sets ``func``; this file only lists them.

Only the module of the subcommand being run is imported (with its own dependencies: Dagster for
``doctor``, the harness for ``chaos``), so ``sekali --help`` and ``sekali enqueue`` start fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

from cli.commands import CommandRefused
from resources.telemetry.redact import RedactingFilter

# name -> (module with ``register(subparsers) -> None``, one line of help)
COMMANDS: dict[str, tuple[str, str]] = {
    "db": ("cli.commands.db", "schema migrations of the app database"),
    "dev": ("cli.commands.dev", "run the platform on embedded defaults with the Dagster UI"),
    "bench": ("cli.commands.bench", "run benchmarks/ and print ratios (JSON and plots too)"),
    "demo": ("cli.commands.demo", "a two-minute before/after tour on embedded backends"),
    "enqueue": ("cli.commands.enqueue", "write a job request for the intake sensor"),
    "requests": ("cli.commands.requests", "job requests and what became of them"),
    "dlq": ("cli.commands.dlq", "inspect, replay and discard dead letters"),
    "rejections": ("cli.commands.rejections", "see the requests the intake refused"),
    "outbox": ("cli.commands.outbox", "dead outbox events: show, replay, discard"),
    "tenants": ("cli.commands.tenants", "fair share across tenants: weights, min, max"),
    "webhooks": ("cli.commands.webhooks", "webhook endpoints: signing secrets, plain http"),
    "doctor": ("cli.commands.doctor", "run the production diagnosis checklist"),
    "metrics": ("cli.commands.metrics", "show metrics or serve them to Prometheus"),
    "chaos": ("cli.commands.chaos", "break the platform on purpose and check the invariants"),
    "cluster": ("cli.commands.cluster", "sekali on several hosts: cluster up, down, status"),
    "ui-proxy": ("cli.commands.ui_proxy", "basic authentication in front of the Dagster UI"),
    "model": ("cli.commands.model", "check the SPIN model of the ledger protocol"),
}


class _Parser(argparse.ArgumentParser):
    """Bad usage is one line on stderr and exit 2 (``--help`` still prints the usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The parser; the subcommand named in ``argv`` is registered in full, the others by name and
    one line of help (enough for ``sekali --help``)."""
    parser = _Parser(
        prog="sekali", description="Jobs that stay right under at-least-once delivery."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    named = [a for a in (argv if argv is not None else sys.argv[1:]) if a in COMMANDS][:1]
    for name, (module, help_text) in COMMANDS.items():
        if name in named:
            importlib.import_module(module).register(sub)
            _name_subcommands(sub.choices[name])
        else:
            sub.add_parser(name, help=help_text)
    return parser


def _name_subcommands(parser: argparse.ArgumentParser) -> None:
    """A missing subcommand is named by its choices (``{list,show,cancel}``), not by the
    attribute it is stored under (``requests_command``)."""
    for action in parser._actions:  # argparse keeps its subparsers there
        if isinstance(action, argparse._SubParsersAction):
            if action.metavar is None:
                action.metavar = "{" + ",".join(action.choices) + "}"
            for child in action.choices.values():
                _name_subcommands(child)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for handler in logging.getLogger().handlers:  # no e-mail address reaches the terminal
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
    try:
        return int(args.func(args) or 0)
    except CommandRefused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
