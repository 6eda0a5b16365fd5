"""Real driver errors on SQLite and Postgres and the class ``classify`` gives them.

Bad data and a wrong schema are permanent on both dialects (a retry sends the same bytes to the
same schema); only connection-level failures (refused, terminated, timed out, locked) are
transient. Each row provokes the error for real on its database and asserts the class, so a
driver or SQLAlchemy upgrade that changes an exception type shows up here.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine

from resources.retry import ErrorClass, classify
from sandbox.redis_server import free_port
from tests.conftest import PG_URL, drop_postgres_schema, postgres_schema_url

Provoke = Callable[[Engine, Path], None]

P, T = ErrorClass.PERMANENT, ErrorClass.TRANSIENT
_TABLE = "CREATE TABLE t (k TEXT PRIMARY KEY, v VARCHAR(3), n INTEGER NOT NULL DEFAULT 0)"


def _run(engine: Engine, *statements: str, params: dict[str, object] | None = None) -> None:
    with engine.connect() as conn:
        for sql in statements[:-1]:
            conn.execute(text(sql))
        conn.execute(text(statements[-1]), params or {})


def _sqlite_too_big(engine: Engine, _tmp: Path) -> None:
    with engine.connect() as conn:
        conn.connection.dbapi_connection.setlimit(  # type: ignore[union-attr]
            sqlite3.SQLITE_LIMIT_LENGTH, 100
        )
        conn.execute(text("INSERT INTO t (k) VALUES (:k)"), {"k": "x" * 500})


def _sqlite_locked(engine: Engine, tmp: Path) -> None:
    """A second writer that may not wait, while the first holds the write lock."""
    url = str(engine.url)
    holder = create_engine(url, connect_args={"isolation_level": None})
    waiter = create_engine(url, connect_args={"timeout": 0, "isolation_level": None})
    with holder.connect() as first:
        first.exec_driver_sql("BEGIN IMMEDIATE")
        try:
            with waiter.connect() as second:
                second.exec_driver_sql("BEGIN IMMEDIATE")
        finally:
            first.exec_driver_sql("ROLLBACK")
            holder.dispose()
            waiter.dispose()


def _sqlite_cannot_open(_engine: Engine, tmp: Path) -> None:
    _run(create_engine(f"sqlite:///{tmp / 'missing-dir' / 'x' / 'app.db'}"), "SELECT 1")


def _pg_lock_timeout(engine: Engine, _tmp: Path) -> None:
    """A row lock held by one connection; the other's ``lock_timeout`` runs out (55P03)."""
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO t (k) VALUES ('locked')"))
    held = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with engine.connect() as conn:
            conn.execute(text("SELECT * FROM t WHERE k = 'locked' FOR UPDATE"))
            held.set()
            release.wait(10)
            conn.rollback()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        _run(
            engine,
            "SET lock_timeout = '50ms'",
            "UPDATE t SET n = 1 WHERE k = 'locked'",
        )
    finally:
        release.set()
        holder.join(10)


def _pg_refused(_engine: Engine, _tmp: Path) -> None:
    _run(
        create_engine(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/x",
                      connect_args={"connect_timeout": 2}),
        "SELECT 1",
    )


