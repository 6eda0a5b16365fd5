"""What the ledger holds, as its readers see it: records by key, whether a live holder holds a
key, what retention would delete, and the SQL condition other stores' retention uses to keep
what an unfinished key still explains. Reads only, and retention's purge: every other write is
:class:`resources.idempotency.store.IdempotencyStore`'s, which extends :class:`LedgerViews`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta

from sqlalchemy import bindparam, text
from sqlalchemy.engine import Connection

from resources.idempotency.dialects import ledger_dialect
from resources.idempotency.records import CONDITIONS, QUERIES, Record, Status
from resources.storage import retention
from resources.storage.db import Database
from resources.storage.driver import connect

Clock = Callable[[], float]


class LedgerViews:
    """Reads of the ledger over a :class:`Database`. Thread-safe; share one per process."""

    def __init__(self, db: Database, *, clock: Clock = time.time) -> None:
        self.db = db
        self.clock = clock
        self._q = QUERIES[db.dialect]
        self._ledger = ledger_dialect(db)

    def get(self, key: str) -> Record | None:
        with connect(self.db) as conn:
            row = conn.row(self._ledger.sql("select_one"), {"key": key})
        return None if row is None else Record.from_row(row)

    def records(self, keys: Sequence[str], *, status: Status | None = None) -> dict[str, Record]:
        """The records of ``keys`` (those in ``status`` if given), by key; absent keys are left
        out. Reads 500 keys per statement."""
        name = "records" if status is None else "records_in_status"
        out: dict[str, Record] = {}
        for i in range(0, len(keys), 500):
            with self.db.statement() as conn:
                rows = conn.execute(
                    text(self._q[name]).bindparams(bindparam("keys", expanding=True)),
                    {"keys": list(keys[i : i + 500]), "status": str(status)},
                ).all()
            out.update({r.key: Record.from_row(r) for r in rows})
        return out

    @staticmethod
    def held(conn: Connection, key: str, now: float) -> bool:
        """Does a live holder hold ``key`` at ``now``: claimed (``in_progress``) under a lease
        not yet run out, read in the caller's transaction. Such a holder may still reach an
        effect, so what would end its intent (a cancel) must wait for it. Expiry is judged as
        a takeover judges it: a holder past its lease can no longer heartbeat its way back
        (its keeper stops at the expiry it last confirmed), and a takeover then finds the key
        claimable."""
        return conn.execute(
            text(QUERIES[conn.dialect.name]["held"]), {"key": key, "now": now}
        ).first() is not None

    @staticmethod
    def status_in(conn: Connection, key: str, *, lock: bool = False) -> str | None:
        """The status of ``key`` (None: no record), read in the caller's transaction; ``lock``:
        the record stays locked until it ends, so what the caller decides from the status
        holds when it writes."""
        name = "status_of_locked" if lock else "status_of"
        row = conn.execute(text(QUERIES[conn.dialect.name][name]), {"key": key}).first()
        return None if row is None else str(row.status)

    @staticmethod
    def unfinished_key_reference(column: str) -> str:
        """SQL, true while the key in ``column`` is claimed and not completed (in progress,
        retryable or failed): what its attempts and actions still explain."""
        return CONDITIONS["unfinished_key_reference"].format(column=column)

    # -- retention --------------------------------------------------------------------------

    def purge(
        self,
        older_than: float | timedelta | None = None,
        *,
        keep: Sequence[str] = (),
        include_failed: bool = False,
        batch_size: int = retention.BATCH_SIZE,
        max_batches: int = retention.MAX_BATCHES,
    ) -> int:
        """Delete completed records past retention; never in-progress ones, and failed or
        retryable ones only with ``include_failed``. Returns how many were deleted (in batches:
        :mod:`resources.storage.retention`).

        With ``older_than``, also completed records last updated before ``now - older_than``,
        and with ``include_failed`` failed and retryable ones too (a failure nothing will
        retry or replay any more; absent, the key reads as given up, as a failed one does).
        ``keep`` holds SQL conditions over ``idempotency_records.key`` that keep a record
        (written by the owners of what references a key: an open DLQ record, an unfinished
        request), so a key that an unresolved failure may still replay is never forgotten.
        """
        return self.expired(older_than, keep=keep, include_failed=include_failed).purge(
            self.db, batch_size=batch_size, max_batches=max_batches
        )

    def expired(
        self,
        older_than: float | timedelta | None = None,
        *,
        keep: Sequence[str] = (),
        include_failed: bool = False,
    ) -> retention.Expiry:
        """What :meth:`purge` with the same arguments deletes now."""
        now = self.clock()
        params = {"now": now}
        condition = "expired"
        if older_than is not None:
            seconds = (
                older_than.total_seconds() if isinstance(older_than, timedelta) else older_than
            )
            params["cutoff"] = now - seconds
            condition = "expired_or_older_with_failed" if include_failed else "expired_or_older"
        return retention.Expiry.of(
            "idempotency_records", "key", CONDITIONS[condition], params, keep=keep
        )
