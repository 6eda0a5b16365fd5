"""How a migration is applied on each database: two small classes behind one interface, and the
owner of the two tables that record the schema (``sekali_schema_migrations``: what was applied,
with its checksum and, for a file another one replaced, which; ``sekali_schema_state``: the
newest migration every running process is declared to know, see
:func:`resources.storage.migrations.contract`).

SQLite (:class:`SqliteRunner`): each migration is one ``BEGIN IMMEDIATE`` transaction (the write
lock serialises upgraders; readers go on under WAL). ``ALTER TABLE t ADD COLUMN IF NOT EXISTS``,
which SQLite lacks, is guarded here. No migration lowers an ``AUTOINCREMENT`` counter: SQLite
resets it to ``MAX(id)`` when a table is rebuilt (new table, copy, drop, rename), and after the
highest rows were purged a new row would get an old id back, which old ``job_attempts`` and
``dlq_records`` rows still point at; so ``sqlite_sequence`` is read before each migration and
restored after it.

Postgres (:class:`PostgresRunner`): one session for the whole upgrade, holding a session-level
advisory lock (upgraders of this release queue on it); each plain migration is one transaction
that also takes the transaction-level lock the previous release's upgraders take, so the two
never interleave. An ``online`` file runs statement by statement, each committing on its own,
bounded by :class:`resources.storage.settings.MigrationSettings`: a statement that stops writers
(SHARE or stronger, :mod:`resources.storage.ddl`) waits at most ``lock_timeout`` for its lock
and tries again later (a lock request waiting in the queue stops every writer behind it), and
holds it at most ``exclusive_hold`` (Postgres cancels it past that); batches run one range per
transaction; a ``CREATE INDEX CONCURRENTLY`` that failed half-way left an invalid index, which
is dropped before the next try. A plain transaction that cannot get its locks within
``lock_timeout`` is rolled back and tried again the same way.
"""

from __future__ import annotations

import contextlib
import logging
import random
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy import exc as sa_exc
from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection

from resources.errors import SekaliError, StoreUnavailable
from resources.storage import ddl
from resources.storage.db import Database
from resources.storage.migration_files import Migration, Statement
from resources.storage.queries import load_dialect_queries, load_queries
from resources.storage.settings import MigrationSettings

log = logging.getLogger(__name__)

_LEGACY_LOCK_ID = 0x5E4A11  # the transaction-level lock every release's upgrader takes
_UPGRADE_LOCK_ID = 0x5E4A12  # this runner's session-level lock, held for a whole upgrade
RECORDS = "sekali_schema_migrations"
STATE = "sekali_schema_state"
READERS_KNOW = "readers_know"

_QUERY_FILE = Path(__file__).with_suffix(".sql")
_Q = load_queries(_QUERY_FILE)
_DIALECT_Q = load_dialect_queries(_QUERY_FILE)
_RECORD = text(_Q["record"])
_ADD_COLUMN_IF_NOT_EXISTS = re.compile(
    r"^ALTER\s+TABLE\s+(\w+)\s+ADD\s+(?:COLUMN\s+)?IF\s+NOT\s+EXISTS\s+(\w+)\s+(.*)$",
    re.I | re.S,
)
_CONCURRENT_INDEX = re.compile(
    r"^CREATE\s+(?:UNIQUE\s+)?INDEX\s+CONCURRENTLY\s+(?:IF\s+NOT\s+EXISTS\s+)?(\w+)", re.I
)
_LOCK_NOT_AVAILABLE = "55P03"
_QUERY_CANCELED = "57014"


class MigrationFailed(SekaliError):
    """A migration statement failed, or could not get (or keep) its lock within its bounds.

    Nothing half-done is recorded: run ``sekali db upgrade`` again once the cause is gone (a
    long transaction holding the table: see ``pg_stat_activity``), or raise the bound named in
    the message. Every statement is idempotent, so the rerun picks up where this one stopped.
    """

    def __init__(self, migration: str, statement: str, problem: str) -> None:
        first = " ".join(statement.split())[:120]
        super().__init__(f"sql/{migration}: `{first}`: {problem}")
        self.migration = migration
        self.statement = statement


