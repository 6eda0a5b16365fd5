"""``sekali db upgrade | status``: apply the ``sql/`` files and show what is applied."""

from __future__ import annotations

import argparse

from engine.attempts import ROLLUPS_MIGRATION, AttemptRecorder
from resources.storage.db import Database
from resources.storage.migrations import applied, upgrade
from resources.storage.settings import Settings


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    db = sub.add_parser("db", help="schema migrations of the app database")
    db_sub = db.add_subparsers(dest="db_command", required=True)
    up = db_sub.add_parser("upgrade", help="apply sql/ files not yet applied (idempotent)")
    up.add_argument("--url", help="SQLAlchemy URL (default: DATABASE_URL or the embedded SQLite)")
    up.set_defaults(func=_upgrade)
    st = db_sub.add_parser("status", help="list applied migrations")
    st.add_argument("--url")
    st.set_defaults(func=_status)


def _database(url: str | None) -> Database:
    return Database.from_url(url or Settings.from_env().database_url)


def _upgrade(args: argparse.Namespace) -> int:
    db = _database(args.url)
    done = upgrade(db)
    print(f"applied {len(done)} migration(s): {', '.join(done)}" if done else "schema up to date")
    if ROLLUPS_MIGRATION in done:
        n = AttemptRecorder(db).rebuild_rollups()
        print(f"aggregated {n} existing attempt(s) for the metrics")
    return 0


def _status(args: argparse.Namespace) -> int:
    for name in applied(_database(args.url)):
        print(name)
    return 0
