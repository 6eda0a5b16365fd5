"""Apply the ordered DDL files in ``sql/``: the only truth of the schema.

Files are named ``NNNN_name.sql`` and applied in order; where a dialect needs its own text, a
``NNNN_name.postgresql.sql`` or ``NNNN_name.sqlite.sql`` beside it wins for that dialect. Each
applied file is recorded in ``sekali_schema_migrations`` with a checksum, so applying twice is a
no-op, and an edited file that was already applied is reported instead of silently skipped.
The DDL itself is written to be idempotent too (``IF NOT EXISTS``), so a half-recorded run heals.

Several processes may upgrade at once: on Postgres a transaction-scoped advisory lock serialises
them (pooler-safe); on SQLite ``BEGIN IMMEDIATE`` does.
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass
from importlib import resources as importlib_resources
from pathlib import Path

from sqlalchemy import text

from resources.db import Database
from resources.errors import SekaliError

_MIGRATION_LOCK_ID = 0x5E4A11  # arbitrary, constant
_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+?)(?:\.(postgresql|sqlite))?\.sql$")


@dataclass(frozen=True)
class Migration:
    name: str  # e.g. "0010_idempotency"
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()[:16]


class MigrationDrift(SekaliError, RuntimeError):
    """A migration already applied has a different checksum from the file on disk.

    Permanent: restore the file as it was applied and put the change in a new ``NNNN_`` file.
    """

    permanent = True


def sql_dir() -> Path:
    return Path(str(importlib_resources.files("sql")))


def load_migrations(dialect: str, directory: Path | None = None) -> list[Migration]:
    directory = directory or sql_dir()
    chosen: dict[str, Path] = {}
    for path in sorted(directory.glob("*.sql")):
        match = _NAME.match(path.name)
        if not match:
            raise ValueError(f"sql/{path.name}: expected NNNN_name[.dialect].sql")
        number, name, file_dialect = match.groups()
        key = f"{number}_{name}"
        if file_dialect is None:
            chosen.setdefault(key, path)
        elif file_dialect == dialect:
            chosen[key] = path
    return [Migration(k, chosen[k].read_text()) for k in sorted(chosen)]


def split_statements(sql: str) -> list[str]:
    """Split on ``;`` at the end of a line; comments are dropped. DDL files keep to that form."""
    lines = [ln for ln in sql.splitlines() if not ln.strip().startswith("--")]
    parts = re.split(r";\s*$", "\n".join(lines), flags=re.MULTILINE)
    return [p.strip() for p in parts if p.strip()]


def upgrade(db: Database, directory: Path | None = None) -> list[str]:
    """Apply every migration not yet recorded. Returns the names applied now (empty if none)."""
    applied_now: list[str] = []
    migrations = load_migrations(db.dialect, directory)
    with db.transaction() as conn:
        if db.is_postgres:
            conn.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": _MIGRATION_LOCK_ID})
        conn.execute(
            text(
                "CREATE TABLE IF NOT EXISTS sekali_schema_migrations ("
                " name TEXT PRIMARY KEY, checksum TEXT NOT NULL,"
                " applied_at DOUBLE PRECISION NOT NULL)"
            )
        )
        done = {
            row.name: row.checksum
            for row in conn.execute(text("SELECT name, checksum FROM sekali_schema_migrations"))
        }
        for migration in migrations:
            if migration.name in done:
                if done[migration.name] != migration.checksum:
                    raise MigrationDrift(
                        f"sql/{migration.name} changed after it was applied "
                        f"({done[migration.name]} -> {migration.checksum}); add a new file instead"
                    )
                continue
            for statement in split_statements(migration.sql):
                conn.exec_driver_sql(statement)
            conn.execute(
                text(
                    "INSERT INTO sekali_schema_migrations (name, checksum, applied_at)"
                    " VALUES (:n, :c, :t)"
                ),
                {"n": migration.name, "c": migration.checksum, "t": time.time()},
            )
            applied_now.append(migration.name)
    return applied_now


def applied(db: Database) -> list[str]:
    with db.statement() as conn:
        return [
            r.name
            for r in conn.execute(text("SELECT name FROM sekali_schema_migrations ORDER BY name"))
        ]
