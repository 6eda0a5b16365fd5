"""Argument types shared by the subcommands: every id and count the CLI takes is bounded before it
reaches a database (a 20-digit id is an OverflowError on SQLite, not an answer), and an age or a
pace is parsed where argparse can name the flag (exit 2, one line); and what several subcommands
derive from their arguments (the app database, the actor they record)."""

from __future__ import annotations

import argparse
import getpass
import re
import sys
from pathlib import Path

from sqlalchemy.engine import make_url

from cli.commands import CommandRefused
from engine.replay import parse_pace
from engine.validation import INT64_MAX
from resources.dlq import parse_age
from resources.errors import ValidationError
from resources.storage.db import Database, shared_database
from resources.storage.migrations import (
    NoSchema,
    SchemaBehind,
    SchemaTooNew,
    applied,
    ensure_schema,
)
from resources.storage.settings import Settings, normalize_url
from resources.telemetry.redact import hide_url_password

_DIGITS = re.compile(r"^[0-9]{1,19}$")


def _whole(text: str, what: str) -> int:
    if not _DIGITS.match(text) or not 1 <= int(text) <= INT64_MAX:
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise argparse.ArgumentTypeError(
            f"{shown!r} is not {what} (a whole number from 1 to {INT64_MAX})"
        )
    return int(text)


def record_id(text: str) -> int:
    """argparse ``type=`` of a row id: a whole number from 1 to 2**63 - 1 (BIGINT's range);
    anything else is bad usage (exit 2, one line)."""
    return _whole(text, "a record id")


def id_list(text: str) -> list[int]:
    """argparse ``type=`` of ``ID[,ID...]``: record ids separated by commas."""
    return [record_id(part) for part in text.split(",") if part.strip()] or [record_id(text)]


def count(text: str) -> int:
    """argparse ``type=`` of a ``--limit``: a whole number from 1 to 2**63 - 1."""
    return _whole(text, "a count")


_BARE_NUMBER = re.compile(r"^\s*[0-9.]+\s*$")


def age(text: str) -> float:
    """argparse ``type=`` of ``--older-than``/``--newer-than``: ``90s``, ``15m``, ``2h``,
    ``3d``, ``1w`` -> seconds. A bare number is refused: ``5`` could mean 5 s or 5 days."""
    if _BARE_NUMBER.match(text):
        raise argparse.ArgumentTypeError(
            f"{text.strip()!r} has no unit: say 90s, 15m, 2h, 3d or 1w"
        )
    try:
        seconds = parse_age(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    assert seconds is not None  # a str is never None
    return seconds


def pace(text: str) -> float:
    """argparse ``type=`` of ``--pace``: ``10/s``, ``600/min``, ``5`` -> requests per second."""
    try:
        rate = parse_pace(text)
    except ValidationError as exc:
        raise argparse.ArgumentTypeError(exc.problem) from None
    if rate is None:
        raise argparse.ArgumentTypeError("expected a rate like 10/s, 600/min or 5")
    return rate


def warn_secret_option(flag: str, value: str | None, variable: str) -> None:
    """One line on stderr when an option's value holds a password (a URL's user part): argv is
    readable by every local user (``/proc/<pid>/cmdline``) and kept in shell history."""
    if value and hide_url_password(value) != value:
        print(f"warning: {flag} carries a password, visible to every user of this machine in "
              f"the process list and kept in your shell history; set {variable} instead",
              file=sys.stderr)


def app_database(args: argparse.Namespace) -> Database:
    """The app database of ``--url`` (warning when it holds a password), else
    ``DATABASE_URL`` (:func:`existing_database`)."""
    warn_secret_option("--url", args.url, "DATABASE_URL")
    return existing_database(args.url or Settings.from_env().database_url)


def existing_database(url: str) -> Database:
    """The app database at ``url`` once it holds sekali's schema (:func:`created_database`),
    and one this release can use (:func:`~resources.storage.migrations.ensure_schema`, as at
    any process's first use): a schema it cannot use yet is refused naming the fix (``sekali db
    upgrade``)."""
    db, _ = created_database(url)
    try:
        ensure_schema(db)
    except (SchemaBehind, SchemaTooNew) as exc:
        raise CommandRefused(str(exc)) from None
    return db


def created_database(url: str) -> tuple[Database, str]:
    """The app database at ``url`` and where it is, for a person; a database never created (a
    fresh state folder) is :class:`CommandRefused` naming the command that creates it, and
    nothing is created on the way (not even the SQLite file)."""
    url = normalize_url(url)
    parsed = make_url(url)
    sqlite_file = parsed.database if parsed.get_backend_name() == "sqlite" else None
    where = sqlite_file or hide_url_password(url)
    if sqlite_file and sqlite_file != ":memory:" and not Path(sqlite_file).exists():
        raise CommandRefused(str(NoSchema(where)))
    db = shared_database(url)
    if not applied(db):
        raise CommandRefused(str(NoSchema(where)))
    return db, where


def actor(args: argparse.Namespace | None = None) -> str:
    """Who acts, for the audit: ``--actor`` when the subcommand has it, else ``cli:USER``
    (``cli`` where the user has no name, as in some containers)."""
    given = getattr(args, "actor", None)
    if given:
        return str(given)
    try:
        return f"cli:{getpass.getuser()}"
    except Exception:  # noqa: BLE001 - no user name in some containers
        return "cli"
