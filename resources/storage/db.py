"""One way to reach the app database, on SQLite (embedded) and Postgres (production).

Why a wrapper at all: the two backends need different care for the same guarantees.

- SQLite: WAL, a busy timeout, and every transaction opened with ``BEGIN IMMEDIATE`` so two
  writers never deadlock on a read-to-write upgrade (which SQLite reports at once as "database is
  locked", skipping the busy timeout).
- Postgres: single-statement operations run in autocommit, so a conditional upsert costs one round
  trip instead of three (BEGIN, statement, COMMIT).

``Database.transaction()`` is for several statements that must commit together;
``Database.statement()`` is for one statement that is atomic on its own. Driver errors that mean
"the server is not there" become :class:`StoreUnavailable` here and nowhere else.
"""

from __future__ import annotations

import contextlib
import random
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import MetaData, create_engine, event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine, make_url

from resources.errors import StoreUnavailable

metadata = MetaData()
"""Every table the code expects, declared beside the module that uses it. ``sql/`` creates them;
a test checks that what ``sql/`` creates matches this."""


def normalize_url(url: str) -> str:
    """Spell the driver out: a bare ``postgresql://`` means psycopg 3 on SQLAlchemy 2.1 only."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    return url


def make_engine(
    url: str, *, pool_size: int = 5, max_overflow: int = 20, echo: bool = False
) -> Engine:
    """Create an engine with the per-backend settings sekali relies on. Opens no connection."""
    url = normalize_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database or ""
        if database and database != ":memory:":
            Path(database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            url,
            echo=echo,
            pool_size=pool_size,
            max_overflow=max_overflow,
            connect_args={"timeout": 60, "check_same_thread": False},
        )
        _configure_sqlite(engine)
        return engine
    if parsed.get_backend_name() != "postgresql":
        raise ValueError(f"DATABASE_URL: unsupported backend {parsed.get_backend_name()!r}")
    return create_engine(
        url, echo=echo, pool_size=pool_size, max_overflow=max_overflow, pool_pre_ping=True
    )


def _configure_sqlite(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # we issue BEGIN ourselves
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA busy_timeout=60000")
        _enable_wal(cursor)
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")


def _enable_wal(cursor: Any, attempts: int = 100) -> None:
    """Switch a fresh file to WAL. The switch needs an exclusive lock and SQLite answers "database
    is locked" at once, without the busy handler, while another process opens or switches the
    same fresh file; so wait and try again."""
    for attempt in range(attempts):
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or attempt == attempts - 1:
                raise
            time.sleep(0.05 + random.random() * 0.1)


_UNAVAILABLE = (sa_exc.OperationalError, sa_exc.InterfaceError)


class Database:
    """An engine plus the two ways sekali talks to it. Cheap to share across threads."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.dialect: str = engine.dialect.name
        self._autocommit = (
            engine.execution_options(isolation_level="AUTOCOMMIT")
            if self.dialect == "postgresql"
            else engine
        )

    @classmethod
    def from_url(cls, url: str, *, pool_size: int = 5, max_overflow: int = 20) -> Database:
        return cls(make_engine(url, pool_size=pool_size, max_overflow=max_overflow))

    @property
    def is_postgres(self) -> bool:
        return self.dialect == "postgresql"

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Connection]:
        """Several statements that commit together (``BEGIN IMMEDIATE`` on SQLite)."""
        with _wrap_driver_errors(), self.engine.begin() as conn:
            yield conn

    @contextlib.contextmanager
    def statement(self) -> Iterator[Connection]:
        """One statement, atomic on its own: autocommit on Postgres (one round trip)."""
        with _wrap_driver_errors(), self._autocommit.begin() as conn:
            yield conn

    def dispose(self) -> None:
        self.engine.dispose()


@contextlib.contextmanager
def _wrap_driver_errors() -> Iterator[None]:
    try:
        yield
    except sa_exc.DBAPIError as exc:
        if isinstance(exc, _UNAVAILABLE) and _looks_unavailable(exc):
            raise StoreUnavailable(f"database unavailable: {exc.orig}") from exc
        raise


def _looks_unavailable(exc: sa_exc.DBAPIError) -> bool:
    return exc.connection_invalidated or looks_unavailable(str(exc.orig))


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


_shared: dict[str, Database] = {}
_shared_lock = threading.Lock()


def shared_database(url: str) -> Database:
    """One ``Database`` per URL per process, so resources set up per step share one pool."""
    url = normalize_url(url)
    with _shared_lock:
        db = _shared.get(url)
        if db is None:
            db = _shared[url] = Database.from_url(url)
        return db