@dataclass(frozen=True)
class Record:
    """A row of ``sekali_schema_migrations``."""

    name: str
    checksum: str
    applied_at: float
    replaced_by: str | None = None


@dataclass(frozen=True)
class StatementPlan:
    """What one statement will do, for ``sekali db upgrade --dry-run``."""

    sql: str
    locks: list[str]
    batch: str | None = None


@dataclass(frozen=True)
class MigrationPlan:
    name: str
    how: str
    statements: list[StatementPlan]


class Runner(Protocol):
    dialect: str

    def exclusive(self) -> contextlib.AbstractContextManager[None]:
        """Held for a whole upgrade: one upgrader at a time."""

    def prepare(self, newest: str) -> None:
        """Create the record tables (and columns later releases added to them), and record
        what every process knows if nothing says yet (:func:`_start_readers_know`)."""

    def records(self) -> dict[str, Record]: ...

    def readers_know(self) -> str | None: ...

    def set_readers_know(self, name: str) -> None: ...

    def apply(self, migration: Migration, replaced: list[Migration]) -> bool:
        """Run and record ``migration`` (and record ``replaced`` as replaced by it); False when
        another upgrader had recorded it meanwhile."""

    def record_replaced(self, replaced: list[Migration], by: Migration) -> None:
        """Record ``replaced`` as done by ``by``, applied before (nothing is run)."""

    def describe(self, migration: Migration) -> MigrationPlan: ...


def runner_for(db: Database, settings: MigrationSettings,
               progress: Callable[[str], None] | None = None) -> Runner:
    runners: dict[str, type[PostgresRunner] | type[SqliteRunner]] = {
        "postgresql": PostgresRunner, "sqlite": SqliteRunner}
    return runners[db.sql_dialect.name](db, settings, progress)


def read_records(conn: Connection) -> dict[str, Record]:
    """Every recorded migration; empty when nothing was ever applied. Reads the columns the
    table has, so it serves a database a previous release created."""
    if not inspect(conn).has_table(RECORDS):
        return {}
    rows = conn.execute(text(_Q["records"])).mappings().all()
    return {
        r["name"]: Record(r["name"], r["checksum"], float(r["applied_at"]), r.get("replaced_by"))
        for r in rows
    }


def read_readers_know(conn: Connection) -> str | None:
    if not inspect(conn).has_table(STATE):
        return None
    value = conn.execute(
        text(_Q["state_value"]), {"n": READERS_KNOW}
    ).scalar()
    return None if value is None else str(value)


def _record(conn: Connection, migration: Migration, replaced: list[Migration], *,
            itself: bool = True) -> bool:
    now = time.time()
    rows = [{"n": m.name, "c": m.checksum, "t": now, "r": migration.name} for m in replaced
            if not _recorded(conn, m.name)]
    if itself:
        rows.append({"n": migration.name, "c": migration.checksum, "t": now, "r": None})
    if rows:
        conn.execute(_RECORD, rows)
    return bool(rows)


def _recorded(conn: Connection, name: str) -> bool:
    return conn.execute(
        text(_Q["recorded"]), {"n": name}
    ).first() is not None


def _write_readers_know(conn: Connection, name: str) -> bool:
    """Raise the recorded floor to ``name`` (never lower it); True when it moved."""
    params = {"n": READERS_KNOW, "v": name, "t": time.time()}
    moved = conn.execute(text(_Q["raise_state"]), params).rowcount
    if not moved:
        moved = conn.execute(text(_Q["insert_state"]), params).rowcount
    return bool(moved)


def _start_readers_know(conn: Connection, newest: str) -> bool:
    """The first time this runner meets a database, under the upgrade lock: a database with
    migrations recorded may be read by the release that applied them, so every process is
    known to know only the newest of those; a database with none is new, and no process older
    than this one reads it (``newest``: the newest migration this release ships)."""
    if read_readers_know(conn) is not None:
        return False
    recorded = read_records(conn)
    return _write_readers_know(conn, max(recorded) if recorded else newest)


