"""One way to reach the app database, on SQLite (embedded) and Postgres (production).

Why a wrapper at all: the two backends need different care for the same guarantees.

- SQLite: WAL, a busy timeout, and every transaction opened with ``BEGIN IMMEDIATE`` so two
  writers never deadlock on a read-to-write upgrade (which SQLite reports at once as "database is
  locked", skipping the busy timeout).
- Postgres: single-statement operations run in autocommit, so a conditional upsert costs one round
  trip instead of three (BEGIN, statement, COMMIT). Every call is bounded
  (:class:`DatabaseTimeouts`): libpq ``connect_timeout``, TCP keepalives and
  ``tcp_user_timeout``; the server's ``statement_timeout``, ``lock_timeout`` and
  ``idle_in_transaction_session_timeout`` for every session (startup options, no extra round
  trip); a ping before a pooled connection is reused; and a client-side deadline per round trip,
  because nothing server-side fires while the server is frozen (SIGSTOP, a paused VM): the kernel
  still acknowledges every packet. When a round trip passes ``statement + margin`` seconds,
  :class:`RoundTripWatchdog` shuts the connection's socket down, the driver reports the
  connection closed, and the caller gets :class:`StoreUnavailable`. A store call thus returns or
  raises within ``DatabaseTimeouts.bound`` (35 s by default), inside the default 60 s lease.

``Database.transaction()`` is for several statements that must commit together;
``Database.statement()`` is for one statement that is atomic on its own. Driver errors become
sekali's in :mod:`resources.storage.driver` (:func:`errors_as_ours`), the one place for both
ways of reaching the database.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import MetaData, create_engine, event
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.engine.url import URL

from resources.storage.dialects import Dialect, dialect_named
from resources.storage.driver import errors_as_ours
from resources.storage.files import FILE_MODE, FOLDER_MODE
from resources.storage.settings import DatabaseTimeouts, normalize_url
from resources.telemetry.tracing import trace_engine

metadata = MetaData()
"""Every table the code expects, declared beside the module that uses it. ``sql/`` creates them;
a test checks that what ``sql/`` creates matches this."""

__all__ = [
    "Database",
    "RoundTripWatchdog",
    "make_engine",
    "metadata",
    "normalize_url",
    "release_shared",
    "round_trip_watchdog",
    "shared_database",
    "shared_databases",
]


def make_engine(url: str, **options: Any) -> Engine:
    """Create an engine with the per-backend settings sekali relies on (see
    :func:`_make_engine`). Opens no connection. With tracing on (now or later in this process),
    its statements are spans of the trace."""
    engine = _make_engine(url, **options)
    trace_engine(engine)
    return engine


def _make_engine(
    url: str,
    *,
    pool_size: int = 5,
    max_overflow: int = 20,
    echo: bool = False,
    timeouts: DatabaseTimeouts | None = None,
) -> Engine:
    """Create an engine with the per-backend settings sekali relies on. Opens no connection.

    ``timeouts`` (Postgres only) default to :meth:`DatabaseTimeouts.from_env`, read now.
    """
    url = normalize_url(url)
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database or ""
        if database and database != ":memory:":
            Path(database).parent.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
        engine = create_engine(
            url,
            echo=echo,
            pool_size=pool_size,
            max_overflow=max_overflow,
            connect_args={"timeout": 60, "check_same_thread": False},
            hide_parameters=True,
        )
        _configure_sqlite(engine, database)
        return engine
    if parsed.get_backend_name() != "postgresql":
        raise ValueError(f"DATABASE_URL: unsupported backend {parsed.get_backend_name()!r}")
    t = timeouts or DatabaseTimeouts.from_env()
    engine = create_engine(
        url,
        echo=echo,
        pool_size=pool_size,
        max_overflow=max_overflow,
        pool_timeout=t.bound,
        connect_args=postgres_connect_args(parsed, t),
        hide_parameters=True,
    )
    _bound_round_trips(engine, t)
    return engine


def postgres_connect_args(url: URL, t: DatabaseTimeouts) -> dict[str, Any]:
    """libpq parameters for the bounds; whatever the URL already says wins."""
    query = url.query
    args: dict[str, Any] = {
        name: value
        for name, value in {
            "connect_timeout": max(2, round(t.connect)),
            "keepalives": 1,
            "keepalives_idle": t.keepalive_idle,
            "keepalives_interval": t.keepalive_interval,
            "keepalives_count": t.keepalive_count,
            "tcp_user_timeout": int(t.tcp_user_timeout * 1000),
        }.items()
        if name not in query
    }
    given = query.get("options", "")
    options = " ".join(given) if isinstance(given, tuple) else given
    for setting, seconds in (
        ("statement_timeout", t.statement),
        ("lock_timeout", t.lock),
        ("idle_in_transaction_session_timeout", t.idle_in_transaction),
    ):
        if setting not in options:
            options += f" -c {setting}={int(seconds * 1000)}"
    args["options"] = options.strip()
    return args


class RoundTripWatchdog:
    """Cuts a Postgres connection whose round trip outlived its deadline.

    One daemon thread per process (:func:`round_trip_watchdog`), started on first use, sleeping
    until the earliest deadline. ``arm`` records (deadline, connection) before a statement,
    commit, rollback or ping; ``disarm`` removes it when the round trip ended, and before the
    pool closes or invalidates the connection. Both take one lock, and the thread shuts a socket
    down only while holding it and only for a connection still armed, so it never touches a
    connection that has finished its round trip or been handed to someone else::

        t=0    worker arms conn C (deadline t=25), sends UPDATE; the server freezes (SIGSTOP)
        t=25   the watchdog finds C still armed: shutdown(C's socket), under the lock
        t=25   the driver's wait returns "server closed the connection"; the pool invalidates
               C; the caller gets StoreUnavailable and its retry policy takes over

    ``shutdown`` (not ``close``) is what wakes a thread blocked on the socket; the connection
    object is closed by the pool as usual.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._armed: dict[int, tuple[float, Any]] = {}
        self._thread: threading.Thread | None = None
        self.cut = 0

    def arm(self, dbapi_connection: Any, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        with self._cv:
            earliest = min((d for d, _ in self._armed.values()), default=None)
            self._armed[id(dbapi_connection)] = (deadline, dbapi_connection)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="db-round-trip-watchdog", daemon=True
                )
                self._thread.start()
            if earliest is None or deadline < earliest:
                self._cv.notify()

    def disarm(self, dbapi_connection: Any) -> None:
        with self._cv:
            self._armed.pop(id(dbapi_connection), None)

    def _run(self) -> None:
        with self._cv:
            while True:
                now = time.monotonic()
                for key, (deadline, conn) in list(self._armed.items()):
                    if deadline <= now:
                        del self._armed[key]
                        self._cut(conn)
                earliest = min((d for d, _ in self._armed.values()), default=None)
                self._cv.wait(None if earliest is None else max(0.0, earliest - now))

    def _cut(self, dbapi_connection: Any) -> None:
        if getattr(dbapi_connection, "closed", False):
            return
        with contextlib.suppress(Exception):
            fd = os.dup(dbapi_connection.fileno())
            with socket.socket(fileno=fd) as sock:
                sock.shutdown(socket.SHUT_RDWR)
            self.cut += 1


_watchdog: tuple[int, RoundTripWatchdog] | None = None
_watchdog_guard = threading.Lock()


def round_trip_watchdog() -> RoundTripWatchdog:
    """The process's watchdog (a forked child gets its own: threads do not survive a fork)."""
    global _watchdog
    with _watchdog_guard:
        if _watchdog is None or _watchdog[0] != os.getpid():
            _watchdog = (os.getpid(), RoundTripWatchdog())
        return _watchdog[1]


_ROUND_TRIP = "sekali_round_trip"  # a transaction's own deadline, in the connection's info


def _bound_round_trips(engine: Engine, t: DatabaseTimeouts) -> None:
    """Wire the watchdog and the bounded ping into ``engine``'s events."""
    engine.sekali_timeouts = t  # type: ignore[attr-defined]

    def arm(conn: Connection) -> None:
        if conn.invalidated or conn.closed:
            return  # nothing will be sent (a rollback of a connection the server dropped)
        dbapi = conn.connection.dbapi_connection
        if dbapi is not None:
            round_trip_watchdog().arm(dbapi, conn.info.get(_ROUND_TRIP, t.round_trip))

    def disarm_dbapi(dbapi_connection: Any, *_: Any) -> None:
        round_trip_watchdog().disarm(dbapi_connection)

    @event.listens_for(engine, "before_cursor_execute")
    def _before(conn: Connection, *_: Any) -> None:
        arm(conn)

    @event.listens_for(engine, "after_cursor_execute")
    def _after(conn: Connection, cursor: Any, *_: Any) -> None:
        disarm_dbapi(cursor.connection)

    @event.listens_for(engine, "handle_error")
    def _error(context: Any) -> None:
        cursor = getattr(context, "cursor", None)  # absent when the connect itself failed
        if cursor is not None:
            disarm_dbapi(cursor.connection)

    event.listen(engine, "commit", arm)
    event.listen(engine, "rollback", arm)

    @event.listens_for(engine, "reset")
    def _reset(dbapi_connection: Any, *_: Any) -> None:
        round_trip_watchdog().arm(dbapi_connection, t.round_trip)  # the pool's rollback on return

    for name in ("invalidate", "soft_invalidate", "close", "close_detached"):
        event.listen(engine, name, disarm_dbapi)

    @event.listens_for(engine, "checkin")
    def _checkin(dbapi_connection: Any, record: Any) -> None:
        disarm_dbapi(dbapi_connection)
        if record is not None:
            record.info.pop(_ROUND_TRIP, None)  # a transaction's own bound ends with it

    @event.listens_for(engine, "connect")
    def _fresh(dbapi_connection: Any, record: Any) -> None:
        record.info["sekali_fresh"] = True

    @event.listens_for(engine, "checkout")
    def _ping(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        """The pre-ping, bounded: a connection that was pooled answers within ``connect``."""
        record.info.pop(_ROUND_TRIP, None)
        if record.info.pop("sekali_fresh", False):
            return
        round_trip_watchdog().arm(dbapi_connection, t.connect)
        try:
            engine.dialect.do_ping(dbapi_connection)
        except Exception as exc:
            raise sa_exc.InvalidatePoolError(f"pooled connection did not answer: {exc}") from exc
        finally:
            disarm_dbapi(dbapi_connection)


def _configure_sqlite(engine: Engine, database: str) -> None:
    @event.listens_for(engine, "do_connect")
    def _private_file(*_args: Any) -> None:
        """A database file sekali creates is 0600 (requests and dead letters hold personal
        data); SQLite gives its -wal and -shm files the database file's mode."""
        if database and database != ":memory:" and not database.startswith("file:"):
            with contextlib.suppress(FileExistsError):
                os.close(os.open(database, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE))

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


class Database:
    """An engine plus the two ways sekali talks to it. Cheap to share across threads."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.dialect: str = engine.dialect.name
        self.sql_dialect: Dialect = dialect_named(self.dialect)
        """What differs between the dialects, behind one interface (:mod:`.dialects`)."""
        self._autocommit = (
            engine.execution_options(isolation_level="AUTOCOMMIT")
            if self.dialect == "postgresql"
            else engine
        )
        bounds = getattr(engine, "sekali_timeouts", None)
        self.timeouts: DatabaseTimeouts | None = bounds  # Postgres only: the bounds in force

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        pool_size: int = 5,
        max_overflow: int = 20,
        timeouts: DatabaseTimeouts | None = None,
    ) -> Database:
        return cls(
            make_engine(url, pool_size=pool_size, max_overflow=max_overflow, timeouts=timeouts)
        )

    @property
    def is_postgres(self) -> bool:
        return self.dialect == "postgresql"

    @contextlib.contextmanager
    def transaction(self, *, statement_timeout: float | None = None) -> Iterator[Connection]:
        """Several statements that commit together (``BEGIN IMMEDIATE`` on SQLite).

        ``statement_timeout`` (Postgres) gives this transaction a longer bound than the
        default, for work known to be slow (migrations, purges): each statement and lock wait
        may take that long, and the client waits that long plus the margin for each round trip.
        """
        with errors_as_ours(), self.engine.begin() as conn:
            if statement_timeout is not None and self.timeouts is not None:
                # kept in the pooled connection's info until it is checked in
                ms = int(statement_timeout * 1000)
                conn.info[_ROUND_TRIP] = statement_timeout + self.timeouts.margin
                conn.exec_driver_sql(f"SET LOCAL statement_timeout = {ms}")
                conn.exec_driver_sql(f"SET LOCAL lock_timeout = {ms}")
            yield conn

    @contextlib.contextmanager
    def statement(self) -> Iterator[Connection]:
        """One statement, atomic on its own: autocommit on Postgres (one round trip)."""
        with errors_as_ours(), self._autocommit.begin() as conn:
            yield conn

    @contextlib.contextmanager
    def session(self, *, round_trip: float | None = None) -> Iterator[Connection]:
        """One Postgres connection kept for a sequence of statements that each commit on their
        own (autocommit; ``BEGIN``/``COMMIT`` may be sent explicitly), for work that must stay
        on one server session: a session-level advisory lock, ``SET`` for the statements that
        follow (schema upgrades). ``round_trip``: the client's deadline for each statement
        instead of the default. Settings and advisory locks are reset before the connection
        goes back to the pool."""
        with errors_as_ours(), self._autocommit.connect() as conn:
            if round_trip is not None and self.timeouts is not None:
                conn.info[_ROUND_TRIP] = round_trip + self.timeouts.margin
            try:
                yield conn
            finally:
                if not conn.invalidated and not conn.closed:
                    with contextlib.suppress(sa_exc.DBAPIError):
                        conn.exec_driver_sql("ROLLBACK")  # a transaction an error left open
                        conn.exec_driver_sql("RESET ALL")
                        self.sql_dialect.release_session_locks(conn)

    def dispose(self) -> None:
        self.engine.dispose()


_shared: dict[str, Database] = {}
_shared_lock = threading.Lock()


def shared_databases() -> set[str]:
    """The URLs of the shared ``Database`` objects this process holds."""
    with _shared_lock:
        return set(_shared)


def release_shared(urls: set[str]) -> None:
    """Close the pools of these shared databases and forget them (a test's own database once
    the test ended: an idle pool holds its connections open until the process ends)."""
    with _shared_lock:
        dropped = [_shared.pop(url) for url in urls if url in _shared]
    for db in dropped:
        db.dispose()


def shared_database(url: str) -> Database:
    """One ``Database`` per URL per process, so resources set up per step share one pool."""
    url = normalize_url(url)
    with _shared_lock:
        db = _shared.get(url)
        if db is None:
            db = _shared[url] = Database.from_url(url)
        return db