CASES: list[tuple[str, str, ErrorClass, Provoke]] = [
    ("sqlite", "no such table", P, lambda e, _: _run(e, "SELECT * FROM nosuch")),
    ("sqlite", "no such column", P, lambda e, _: _run(e, "SELECT nosuch FROM t")),
    ("sqlite", "has no column named", P,
     lambda e, _: _run(e, "INSERT INTO t (nosuch) VALUES (1)")),
    ("sqlite", "syntax error", P, lambda e, _: _run(e, "SELEC 1")),
    ("sqlite", "unique constraint (IntegrityError)", P,
     lambda e, _: _run(e, "INSERT INTO t (k) VALUES ('a'), ('a')")),
    ("sqlite", "not null constraint (IntegrityError)", P,
     lambda e, _: _run(e, "INSERT INTO t (k, n) VALUES ('a', NULL)")),
    ("sqlite", "datatype mismatch", P,
     lambda e, _: _run(e, "CREATE TABLE r (id INTEGER PRIMARY KEY)",
                       "INSERT INTO r (id) VALUES ('abc')")),
    ("sqlite", "string or blob too big (DataError)", P, _sqlite_too_big),
    ("sqlite", "database is locked", T, _sqlite_locked),
    ("sqlite", "unable to open database file", T, _sqlite_cannot_open),
    ("postgres", "NUL in a text value (DataError)", P,
     lambda e, _: _run(e, "INSERT INTO t (k) VALUES (:k)", params={"k": "a\x00b"})),
    ("postgres", "value too long (22001)", P,
     lambda e, _: _run(e, "INSERT INTO t (k, v) VALUES ('a', 'abcd')")),
    ("postgres", "integer out of range (22003)", P,
     lambda e, _: _run(e, "INSERT INTO t (k, n) VALUES ('a', :n)", params={"n": 2**40})),
    ("postgres", "index row too large (ProgramLimitExceeded, 54000)", P,
     lambda e, _: _run(e, "INSERT INTO t (k) VALUES (:k)", params={"k": os.urandom(3000).hex()})),
    ("postgres", "undefined table (42P01)", P, lambda e, _: _run(e, "SELECT * FROM nosuch")),
    ("postgres", "undefined column (42703)", P, lambda e, _: _run(e, "SELECT nosuch FROM t")),
    ("postgres", "syntax error (42601)", P, lambda e, _: _run(e, "SELEC 1")),
    ("postgres", "unique violation (23505)", P,
     lambda e, _: _run(e, "INSERT INTO t (k) VALUES ('a'), ('a')")),
    ("postgres", "not null violation (23502)", P,
     lambda e, _: _run(e, "INSERT INTO t (k) VALUES (NULL)")),
    ("postgres", "statement timeout (57014)", T,
     lambda e, _: _run(e, "SET statement_timeout = 50", "SELECT pg_sleep(2)")),
    ("postgres", "connection terminated (57P01)", T,
     lambda e, _: _run(e, "SELECT pg_terminate_backend(pg_backend_pid())")),
    ("postgres", "lock not available (55P03)", T, _pg_lock_timeout),
    ("postgres", "connection refused", T, _pg_refused),
]


@pytest.fixture
def engine_for(tmp_path: Path) -> Iterator[Callable[[str], Engine]]:
    made: list[tuple[Engine, str | None]] = []

    def make(dialect: str) -> Engine:
        if dialect == "sqlite":
            engine = create_engine(f"sqlite:///{tmp_path / 'app.db'}")
            schema = None
        else:
            url, schema = postgres_schema_url()
            engine = create_engine(url)
        made.append((engine, schema))
        with engine.begin() as conn:
            conn.execute(text(_TABLE))
        return engine

    yield make
    for engine, schema in made:
        engine.dispose()
        if schema is not None:
            drop_postgres_schema(schema)


@pytest.mark.parametrize(
    ("dialect", "fault", "expected", "provoke"),
    [
        pytest.param(*case, marks=[pytest.mark.postgres] if case[0] == "postgres" else [],
                     id=f"{case[0]}: {case[1]}")
        for case in CASES
    ],
)
def test_driver_errors_are_classified_by_what_they_mean(
    engine_for: Callable[[str], Engine],
    tmp_path: Path,
    dialect: str,
    fault: str,
    expected: ErrorClass,
    provoke: Provoke,
) -> None:
    """Catches: bad data or a wrong schema retried as transient (ProgramLimitExceeded and
    SQLite's "no such table" are OperationalErrors), or a lost connection given up on."""
    engine = engine_for(dialect)
    with pytest.raises(Exception) as info:
        provoke(engine, tmp_path)
    assert classify(info.value) is expected, f"{type(info.value).__name__}: {info.value}"


def test_the_table_covers_both_dialects_and_both_classes() -> None:
    """The table itself stays honest: every dialect has permanent and transient rows."""
    seen = {(dialect, expected) for dialect, _, expected, _ in CASES}
    assert seen == {(d, c) for d in ("sqlite", "postgres") for c in (P, T)}
    assert PG_URL.startswith("postgresql")
