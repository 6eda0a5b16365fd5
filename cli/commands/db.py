"""``sekali db upgrade | status | contract``: apply the ``sql/`` files, show what is applied and
pending, and close a rolling upgrade (docs/upgrades.md)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

from cli.commands import CommandRefused
from cli.commands.arguments import created_database
from cli.commands.output import add_output_arguments, console, emit, when
from engine.attempts import ROLLUPS_MIGRATION, AttemptRecorder
from resources.errors import SekaliError
from resources.storage.db import Database
from resources.storage.migrations import contract, plan, status, upgrade
from resources.storage.settings import Settings


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    db = sub.add_parser("db", help="schema migrations of the app database")
    db_sub = db.add_subparsers(dest="db_command", required=True)
    up = db_sub.add_parser(
        "upgrade", help="apply the sql/ files not yet applied (idempotent; online on Postgres)"
    )
    up.add_argument("--url", help="SQLAlchemy URL (default: DATABASE_URL or the embedded SQLite)")
    up.add_argument("--dry-run", action="store_true",
                    help="print each pending statement and the locks it takes; apply nothing")
    add_output_arguments(up)
    up.set_defaults(func=_upgrade)
    st = db_sub.add_parser("status", help="list applied and pending migrations")
    st.add_argument("--url")
    add_output_arguments(st)
    st.set_defaults(func=_status)
    ct = db_sub.add_parser(
        "contract",
        help="after a rolling upgrade, once no older process runs: let this release write "
        "what older releases cannot read",
    )
    ct.add_argument("--url")
    ct.set_defaults(func=_contract)


@contextlib.contextmanager
def _opened(url: str | None) -> Iterator[Database]:
    db = Database.from_url(url or Settings.from_env().database_url)
    try:
        yield db
    finally:
        db.dispose()


def _reported(command: Callable[[argparse.Namespace], int]
              ) -> Callable[[argparse.Namespace], int]:
    """A failed migration, check or refusal is one line on stderr and exit 1."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except CommandRefused:
            raise  # one line and exit 2, from main
        except SekaliError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1

    return run


@_reported
def _upgrade(args: argparse.Namespace) -> int:
    with _opened(args.url) as db:
        if args.dry_run:
            return _dry_run(args, db)
        done = upgrade(db, progress=lambda line: print(line, file=sys.stderr, flush=True))
        rebuilt = AttemptRecorder(db).rebuild_rollups() if ROLLUPS_MIGRATION in done else None

    def human() -> None:
        print(f"applied {len(done)} migration(s): {', '.join(done)}" if done
              else "schema up to date")
        if rebuilt is not None:
            print(f"aggregated {rebuilt} existing attempt(s) for the metrics")

    return emit(args, {"applied": done, "rollups_rebuilt": rebuilt}, human)


def _dry_run(args: argparse.Namespace, db: Database) -> int:
    plans = plan(db)
    data = [
        {"name": p.name, "how": p.how,
         "statements": [{"sql": s.sql, "locks": s.locks, "batch": s.batch}
                        for s in p.statements]}
        for p in plans
    ]

    def human() -> None:
        out = console()
        if not plans:
            out.print("schema up to date: nothing to apply")
        for p in plans:
            out.print(f"{p.name} ({p.how})")
            for s in p.statements:
                for line in s.sql.splitlines():
                    out.print(f"    {line}")
                locks = "; ".join(s.locks) or "no table lock"
                out.print(f"  -> {locks}" + (f"; {s.batch}" if s.batch else ""))
        out.print(f"{len(plans)} migration(s) would be applied ({db.dialect}); nothing was")

    return emit(args, {"dialect": db.dialect, "pending": data}, human)


@_reported
def _status(args: argparse.Namespace) -> int:
    with _opened(args.url) as db:
        found = status(db)
    data: dict[str, Any] = found.to_dict()
    for row in data["applied"]:
        row["applied_at"] = when(row["applied_at"])

    def human() -> None:
        out = console()
        out.print(f"database: {found.dialect}; this release knows up to {found.newest_known}")
        out.print(f"applied ({len(found.applied)}):")
        for row in data["applied"]:
            note = f"  replaced by {row['replaced_by']}" if row["replaced_by"] else ""
            out.print(f"  {row['name']}  {row['applied_at']}{note}")
        out.print(f"pending ({len(found.pending)}):" + ("" if found.pending else " none"))
        for row in found.pending:
            note = f"  (not run: {row['replaced_by']} does its work)" if row["replaced_by"] else ""
            out.print(f"  {row['name']}{note}")
        if found.unknown:
            out.print(f"applied by a newer release: {', '.join(found.unknown)}")
        if found.drift:
            out.print(f"changed after they were applied: {', '.join(found.drift)}")
        if found.readers_know is None:
            out.print("every process knows: (not recorded: no upgrade by this release yet)")
        elif found.readers_know < found.newest_known:
            out.print(f"every process knows: {found.readers_know}; run `sekali db contract` "
                      "once no older process runs")
        else:
            out.print(f"every process knows: {found.readers_know}")

    code = emit(args, data, human)
    return code or (1 if found.drift else 0)


@_reported
def _contract(args: argparse.Namespace) -> int:
    created_database(args.url or Settings.from_env().database_url)  # else: exit 2, one line
    with _opened(args.url) as db:
        newest = contract(db)
    print(f"every process is now taken to know {newest}: values older releases cannot read "
          "may be written")
    return 0
