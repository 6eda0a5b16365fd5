"""Statements run on the DBAPI driver directly, for the hot paths where SQLAlchemy's per-call cost
dominates (the idempotency ledger's claim and completion, run once or twice per job).

Measured on SQLite, one indexed read through ``Database.statement()`` costs about ten times the
same read on the ``sqlite3`` cursor of a pooled connection; on Postgres SQLAlchemy's per-call
work costs more than the round trip it wraps. So the few statements on the hot path are written
once with ``:name`` parameters (:class:`Sql`, translated once to the driver's own style) and run
on a pooled DBAPI connection:

- :func:`connect`: one connection in autocommit, so one statement is one round trip and one
  transaction. The pool's pre-ping (if the engine has one) is paid once per checkout: a batch
  holds one connection for all its statements.
- :func:`transaction`: several statements that commit together (``BEGIN IMMEDIATE`` on SQLite,
  so a reader never has to upgrade to a writer mid-transaction).
- :func:`within`: the DBAPI connection of a SQLAlchemy ``Connection``, so a statement joins the
  caller's transaction (the key completes in the business transaction).

Errors: a driver error that means "the server is not there" (or SQLite's lock wait ran out)
becomes :class:`StoreUnavailable`, as :class:`resources.storage.db.Database` does for
SQLAlchemy's; a lost connection is invalidated so the pool does not hand it out again.
Postgres deadlocks are retried by the callers that can (one autocommit statement, rolled back
whole): :func:`is_deadlock` says which errors those are.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from typing import Any

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection

from resources.errors import StoreUnavailable
from resources.storage.db import Database, looks_unavailable

_NAMED = re.compile(r"(?<![:\w]):(\w+)")


class Sql:
    """One statement written with ``:name`` parameters, as SQLAlchemy's ``text()`` takes them.

    ``sqlite3`` reads that style as it is; psycopg wants ``%(name)s``: translated here once, not
    per call. ``::type`` casts are left alone.
    """

    __slots__ = ("pyformat", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        self.pyformat = _NAMED.sub(r"%(\1)s", text.replace("%", "%%"))

    def for_driver(self, postgres: bool) -> str:
        return self.pyformat if postgres else self.text

    def __repr__(self) -> str:
        return f"Sql({self.text.split()[0]} ...)"


class DriverConnection:
    """A DBAPI connection and the dialect's way of writing parameters. Not thread-safe."""

    __slots__ = ("postgres", "raw")

    def __init__(self, raw: Any, postgres: bool) -> None:
        self.raw = raw
        self.postgres = postgres

    def rows(self, sql: Sql, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        cursor = self.raw.cursor()
        try:
            cursor.execute(sql.for_driver(self.postgres), params)
            return list(cursor.fetchall())
        finally:
            cursor.close()

    def row(self, sql: Sql, params: Mapping[str, Any]) -> tuple[Any, ...] | None:
        cursor = self.raw.cursor()
        try:
            cursor.execute(sql.for_driver(self.postgres), params)
            found = cursor.fetchone()
            return None if found is None else tuple(found)
        finally:
            cursor.close()

    def run(self, sql: Sql, params: Mapping[str, Any]) -> int:
        """Execute; returns the number of rows changed."""
        cursor = self.raw.cursor()
        try:
            cursor.execute(sql.for_driver(self.postgres), params)
            return int(cursor.rowcount)
        finally:
            cursor.close()


@contextlib.contextmanager
def connect(db: Database) -> Iterator[DriverConnection]:
    """A pooled connection in autocommit: each statement commits on its own."""
    with _checkout(db) as (fairy, conn):
        if conn.postgres:
            fairy.driver_connection.autocommit = True
            try:
                yield conn
            finally:
                _leave_autocommit(fairy)
        else:
            yield conn  # sekali's SQLite connections are in autocommit (isolation_level None)


@contextlib.contextmanager
def transaction(db: Database) -> Iterator[DriverConnection]:
    """Several statements that commit together, or not at all."""
    with _checkout(db) as (fairy, conn):
        raw = fairy.driver_connection
        if not conn.postgres:
            raw.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            with contextlib.suppress(Exception):
                if conn.postgres:
                    raw.rollback()
                else:
                    raw.execute("ROLLBACK")
            raise
        if conn.postgres:
            raw.commit()
        else:
            raw.execute("COMMIT")


def within(conn: Connection) -> DriverConnection:
    """The DBAPI connection under a SQLAlchemy ``Connection``, in the caller's transaction."""
    return DriverConnection(conn.connection.driver_connection, conn.dialect.name == "postgresql")


def is_deadlock(exc: BaseException) -> bool:
    """A Postgres deadlock or serialization failure: the statement was rolled back whole."""
    return getattr(exc, "sqlstate", None) in ("40P01", "40001")


@contextlib.contextmanager
def _checkout(db: Database) -> Iterator[tuple[Any, DriverConnection]]:
    try:
        fairy = db.engine.raw_connection()
    except sa_exc.DBAPIError as exc:
        if looks_unavailable(str(exc.orig)) or exc.connection_invalidated:
            raise StoreUnavailable(f"database unavailable: {exc.orig}") from exc
        raise
    except db.engine.dialect.loaded_dbapi.Error as exc:
        raise StoreUnavailable(f"database unavailable: {exc}") from exc
    conn = DriverConnection(fairy.driver_connection, db.is_postgres)
    try:
        yield fairy, conn
    except db.engine.dialect.loaded_dbapi.Error as exc:
        if db.engine.dialect.is_disconnect(exc, fairy.dbapi_connection, None):
            fairy.invalidate(exc)
            raise StoreUnavailable(f"database unavailable: {exc}") from exc
        if looks_unavailable(str(exc)):
            raise StoreUnavailable(f"database unavailable: {exc}") from exc
        raise
    finally:
        fairy.close()


def _leave_autocommit(fairy: Any) -> None:
    """Give the connection back as the pool's other users expect it (not autocommit)."""
    if fairy.is_valid:
        try:
            fairy.driver_connection.autocommit = False
        except Exception:  # noqa: BLE001 - a broken connection: drop it from the pool
            fairy.invalidate()


__all__ = ["DriverConnection", "Sql", "connect", "is_deadlock", "transaction", "within"]
