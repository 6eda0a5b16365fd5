"""What differs between the app database's two dialects, one class each behind one interface.

Stores ask :attr:`Database.sql_dialect <resources.storage.db.Database.sql_dialect>` instead of
branching on the backend, as DBOS keeps one system-database class per dialect behind abstract
hooks. Statements that differ live in the named-query files (a ``NAME.postgresql.sql`` or
``NAME.sqlite.sql`` block beside ``NAME.sql`` wins for its dialect,
:func:`resources.storage.queries.load_dialect_queries`); what differs in behaviour is a hook
here:

- **row locks** are text, so they live in the query files: Postgres locks the rows a
  transaction reads to change (``FOR UPDATE``, with ``SKIP LOCKED`` where claimers must not
  wait for each other); SQLite opens every transaction with ``BEGIN IMMEDIATE``, which already
  excludes every other writer, so its statements add nothing.
- **writers**: on SQLite a second connection that writes while a transaction is open waits for
  it (one writer at a time); on Postgres it does not, so a record that must outlive the
  caller's rollback takes a connection of its own.
- **advisory locks**: Postgres serialises claimers of a shared resource with a transaction-scoped
  advisory lock; SQLite's one writer at a time already does.
- **replicas**: only Postgres has standbys a failover can promote.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

from sqlalchemy import text
from sqlalchemy.engine import Connection

from resources.storage.queries import DIALECTS, identifier, load_queries

_Q = load_queries(Path(__file__).with_suffix(".sql"))


class Dialect(ABC):
    """The hooks a dialect implements (see the module)."""

    name: ClassVar[str]
    writers_wait: ClassVar[bool]
    """Whether a second writing connection waits for an open write transaction."""
    has_replicas: ClassVar[bool]
    """Whether a standby can be promoted (and roll back what the primary acknowledged)."""

    @abstractmethod
    def along_key(self, column: str) -> str:
        """``column`` as a condition the database checks row by row while it reads along the
        primary key, instead of through an index on ``column`` (which would read every match,
        then sort by key): the first few rows of a status most rows have, cheaply."""

    @abstractmethod
    def advisory_lock(self, conn: Connection, key: int, *, shared: bool = False) -> None:
        """Hold the transaction-scoped lock ``key`` in ``conn``'s transaction (exclusive, or
        ``shared`` with other shared holders) until it ends."""

    @abstractmethod
    def release_session_locks(self, conn: Connection) -> None:
        """Drop the session-level locks ``conn`` holds, before it goes back to the pool."""

    @abstractmethod
    def write_boundary(self, conn: Connection) -> tuple[str, list[str]]:
        """How this database keeps concurrent writers apart, in one line for the doctor, and
        what in ``conn``'s database weakens it (empty when nothing)."""

    @abstractmethod
    def refresh_statistics(self, db: Any, *tables: str) -> None:
        """What a bulk load leaves the planner to know of ``tables``, refreshed now rather than
        when the database gets to it (an autovacuum's ANALYZE)."""

    @contextlib.contextmanager
    def shared_section(self, db: Any, key: int) -> Iterator[Connection]:
        """A connection to write in while the lock ``key`` is held shared: a transaction with
        the advisory lock where writers run side by side; one statement at a time where a
        writer already excludes the rest (no transaction needed to be serialised)."""
        if self.writers_wait:
            with db.statement() as conn:
                yield conn
            return
        with db.transaction() as conn:
            self.advisory_lock(conn, key, shared=True)
            yield conn


class SqliteDialect(Dialect):
    """SQLite: ``BEGIN IMMEDIATE`` transactions, one writer at a time, no replicas."""

    name = "sqlite"
    writers_wait = True
    has_replicas = False

    def along_key(self, column: str) -> str:
        return f"+{column}"  # unary plus: SQLite then uses no index on the column

    def advisory_lock(self, conn: Connection, key: int, *, shared: bool = False) -> None:
        """Nothing to take: the transaction's ``BEGIN IMMEDIATE`` excludes every other writer."""

    def refresh_statistics(self, db: Any, *tables: str) -> None:
        """Nothing: SQLite's planner keeps no statistics unless asked, nor refreshes them."""

    def release_session_locks(self, conn: Connection) -> None:
        """Nothing: SQLite has no session-level locks."""

    def write_boundary(self, conn: Connection) -> tuple[str, list[str]]:
        mode = conn.exec_driver_sql("PRAGMA journal_mode").scalar()
        boundary = f"SQLite journal_mode={mode}, transactions opened with BEGIN IMMEDIATE"
        if str(mode).lower() != "wal":
            return boundary, ["SQLite not in WAL mode (readers block the writer)"]
        return boundary, []


class PostgresDialect(Dialect):
    """Postgres: row locks, ``SKIP LOCKED`` claims, advisory locks, standbys."""

    name = "postgresql"
    writers_wait = False
    has_replicas = True

    def along_key(self, column: str) -> str:
        return column  # the planner reads along the key when that is cheaper

    def advisory_lock(self, conn: Connection, key: int, *, shared: bool = False) -> None:
        name = "advisory_lock_shared" if shared else "advisory_lock"
        conn.execute(text(_Q[name]), {"key": key})

    def release_session_locks(self, conn: Connection) -> None:
        conn.execute(text(_Q["unlock_all_advisory"]))

    def write_boundary(self, conn: Connection) -> tuple[str, list[str]]:
        return "Postgres: conditional single statements and FOR UPDATE row locks", []

    def refresh_statistics(self, db: Any, *tables: str) -> None:
        with db.statement() as conn:
            for table in tables:
                conn.execute(text(_Q["analyze"].format(table=identifier(table))))


_BY_NAME: dict[str, Dialect] = {d.name: d for d in (SqliteDialect(), PostgresDialect())}
assert set(_BY_NAME) == set(DIALECTS), "a dialect class per name of DIALECTS"


def dialect_named(name: str) -> Dialect:
    """The dialect SQLAlchemy calls ``name``; a ValueError naming the ones sekali runs on."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"database dialect {name!r}: sekali runs on {', '.join(DIALECTS)}"
                         ) from None
