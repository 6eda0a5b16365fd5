"""The database lock: a lease row on SQLite and Postgres, or a row lock inside a transaction."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from sqlalchemy import BigInteger, Column, Float, Table, Text, bindparam, text
from sqlalchemy.engine import Connection, Engine

from resources.errors import LockNotAcquired
from resources.locks.base import BaseLock
from resources.locks.stats import LockObserver
from resources.storage.db import Database, metadata
from resources.storage.queries import identifier, load_dialect_queries, load_queries

log = logging.getLogger(__name__)
Clock = Callable[[], float]

# -- database -------------------------------------------------------------------------------

lock_leases = Table(
    "lock_leases",
    metadata,
    Column("name", Text, primary_key=True),
    Column("owner_token", Text),
    Column("expires_at", Float),
    Column("fence", BigInteger, nullable=False),
    Column("acquired_at", Float),
    Column("updated_at", Float, nullable=False),
)

_QUERY_FILE = Path(__file__).with_suffix(".sql")
_Q = load_queries(_QUERY_FILE)
_DIALECT_Q = load_dialect_queries(_QUERY_FILE)
_DB_ACQUIRE = text(_Q["acquire"])
_DB_EXTEND = text(_Q["extend"])
_DB_RELEASE = text(_Q["release"])
_DB_OWNER = text(_Q["owner"])



class DbLock(BaseLock):
    """A lease row in the app database: same shape as :class:`RedisLock`, no Redis needed.

    Acquire is one conditional upsert on ``lock_leases`` (insert, or take over a released or
    expired lease; the fence grows by one) on SQLite and Postgres alike. Release clears the
    owner but keeps the row, so the fence never goes back. Waiters poll with capped, jittered
    backoff (2 ms to 100 ms, never past the holder's expiry): the database has no wake-up list.

    Expiry is judged with ``clock`` (wall time, injected for tests): workers' clocks must agree
    to well within the TTL. For a lock that must last exactly as long as a transaction, use
    :meth:`transactional` instead.
    """

    def __init__(
        self,
        engine: Engine | Database,
        name: str,
        *,
        ttl: float,
        auto_renew: bool = True,
        blocking_timeout: float | None = None,
        max_hold: float | None = None,
        observer: LockObserver | None = None,
        clock: Clock = time.time,
    ) -> None:
        super().__init__(
            name,
            ttl=ttl,
            auto_renew=auto_renew,
            blocking_timeout=blocking_timeout,
            max_hold=max_hold,
            observer=observer,
        )
        self.db = engine if isinstance(engine, Database) else Database(engine)
        self.clock = clock
        self._backoff = 0.002

    def _try_acquire(self, token: str, enqueue: bool) -> tuple[int | None, float | None]:
        now = self.clock()
        with self.db.statement() as conn:
            row = conn.execute(
                _DB_ACQUIRE,
                {"name": self.name, "token": token, "expires": now + self.ttl, "now": now},
            ).first()
            if row is not None:
                self._backoff = 0.002
                return int(row[0]), None
            current = conn.execute(_DB_OWNER, {"name": self.name}).first()
        hint = self._backoff * (0.5 + random.random())
        self._backoff = min(self._backoff * 2, 0.1)
        if current is not None and current.expires_at is not None:
            hint = min(hint, max(0.001, float(current.expires_at) - now))
        return None, hint

    def _wait(self, token: str, seconds: float) -> None:
        time.sleep(seconds)

    def _extend_remote(self, token: str) -> bool:
        now = self.clock()
        with self.db.statement() as conn:
            result = conn.execute(
                _DB_EXTEND,
                {"name": self.name, "token": token, "expires": now + self.ttl, "now": now},
            )
            return bool(result.rowcount == 1)

    def _release_remote(self, token: str) -> bool:
        with self.db.statement() as conn:
            result = conn.execute(
                _DB_RELEASE, {"name": self.name, "token": token, "now": self.clock()}
            )
            return bool(result.rowcount == 1)

    def release_token(self, token: str) -> bool:
        """Release with an explicit token; True only if ``token`` held the lease."""
        return self._release_remote(token)

    def _read_owner(self) -> str | None:
        with self.db.statement() as conn:
            row = conn.execute(_DB_OWNER, {"name": self.name}).first()
        if row is None or row.owner_token is None:
            return None
        if row.expires_at is not None and float(row.expires_at) <= self.clock():
            return None
        return str(row.owner_token)

    def __enter__(self) -> DbLock:
        self.acquire()
        return self

    @staticmethod
    def transactional(conn: Connection, name: str, *, clock: Clock = time.time) -> int:
        """Lock ``name`` until the caller's transaction ends; return a fresh fencing token.

        It is the lease upsert run inside your transaction: on Postgres the row lock it takes
        (``FOR UPDATE`` semantics) holds until COMMIT or ROLLBACK, so a second caller waits in
        its own upsert and then proceeds; nothing outlives the transaction, which makes it safe
        under PgBouncer transaction pooling. On SQLite the transaction's ``BEGIN IMMEDIATE``
        already serialises writers; this adds the fence. A live :class:`DbLock` lease on the
        same name wins: then :class:`LockNotAcquired` is raised (waited 0).
        """
        now = clock()
        row = conn.execute(
            _DB_ACQUIRE, {"name": name, "token": None, "expires": None, "now": now}
        ).first()
        if row is None:
            raise LockNotAcquired(name, 0.0)
        return int(row[0])


def lock_row(conn: Connection, table: str, key_column: str, key: Any) -> Any:
    """Lock one business row for the rest of the caller's transaction and return it.

    ``SELECT ... FOR UPDATE`` on Postgres; on SQLite the transaction's ``BEGIN IMMEDIATE``
    already holds the write lock, so this is a plain read. Returns None when the row is absent
    (nothing is locked then: insert it with a unique key instead).
    """
    statement = _DIALECT_Q[conn.dialect.name]["lock_row"].format(
        **_identifiers(table, key_column))
    return conn.execute(text(statement), {"key": key}).first()


def lock_rows(conn: Connection, table: str, key_column: str, keys: Iterable[Any]) -> list[Any]:
    """:func:`lock_row` for several rows, in ``key_column`` order: a transaction that locks
    several business rows takes them up front and in one order, so two such transactions never
    deadlock. Returns the rows found (none locked for an absent key)."""
    wanted = sorted(set(keys))
    if not wanted:
        return []
    statement = _DIALECT_Q[conn.dialect.name]["lock_rows"].format(
        **_identifiers(table, key_column))
    return list(conn.execute(text(statement).bindparams(bindparam("keys", expanding=True)),
                             {"keys": wanted}))


def _identifiers(table: str, key_column: str) -> dict[str, str]:
    return {"table": identifier(table), "key_column": identifier(key_column)}


