"""Fenced writes: a stale lock holder's write is rejected by the database, not by hope.

A lock can expire while its holder still runs (a GC pause, SIGSTOP, a slow disk). The lock alone
cannot stop that holder's next write; the database can. Every lock grant carries a fencing token
that only grows (``RedisLock.fence``, ``DbLock.fence``); :func:`fenced_write` opens a transaction
whose first statement is a conditional upsert on ``fence_registry``: it applies only when the
caller's token is above the highest token this resource has seen, or equal to it and the caller
is the holder recorded with it. The business write then goes on the yielded connection, in the
same transaction, so it commits only if the fence held.

Timeline of the race it stops::

    t=0    A acquires lock L (fence 7), starts work, is stopped (SIGSTOP / GC pause)
    t=30   L's TTL runs out; B acquires L (fence 8) and writes resource R: highest_fence = 8
    t=31   B commits; A resumes and writes R with fence 7 -> 7 < 8: rejected, counted,
           FencedWriteRejected raised; nothing of A's transaction is committed

Guarantees (SQLite and Postgres): the check and the business write commit together or not at
all; on Postgres the registry row stays locked until commit, so a concurrent older holder waits
and is then rejected. An equal token passes only for the holder recorded with it (one holder may
write many times; a held lock passes its owner token as the holder): two holders handed the same
token, which a Redis that lost recent writes could once do, cannot both write::

    t=0    A acquires L (fence 7, token a), stalls; Redis restarts from an older snapshot
    t=5    a broken counter hands B fence 7 too (token b); B writes R: (7, b) recorded
    t=6    A wakes and writes R with (7, a): equal fence, other holder -> rejected

The same check kept on the business row itself is :func:`fenced_update`: the row carries the
highest fence that wrote it (``orders.payment_fence``), and an ``UPDATE`` applies only while the
caller's fence is not below it. Job types write with their claim's fence this way (the ledger's
fence grows with every takeover, so the claim is the lock); :func:`fenced_write` is for a
resource guarded by a lock of its own (``RedisLock``, ``DbLock``), whose tokens are recorded
here.

A write without a holder (a bare int) never matches the recorded one, so it passes only with a
token above the highest. A resource must be guarded by one lock name: tokens of different locks
are not comparable. Rejections are counted in ``fence_registry.rejected`` by a separate
statement, so the count survives the rollback.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import BigInteger, Column, Float, Table, Text, text
from sqlalchemy.engine import Connection

from resources.errors import FencedWriteRejected
from resources.locks.stats import LockObserver
from resources.storage.db import Database, metadata
from resources.storage.queries import load_queries

log = logging.getLogger(__name__)

fence_registry = Table(
    "fence_registry",
    metadata,
    Column("resource", Text, primary_key=True),
    Column("highest_fence", BigInteger, nullable=False),
    Column("rejected", BigInteger, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("holder", Text),
)

_Q = load_queries(Path(__file__).with_suffix(".sql"))
_ADVANCE = text(_Q["advance"])
_COUNT_REJECTION = text(_Q["count_rejection"])


@dataclass(frozen=True)
class FenceStatus:
    """What the registry knows of a resource: the highest token seen and how many were refused."""

    resource: str
    highest_fence: int
    rejected: int


class _Rejected(Exception):
    """Internal: rolls the transaction back before the rejection is counted."""


def _fence_of(fence: int | Any) -> int:
    value = getattr(fence, "fence", fence)
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"fence must be an int or a held lock, not {type(fence).__name__}")
    return value


def _holder_of(fence: int | Any, holder: str | None) -> str | None:
    if holder is not None:
        return holder
    token = getattr(fence, "token", None)
    return token if isinstance(token, str) else None


@contextlib.contextmanager
def fenced_write(
    db: Database,
    resource: str,
    fence: int | Any,
    *,
    holder: str | None = None,
    observer: LockObserver | None = None,
    clock: Callable[[], float] = time.time,
) -> Iterator[Connection]:
    """Yield a connection inside a transaction that commits only if ``fence`` is current.

    ``fence`` is an int or a held lock (its ``.fence`` is used, and its owner token is the
    ``holder`` unless one is given). Raises :class:`FencedWriteRejected` (nothing committed) when
    the resource has seen a larger token, or the same token from another holder. An exception in
    the body rolls everything back, the registry advance included.
    """
    token = _fence_of(fence)
    params = {
        "resource": resource, "fence": token, "holder": _holder_of(fence, holder), "now": clock()
    }
    try:
        with db.transaction() as conn:
            row = conn.execute(_ADVANCE, params).first()
            if row is None:
                raise _Rejected()
            yield conn
        return
    except _Rejected:
        pass
    with db.statement() as conn:
        counted = conn.execute(_COUNT_REJECTION, {"resource": resource}).first()
    highest = int(counted[0]) if counted is not None else None
    log.warning(
        "fenced write rejected",
        extra={"resource": resource, "fence": token, "highest_fence": highest},
    )
    if observer is not None:
        observer.record("fenced_rejected", resource)
    raise FencedWriteRejected(resource, token, highest)


def fence_status(db: Database, resource: str) -> FenceStatus | None:
    """The registry row of ``resource``, or ``None`` if no fenced write ever reached it."""
    with db.statement() as conn:
        row = conn.execute(
            text(_Q["status"]),
            {"resource": resource},
        ).first()
    if row is None:
        return None
    return FenceStatus(row.resource, int(row.highest_fence), int(row.rejected))


def fenced_update(
    conn: Connection,
    table: str,
    column: str,
    value: str,
    *,
    fence_column: str,
    fence: int,
    assignments: str,
    params: dict[str, Any] | None = None,
) -> None:
    """``UPDATE`` of the row whose ``column`` is ``value`` that applies only if no newer holder
    has written it (``fence_column <= fence``), and records ``fence`` there; a stale holder gets
    :class:`FencedWriteRejected` and changes nothing. ``table``, the columns and
    ``assignments`` are code (never input); the values are bound."""
    names = {"table": table, "column": column, "fence_column": fence_column,
             "assignments": assignments}
    rowcount = conn.execute(text(_Q["fenced_row_update"].format(**names)),
                            {**(params or {}), "v": value, "fence": fence}).rowcount
    if rowcount != 1:
        highest = conn.execute(text(_Q["row_fence"].format(**names)), {"v": value}).scalar()
        raise FencedWriteRejected(f"{table}:{value}", fence, highest)
