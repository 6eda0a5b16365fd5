"""One fencing mechanism: a write carries a :class:`Fence` (scope, token), and the database
accepts it only if no higher token of that scope has written, in the write's own transaction.

A holder can lose its right to write while it still runs (a GC pause, SIGSTOP, a slow disk):
an idempotency claim's lease runs out and the key is taken over, or a lock's TTL runs out and
the resource is granted to another. Neither the claim nor the lock can stop that holder's next
write; the database can. Both hand out tokens that only grow, so both are one :class:`Fence`:

- the claim's: scope the idempotency key, token the ledger's fence (it grows with every
  takeover, so the claim is the lock of its intent): :meth:`Fence.of_claim`;
- the lock's: scope the resource a job type declares exclusive (``Running.exclusive``), token
  the lock's fence (``RedisLock.fence``, ``DbLock.fence``): :meth:`Fence.of_lock`.

A handler writes with the one fence its :class:`engine.context.JobContext` gives
(``ctx.write_fence``): the lock's when its job type declares a resource, else the claim's.

The check is one rule, recorded in one of two places. :func:`fenced` (and
:func:`fenced_write`, which spells the fence out) records the highest token per scope in
``fence_registry``: its transaction's first statement is a conditional
upsert that applies only when the token is above the highest the scope has seen, or equal to it
from the holder recorded with it; the business write then goes on the yielded connection, so
it commits only if the fence held. :func:`fenced_update` is the same rule kept on a business row
that is its own scope (``orders.payment_fence`` for the key ``payment:{order_id}``): the
``UPDATE`` applies only while the row's fence is not above the caller's, and records it; an
equal token passes without a holder there, since that scope's tokens come from one ledger row,
which never hands one out twice.

Timeline of the race it stops::

    t=0    A holds R (fence 7), starts work, is stopped (SIGSTOP / GC pause)
    t=30   R's TTL (or lease) runs out; B is granted R (fence 8) and writes: highest = 8
    t=31   B commits; A resumes and writes R with fence 7 -> 7 < 8: rejected, counted,
           FencedWriteRejected raised; nothing of A's transaction is committed

Guarantees (SQLite and Postgres): the check and the business write commit together or not at
all; on Postgres the registry row stays locked until commit, so a concurrent older holder waits
and is then rejected. An equal token passes only for the holder recorded with it (one holder may
write many times): two holders handed the same token, which a Redis that lost recent writes
could once do, cannot both write::

    t=0    A acquires L (fence 7, token a), stalls; Redis restarts from an older snapshot
    t=5    a broken counter hands B fence 7 too (token b); B writes R: (7, b) recorded
    t=6    A wakes and writes R with (7, a): equal fence, other holder -> rejected

A write without a holder never matches the recorded one, so it passes only with a token above
the highest. A scope must be fenced by one source of tokens: a lock's tokens and a claim's are
not comparable, which is why a job type writes with exactly one of them. Rejections are counted
in ``fence_registry.rejected`` by a separate statement, so the count survives the rollback.
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


@dataclass(frozen=True)
class Fence:
    """What a write is fenced with: ``token`` from the source that grants ``scope`` (a claim
    of an idempotency key, or a lock of a resource), and ``holder``, that grant's owner token
    (an equal token passes only for it)."""

    scope: str
    token: int
    holder: str | None = None

    @classmethod
    def of_claim(cls, claim: Any) -> Fence:
        """A claim's fence: scope its key, token its ledger fence, holder its owner token."""
        return cls(claim.key, _fence_of(claim), getattr(claim, "owner_token", None))

    @classmethod
    def of_lock(cls, lock: Any, scope: str | None = None) -> Fence:
        """A held lock's fence: scope ``scope`` (default the lock's name), holder its token."""
        return cls(scope or lock.name, _fence_of(lock), _holder_of(lock, None))


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
def fenced(
    db: Database,
    fence: Fence,
    *,
    observer: LockObserver | None = None,
    clock: Callable[[], float] = time.time,
) -> Iterator[Connection]:
    """Yield a connection inside a transaction that commits only if ``fence`` is current for
    its scope: the one check every fenced write goes through (the module docstring).

    Raises :class:`FencedWriteRejected` (nothing committed) when the scope has seen a larger
    token, or the same token from another holder. An exception in the body rolls everything
    back, the registry advance included.
    """
    params = {"resource": fence.scope, "fence": fence.token, "holder": fence.holder,
              "now": clock()}
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
        counted = conn.execute(_COUNT_REJECTION, {"resource": fence.scope}).first()
    highest = int(counted[0]) if counted is not None else None
    log.warning(
        "fenced write rejected",
        extra={"resource": fence.scope, "fence": fence.token, "highest_fence": highest},
    )
    if observer is not None:
        observer.record("fenced_rejected", fence.scope)
    raise FencedWriteRejected(fence.scope, fence.token, highest)


def fenced_write(
    db: Database,
    resource: str,
    fence: int | Any,
    *,
    holder: str | None = None,
    observer: LockObserver | None = None,
    clock: Callable[[], float] = time.time,
) -> contextlib.AbstractContextManager[Connection]:
    """:func:`fenced` with the fence spelled out: scope ``resource``, token ``fence`` (an int
    or a held lock, whose owner token is the ``holder`` unless one is given)."""
    return fenced(db, Fence(resource, _fence_of(fence), _holder_of(fence, holder)),
                  observer=observer, clock=clock)


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
    fence: int | Fence,
    assignments: str,
    params: dict[str, Any] | None = None,
) -> None:
    """``UPDATE`` of the row whose ``column`` is ``value`` that applies only if no newer holder
    has written it (``fence_column <= fence``), and records ``fence`` there: the check of
    :func:`fenced` kept on a business row that is its fence's scope. A stale holder gets
    :class:`FencedWriteRejected` and changes nothing. ``table``, the columns and
    ``assignments`` are code (never input); the values are bound."""
    fence = fence.token if isinstance(fence, Fence) else fence
    names = {"table": table, "column": column, "fence_column": fence_column,
             "assignments": assignments}
    rowcount = conn.execute(text(_Q["fenced_row_update"].format(**names)),
                            {**(params or {}), "v": value, "fence": fence}).rowcount
    if rowcount != 1:
        highest = conn.execute(text(_Q["row_fence"].format(**names)), {"v": value}).scalar()
        raise FencedWriteRejected(f"{table}:{value}", fence, highest)
