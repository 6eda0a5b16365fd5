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

Errors: this module is the one place driver errors become sekali's, for the statements run here
and for :class:`resources.storage.db.Database` (:func:`errors_as_ours`). An error about the store
rather than the statement becomes a :class:`StoreUnavailable` (transient) that says what to do:
the server is not there or SQLite's lock wait ran out (a lost connection is invalidated so the
pool does not hand it out again); the disk is full (:class:`StoreFull`: SQLite "database or disk
is full", Postgres ``53100``); the database takes no writes (:class:`StoreReadOnly`: a read-only
transaction or standby, ``25006``; a read-only SQLite file); an I/O error (SQLite "disk I/O
error", Postgres ``58030``). An error about the statement (bad data, a wrong schema) stays the
driver's, for :func:`resources.retry.classify`. Postgres deadlocks are retried by the callers
that can (one autocommit statement, rolled back whole): :func:`is_deadlock` says which errors
those are.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine

from resources.errors import StoreFull, StoreReadOnly, StoreUnavailable


class Database(Protocol):
    """What this module needs of :class:`resources.storage.db.Database` (which imports this
    module: the one place its driver errors become sekali's)."""

    engine: Engine

    @property
    def is_postgres(self) -> bool: ...

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
        ours = store_error(exc)
        if ours is not None:
            raise ours from exc
        raise
    except db.engine.dialect.loaded_dbapi.Error as exc:
        raise store_error(exc) or StoreUnavailable(f"database unavailable: {exc}") from exc
    conn = DriverConnection(fairy.driver_connection, db.is_postgres)
    try:
        yield fairy, conn
    except db.engine.dialect.loaded_dbapi.Error as exc:
        if db.engine.dialect.is_disconnect(exc, fairy.dbapi_connection, None):
            fairy.invalidate(exc)
            raise StoreUnavailable(f"database unavailable: {exc}") from exc
        if looks_unavailable(str(exc)):
            raise StoreUnavailable(f"database unavailable: {exc}") from exc
        ours = store_error(exc)
        if ours is not None:
            raise ours from exc
        raise
    finally:
        fairy.close()


@contextlib.contextmanager
def errors_as_ours() -> Iterator[None]:
    """:func:`store_error` for SQLAlchemy's calls (:class:`resources.storage.db.Database`):
    the server not there, the pool exhausted, a full disk, a read-only store or an I/O error
    become a :class:`StoreUnavailable`; any other error is re-raised as it is."""
    try:
        yield
    except sa_exc.DBAPIError as exc:
        if isinstance(exc, _UNAVAILABLE) and (
            exc.connection_invalidated or looks_unavailable(str(exc.orig))
        ):
            raise StoreUnavailable(f"database unavailable: {exc.orig}; retry later") from exc
        ours = store_error(exc)
        if ours is not None:
            raise ours from exc
        raise
    except (sa_exc.DisconnectionError, sa_exc.TimeoutError) as exc:
        # a pooled connection that did not answer its ping, or no free connection in the pool
        raise StoreUnavailable(f"database unavailable: {exc}; retry later") from exc


_UNAVAILABLE = (sa_exc.OperationalError, sa_exc.InterfaceError)


def looks_unavailable(message: str) -> bool:
    """Does a driver's error message mean "the server is not there (now)"?"""
    text = message.lower()
    return any(
        needle in text
        for needle in (
            "connection refused",
            "could not connect",
            "server closed the connection",
            "terminating connection",
            "connection is closed",
            "the database system is",
            "database is locked",
            "timeout",
            "connection failed",
            "consuming input failed",
        )
    )


# SQLSTATE -> (the error to raise, what happened, what to do)
_POSTGRES_STORE_STATES: dict[str, tuple[type[StoreUnavailable], str, str]] = {
    "53100": (StoreFull, "the database server's disk is full (disk_full)",
              "nothing was written; free disk space on the server, then the retries succeed"),
    "25006": (StoreReadOnly, "the database accepts no writes (read_only_sql_transaction: a hot "
              "standby, or default_transaction_read_only)",
              "nothing was written; point DATABASE_URL at the primary, or wait for the failover"),
    "58030": (StoreUnavailable, "the database server could not read or write its files "
              "(io_error)", "check the server's disk; retry later"),
    "53300": (StoreUnavailable, "the database server has no free connection slot "
              "(too_many_connections)", "retry later; lower the pools or raise max_connections"),
    "57P03": (StoreUnavailable, "the database server is starting up or shutting down "
              "(cannot_connect_now)", "retry later"),
}
_SQLITE_STORE_CODES: dict[int, tuple[type[StoreUnavailable], str, str]] = {
    sqlite3.SQLITE_FULL: (StoreFull, "the SQLite file could not grow (database or disk is full: "
                          "a full disk, or a file size limit)",
                          "nothing was written; free disk space, then the retries succeed"),
    sqlite3.SQLITE_IOERR: (StoreUnavailable, "the SQLite file could not be read or written (disk "
                           "I/O error: a failing or full disk, or a file size limit)",
                           "check the disk and free space; retry later"),
    sqlite3.SQLITE_READONLY: (StoreReadOnly, "the SQLite file is read-only for this process",
                              "make the file and its folder writable by the workers"),
}


def store_error(exc: BaseException) -> StoreUnavailable | None:
    """The :class:`StoreUnavailable` a driver error (raw, or wrapped by SQLAlchemy) means when
    it is about the store itself (full, read-only, an I/O error), or None: then it is about the
    statement, or about the connection (which the callers above map)."""
    orig = exc.orig if isinstance(exc, sa_exc.DBAPIError) else exc
    sqlstate = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    known = _POSTGRES_STORE_STATES.get(sqlstate) if isinstance(sqlstate, str) else None
    code = getattr(orig, "sqlite_errorcode", None)
    if known is None and isinstance(orig, sqlite3.Error) and isinstance(code, int):
        known = _SQLITE_STORE_CODES.get(code & 0xFF)
    if known is None:
        return None
    error, what, fix = known
    return error(f"{what}: {fix} ({type(orig).__name__}: {str(orig).strip()[:300]})")


def _leave_autocommit(fairy: Any) -> None:
    """Give the connection back as the pool's other users expect it (not autocommit)."""
    if fairy.is_valid:
        try:
            fairy.driver_connection.autocommit = False
        except Exception:  # noqa: BLE001 - a broken connection: drop it from the pool
            fairy.invalidate()


__all__ = [
    "DriverConnection",
    "Sql",
    "connect",
    "errors_as_ours",
    "is_deadlock",
    "looks_unavailable",
    "store_error",
    "transaction",
    "within",
]