def _columns(conn: Connection, table: str) -> set[str]:
    return {c["name"] for c in inspect(conn).get_columns(table)}


def _ranges(conn: Connection, statement: Statement) -> Iterator[tuple[int, int]]:
    batch = statement.batch
    assert batch is not None
    low, high = conn.execute(
        text(_Q["batch_range"].format(column=batch.column, table=batch.table))
    ).one()
    if low is None:
        return
    start = int(low)
    while start <= int(high):
        yield start, start + batch.rows
        start += batch.rows


class SqliteRunner:
    """Each migration one ``BEGIN IMMEDIATE`` transaction; ``AUTOINCREMENT`` counters kept."""

    dialect = "sqlite"

    def __init__(self, db: Database, settings: MigrationSettings,
                 progress: Callable[[str], None] | None = None) -> None:
        self.db = db
        self.settings = settings
        self.progress = progress or (lambda _: None)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        yield  # each migration takes the database's write lock itself

    def prepare(self, newest: str) -> None:
        def create(conn: Connection) -> bool:
            conn.exec_driver_sql(_Q["create_records"])
            conn.exec_driver_sql(_Q["create_state"])
            if "replaced_by" not in _columns(conn, RECORDS):
                conn.exec_driver_sql(_DIALECT_Q["sqlite"]["add_replaced_by"])
            return _start_readers_know(conn, newest)

        self._transaction(create)

    def records(self) -> dict[str, Record]:
        with self.db.statement() as conn:
            return read_records(conn)

    def readers_know(self) -> str | None:
        with self.db.statement() as conn:
            return read_readers_know(conn)

    def set_readers_know(self, name: str) -> None:
        self._transaction(lambda conn: _write_readers_know(conn, name))

    def apply(self, migration: Migration, replaced: list[Migration]) -> bool:
        def whole(conn: Connection) -> bool:
            if _recorded(conn, migration.name):
                return False
            before = _sequences(conn)
            for statement in migration.statements:
                self._execute(conn, migration, statement)
            _keep_sequences(conn, before)
            return _record(conn, migration, replaced)

        return self._transaction(whole)

    def record_replaced(self, replaced: list[Migration], by: Migration) -> None:
        self._transaction(lambda conn: _record(conn, by, replaced, itself=False))

    def describe(self, migration: Migration) -> MigrationPlan:
        return MigrationPlan(
            migration.name,
            "one transaction under the database's write lock (writers wait, readers go on)",
            [StatementPlan(s.sql, ["the database: write lock"],
                           _batch_text(s)) for s in migration.statements],
        )

    def _transaction(self, body: Callable[[Connection], bool]) -> bool:
        """``body`` in one write transaction, tried again when another writer held the file past
        the busy timeout (several processes may upgrade one fresh database at once)."""
        for attempt in range(5):
            try:
                with self.db.transaction() as conn:
                    return body(conn)
            except StoreUnavailable:
                if attempt == 4:
                    raise
                time.sleep(0.2 * (attempt + 1))
        raise AssertionError("unreachable")

    def _execute(self, conn: Connection, migration: Migration, statement: Statement) -> None:
        sql = statement.sql
        guarded = _ADD_COLUMN_IF_NOT_EXISTS.match(sql)
        if guarded:
            table, column, rest = guarded.groups()
            if column in _columns(conn, table):
                return
            sql = _Q["add_column"].format(table=table, column=column, rest=rest)
        try:
            if statement.batch is None:
                conn.exec_driver_sql(sql)
                return
            for low, high in _ranges(conn, statement):
                conn.execute(text(sql), {"lo": low, "hi": high})
        except sa_exc.OperationalError as exc:
            if "locked" in str(exc.orig) or "busy" in str(exc.orig):
                raise  # the file is busy: the transaction is tried again
            raise MigrationFailed(migration.name, sql, str(exc.orig)) from exc
        except sa_exc.DBAPIError as exc:
            raise MigrationFailed(migration.name, sql, str(exc.orig)) from exc


