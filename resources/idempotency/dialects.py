"""How the ledger claims keys and writes for a batch on each dialect, one class each behind one
interface, as :mod:`resources.storage.dialects` does for the database: the store picks its
database's class once and never branches on the dialect.

Both give the same guarantees (the module docstring of :mod:`resources.idempotency.store`); they
differ in how many round trips and what holds the rows:

- **Postgres** decides each claim, and each batch, in one autocommit statement (``claim``,
  ``claim_many`` of queries.postgresql.sql) that also reads the records it did not claim; a batch
  write is one statement over arrays. Two batches that share keys may deadlock; Postgres rolls
  one back whole, and it is run again.
- **SQLite** reads the record and then upserts it inside one ``BEGIN IMMEDIATE`` transaction
  (which excludes every other writer), one key after another for a batch.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from sqlalchemy.engine import Connection

from resources.idempotency.records import QUERIES, Claim, Record
from resources.storage.db import Database
from resources.storage.driver import (
    DriverConnection,
    Sql,
    connect,
    is_deadlock,
    transaction,
    within,
)

T = TypeVar("T")
Found = tuple[Record, bool, str | None]
"""A key's record as a claim left it, whether the claim took it, and its status before."""


class LedgerDialect(ABC):
    """The claims and batch writes of the ledger on one dialect (see the module)."""

    def __init__(self, queries: dict[str, str]) -> None:
        self._sql = {name: Sql(statement) for name, statement in queries.items()}

    def sql(self, name: str) -> Sql:
        return self._sql[name]

    @abstractmethod
    def claim(self, db: Database, params: dict[str, Any]) -> Found | None:
        """Claim one key (``params`` of the ``claim`` statement); None when the key was inserted
        concurrently after this statement's snapshot (look again)."""

    @abstractmethod
    def claim_many(
        self, db: Database, keys: list[str], digests: dict[str, str], owners: dict[str, str],
        now: float, expires: float,
    ) -> dict[str, Found]:
        """Claim the sorted ``keys``; a key left out was inserted concurrently (look again)."""

    @abstractmethod
    def owner_update_many(
        self, db: Database, claims: Sequence[Claim], write: str, params: dict[str, Any],
        results: dict[str, str] | None, conn: Connection | None,
    ) -> set[str]:
        """Apply the owner's write ``write`` (``heartbeat`` or ``complete``) to every claim
        still owned, in ``conn``'s transaction if given; returns the keys written."""


class SqliteLedger(LedgerDialect):
    """Read, then upsert, inside one ``BEGIN IMMEDIATE`` transaction."""

    def claim(self, db: Database, params: dict[str, Any]) -> Found | None:
        with transaction(db) as conn:
            return self._claim(conn, "claim", params)

    def claim_many(
        self, db: Database, keys: list[str], digests: dict[str, str], owners: dict[str, str],
        now: float, expires: float,
    ) -> dict[str, Found]:
        found = {}
        with transaction(db) as conn:
            for key in keys:
                params = {"key": key, "hash": digests[key], "owner": owners[key],
                          "now": now, "expires": expires, "solo": None}
                one = self._claim(conn, "claim_many", params)
                if one is not None:
                    found[key] = one
        return found

    def _claim(self, conn: DriverConnection, name: str, params: dict[str, Any]) -> Found | None:
        """One key's claim inside the transaction, or None when the key vanished between the
        two statements (look again)."""
        before = conn.row(self.sql("select_one"), params)
        row = conn.row(self.sql(name), params)
        if row is None and before is None:
            return None
        previous = before[2] if before is not None else None
        if row is not None:
            return Record.from_row(row), True, previous
        assert before is not None
        return Record.from_row(before), False, previous

    def owner_update_many(
        self, db: Database, claims: Sequence[Claim], write: str, params: dict[str, Any],
        results: dict[str, str] | None, conn: Connection | None,
    ) -> set[str]:
        one = self.sql(f"{write}_many")

        def apply(driver: DriverConnection) -> set[str]:
            written = set()
            for c in claims:
                each = {**params, "key": c.key, "owner": c.owner_token}
                if results is not None:
                    each["result"] = results[c.key]
                if driver.run(one, each) == 1:
                    written.add(c.key)
            return written

        if conn is not None:
            return apply(within(conn))
        with transaction(db) as driver:
            return apply(driver)


class PostgresLedger(LedgerDialect):
    """One autocommit statement per claim, per batch and per batch write."""

    def claim(self, db: Database, params: dict[str, Any]) -> Found | None:
        with connect(db) as conn:
            row = conn.row(self.sql("claim"), params)
        return None if row is None else (Record.from_row(row), bool(row[16]), row[17])

    def claim_many(
        self, db: Database, keys: list[str], digests: dict[str, str], owners: dict[str, str],
        now: float, expires: float,
    ) -> dict[str, Found]:
        params = {
            "keys": keys,
            "hashes": [digests[k] for k in keys],
            "owners": [owners[k] for k in keys],
            "now": now,
            "expires": expires,
        }
        rows = _retry_deadlock(lambda: _rows_autocommit(db, self.sql("claim_many"), params))
        return {row[0]: (Record.from_row(row), bool(row[16]), row[17]) for row in rows}

    def owner_update_many(
        self, db: Database, claims: Sequence[Claim], write: str, params: dict[str, Any],
        results: dict[str, str] | None, conn: Connection | None,
    ) -> set[str]:
        many = self.sql(f"{write}_many")
        batch = {
            **params,
            "keys": [c.key for c in claims],
            "owners": [c.owner_token for c in claims],
            "results": [results[c.key] for c in claims] if results is not None else None,
        }
        if conn is not None:
            rows = within(conn).rows(many, batch)
        else:
            rows = _retry_deadlock(lambda: _rows_autocommit(db, many, batch))
        return {str(row[0]) for row in rows}


_BY_DIALECT: dict[str, LedgerDialect] = {
    "sqlite": SqliteLedger(QUERIES["sqlite"]),
    "postgresql": PostgresLedger(QUERIES["postgresql"]),
}
assert set(_BY_DIALECT) == set(QUERIES), "a ledger class per dialect"


def ledger_dialect(db: Database) -> LedgerDialect:
    """The ledger's class for ``db``'s dialect, with that dialect's statements."""
    return _BY_DIALECT[db.dialect]


def _rows_autocommit(db: Database, sql: Sql, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    with connect(db) as conn:
        return conn.rows(sql, params)


def _retry_deadlock(fn: Callable[[], T], tries: int = 5) -> T:
    """Run one autocommit statement again if Postgres rolled it back to break a deadlock (two
    batches, or a batch and a stale owner, waiting on each other's rows): nothing of it stayed."""
    for attempt in range(tries):
        try:
            return fn()
        except Exception as exc:
            cause = exc.__cause__ if exc.__cause__ is not None else exc
            if attempt == tries - 1 or not (is_deadlock(exc) or is_deadlock(cause)):
                raise
            time.sleep(0.005 * (attempt + 1))
    raise AssertionError("unreachable")