def _sequences(conn: Connection) -> dict[str, int]:
    if not inspect(conn).has_table("sqlite_sequence"):
        return {}
    return {str(r[0]): int(r[1]) for r in conn.execute(text(_Q["sequences"]))}


def _keep_sequences(conn: Connection, before: dict[str, int]) -> None:
    """Put back every counter the migration lowered or lost, for tables that still exist."""
    tables = {r[0] for r in conn.execute(text(_Q["sqlite_tables"]))}
    after = _sequences(conn)
    for name, seq in before.items():
        if name not in tables or after.get(name, -1) >= seq:
            continue
        if name in after:
            conn.execute(text(_Q["set_sequence"]), {"s": seq, "n": name})
        else:
            conn.execute(text(_Q["add_sequence"]), {"s": seq, "n": name})


class PostgresRunner:
    """One session per upgrade; plain files in one bounded transaction, online files statement
    by statement with bounded lock waits and holds."""

    dialect = "postgresql"

    def __init__(self, db: Database, settings: MigrationSettings,
                 progress: Callable[[str], None] | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.db = db
        self.settings = settings
        self.progress = progress or (lambda _: None)
        self.sleep = sleep
        self._conn: Connection | None = None
        self.lock_waits = 0
        """Statements (or transactions) that gave way to the lock queue and were tried again."""

    @property
    def conn(self) -> Connection:
        if self._conn is None:
            raise RuntimeError("PostgresRunner: use it inside exclusive()")
        return self._conn

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self.db.session(round_trip=self.settings.timeout) as conn:
            self._conn = conn
            try:
                self._bounds(lock=self.settings.timeout, statement=self.settings.timeout)
                self._wait_for_other_upgrades()
                yield
            finally:
                self._conn = None

    def _wait_for_other_upgrades(self) -> None:
        """Take the upgrade lock, asking again every quarter second rather than waiting inside
        a statement: ``CREATE INDEX CONCURRENTLY`` in the upgrade that holds it waits for every
        open transaction to end, a waiting lock call included (a deadlock)."""
        deadline = time.monotonic() + self.settings.timeout
        while not self.conn.execute(
            text(_Q["try_upgrade_lock"]), {"id": _UPGRADE_LOCK_ID}
        ).scalar():
            if time.monotonic() > deadline:
                raise MigrationFailed(
                    "(upgrade)", "pg_try_advisory_lock",
                    f"another upgrade has held the upgrade lock for {self.settings.timeout:g} s;"
                    " wait for it (sekali db status) or raise SEKALI_MIGRATION_TIMEOUT",
                )
            self.sleep(0.25)

    def prepare(self, newest: str) -> None:
        def create(conn: Connection) -> bool:
            conn.exec_driver_sql(_Q["create_records"])
            conn.exec_driver_sql(_Q["create_state"])
            if "replaced_by" not in _columns(conn, RECORDS):
                conn.exec_driver_sql(_DIALECT_Q["postgresql"]["add_replaced_by"])
            return _start_readers_know(conn, newest)

        self._transaction("(records)", create)

    def records(self) -> dict[str, Record]:
        return read_records(self.conn)

    def readers_know(self) -> str | None:
        return read_readers_know(self.conn)

    def set_readers_know(self, name: str) -> None:
        self._transaction("(state)", lambda conn: _write_readers_know(conn, name))

    def apply(self, migration: Migration, replaced: list[Migration]) -> bool:
        if not migration.online:
            def whole(conn: Connection) -> bool:
                if _recorded(conn, migration.name):
                    return False
                for statement in migration.statements:
                    self._plain(conn, migration, statement)
                return _record(conn, migration, replaced)

            return self._transaction(migration.name, whole)
        if _recorded(self.conn, migration.name):
            return False
        context = ddl.Context()
        for statement in migration.statements:
            self._online(migration, statement, context)

        def record(conn: Connection) -> bool:
            return not _recorded(conn, migration.name) and _record(conn, migration, replaced)

        return self._transaction(migration.name, record)

    def record_replaced(self, replaced: list[Migration], by: Migration) -> None:
        self._transaction(by.name, lambda conn: _record(conn, by, replaced, itself=False))

    def describe(self, migration: Migration) -> MigrationPlan:
        s = self.settings
        how = (
            f"online: each statement commits on its own; one that stops writers waits at most "
            f"{s.lock_timeout:g} s for its lock (tried {s.lock_retries} times) and holds it at "
            f"most {s.exclusive_hold:g} s"
            if migration.online
            else "one transaction: every lock below is held until it commits"
        )
        context = ddl.Context()
        plans = []
        for statement in migration.statements:
            locks = ddl.statement_locks(statement.sql, context,
                                        batched=statement.batch is not None)
            plans.append(StatementPlan(statement.sql, [str(lock) for lock in locks],
                                       _batch_text(statement)))
        return MigrationPlan(migration.name, how, plans)

    # -- running -----------------------------------------------------------------------------

    def _bounds(self, *, lock: float, statement: float) -> None:
        self.conn.exec_driver_sql(f"SET lock_timeout = {int(lock * 1000)}")
        self.conn.exec_driver_sql(f"SET statement_timeout = {int(statement * 1000)}")

    def _plain(self, conn: Connection, migration: Migration, statement: Statement) -> None:
        if statement.batch is None:
            _execute(conn, statement.sql)
            return
        for low, high in _ranges(conn, statement):
            conn.execute(text(statement.sql), {"lo": low, "hi": high})

    def _transaction(self, name: str, body: Callable[[Connection], bool]) -> bool:
        """``body`` in one transaction that waits at most ``lock_timeout`` for each lock; a
        transaction that had to wait longer is rolled back and tried again later."""
        conn = self.conn
        s = self.settings
        for attempt in range(s.lock_retries):
            conn.exec_driver_sql("BEGIN")
            try:
                conn.exec_driver_sql(f"SET LOCAL lock_timeout = {int(s.lock_timeout * 1000)}")
                conn.exec_driver_sql(f"SET LOCAL statement_timeout = {int(s.timeout * 1000)}")
                conn.execute(text(_Q["legacy_lock"]), {"id": _LEGACY_LOCK_ID})
                done = body(conn)
                conn.exec_driver_sql("COMMIT")
                return done
            except sa_exc.DBAPIError as exc:
                self._rollback()
                if _sqlstate(exc) == _LOCK_NOT_AVAILABLE and attempt < s.lock_retries - 1:
                    self._give_way(name, attempt)
                    continue
                raise self._failure(exc, name, _failed_statement(exc)) from exc
            except BaseException:
                self._rollback()
                raise
        raise AssertionError("unreachable")

    def _online(self, migration: Migration, statement: Statement, context: ddl.Context) -> None:
        locks = ddl.statement_locks(statement.sql, context, batched=statement.batch is not None)
        stops_writers = any(lk.blocks_writes and lk.work != ddl.NEW_TABLE for lk in locks)
        s = self.settings
        self.progress(f"{migration.name}: {' '.join(statement.sql.split())[:72]}")
        if statement.batch is not None:
            self._batches(migration, statement)
            return
        index = _CONCURRENT_INDEX.match(statement.sql)
        if index:
            self._drop_invalid_index(index.group(1))
        if stops_writers:
            self._bounds(lock=s.lock_timeout, statement=s.lock_timeout + s.exclusive_hold)
        else:
            self._bounds(lock=s.timeout, statement=s.timeout)
        held = ", ".join(str(lk) for lk in locks if lk.blocks_writes)
        self._retrying(migration, statement.sql, None, held if stops_writers else None)

    def _batches(self, migration: Migration, statement: Statement) -> None:
        s = self.settings
        self._bounds(lock=s.timeout, statement=s.timeout)
        ranges = list(_ranges(self.conn, statement))
        self._bounds(lock=s.lock_timeout, statement=s.timeout)
        step = max(1, len(ranges) // 10)
        changed = 0
        for i, (low, high) in enumerate(ranges):
            changed += self._retrying(migration, statement.sql, {"lo": low, "hi": high}, None)
            if (i + 1) % step == 0 or i + 1 == len(ranges):
                batch = statement.batch
                assert batch is not None
                self.progress(f"{migration.name}: {batch.table}.{batch.column} batch "
                              f"{i + 1}/{len(ranges)} ({changed} rows changed)")

    def _retrying(self, migration: Migration, sql: str, params: dict[str, Any] | None,
                  held: str | None) -> int:
        s = self.settings
        for attempt in range(s.lock_retries):
            try:
                if params is None:
                    result = _execute(self.conn, sql)
                else:
                    result = self.conn.execute(text(sql), params)
                return max(0, result.rowcount or 0)
            except sa_exc.DBAPIError as exc:
                if _sqlstate(exc) == _LOCK_NOT_AVAILABLE and attempt < s.lock_retries - 1:
                    self._give_way(migration.name, attempt)
                    continue
                if _sqlstate(exc) == _QUERY_CANCELED and held:
                    raise MigrationFailed(
                        migration.name, sql,
                        f"held {held} longer than {s.exclusive_hold:g} s, so Postgres cancelled "
                        "it (SEKALI_MIGRATION_EXCLUSIVE_HOLD); it must not scan or rewrite a "
                        "large table under that lock",
                    ) from exc
                raise self._failure(exc, migration.name, sql) from exc
        raise AssertionError("unreachable")

    def _drop_invalid_index(self, name: str) -> None:
        valid = self.conn.execute(
            text(_Q["index_valid"]),
            {"n": name},
        ).scalar()
        if valid is False:
            self.progress(f"dropping {name}, left invalid by an index build that failed")
            self.conn.exec_driver_sql(f"DROP INDEX CONCURRENTLY IF EXISTS {name}")

    def _give_way(self, name: str, attempt: int) -> None:
        self.lock_waits += 1
        pause = random.uniform(0.05, min(2.0, 0.1 * 2 ** attempt))
        log.info("%s: lock not granted within %.3g s; giving way for %.2f s (try %d of %d)",
                 name, self.settings.lock_timeout, pause, attempt + 1,
                 self.settings.lock_retries)
        self.sleep(pause)

    def _rollback(self) -> None:
        with contextlib.suppress(sa_exc.DBAPIError):
            self.conn.exec_driver_sql("ROLLBACK")

    def _failure(self, exc: sa_exc.DBAPIError, name: str, sql: str) -> Exception:
        if exc.connection_invalidated:
            return StoreUnavailable(f"database unavailable during sql/{name}: {exc.orig}; "
                                    "run the upgrade again when it answers")
        if _sqlstate(exc) == _LOCK_NOT_AVAILABLE:
            return MigrationFailed(
                name, sql,
                f"did not get its lock within {self.settings.lock_timeout:g} s in "
                f"{self.settings.lock_retries} tries: a long transaction holds the table "
                "(pg_stat_activity); raise SEKALI_MIGRATION_LOCK_RETRIES or try again later",
            )
        return MigrationFailed(name, sql, str(exc.orig).strip())


def _execute(conn: Connection, sql: str) -> Any:
    """A statement of a file as written: psycopg reads ``%`` as a placeholder, so it is
    doubled (SQLite's driver has none)."""
    return conn.exec_driver_sql(sql.replace("%", "%%"))


def _sqlstate(exc: sa_exc.DBAPIError) -> str | None:
    return getattr(exc.orig, "sqlstate", None)


def _failed_statement(exc: sa_exc.DBAPIError) -> str:
    return str(exc.statement or "")


def _batch_text(statement: Statement) -> str | None:
    b = statement.batch
    return None if b is None else f"in ranges of {b.rows} {b.table}.{b.column} values"
