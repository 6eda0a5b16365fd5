"""What the DLQ holds, as its readers see it: records by id, key, run or filter, their
audit trail and failures, the pages and tallies a sensor tick reads, the mark that says whether
anything changed, and SQL conditions other stores' retention uses to keep what a record still
needs. Reads only: every write is :class:`resources.dlq.store.DlqStore`'s, which extends
:class:`DlqViews`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from typing import Any

from sqlalchemy import bindparam, text
from sqlalchemy.engine import Connection

from resources.dlq.records import (
    COLUMNS,
    DEDUPE_KEY_BYTES,
    MARK_WINDOW,
    UNRESOLVED,
    DlqRecord,
    DlqRecordNotFound,
    DlqStatus,
)
from resources.storage.db import Database
from resources.storage.json_text import storable_key

Clock = Callable[[], float]

_UNRESOLVED_SQL = ", ".join(f"'{s}'" for s in UNRESOLVED)


class DlqViews:
    """Reads of the DLQ over a :class:`Database`. Thread-safe; share one per process."""

    def __init__(self, db: Database, *, clock: Clock = time.time) -> None:
        self.db = db
        self.clock = clock

    def get(self, record_id: int) -> DlqRecord:
        with self.db.statement() as conn:
            row = self._select(conn, "id = :id", {"id": record_id}, lock=False)
        if row is None:
            raise DlqRecordNotFound(record_id)
        return DlqRecord.from_row(row)

    def find(self, dedupe_key: str) -> DlqRecord | None:
        with self.db.statement() as conn:
            key = storable_key(dedupe_key, DEDUPE_KEY_BYTES)
            row = self._select(conn, "dedupe_key = :k", {"k": key}, lock=False)
        return None if row is None else DlqRecord.from_row(row)

    def list_records(
        self,
        *,
        status: Iterable[str] | str | None = None,
        job_type: str | None = None,
        error_class: str | None = None,
        fingerprint: str | None = None,
        older_than: float | None = None,
        newer_than: float | None = None,
        ids: Iterable[int] | None = None,
        request_id: int | None = None,
        limit: int | None = None,
        after_id: int | None = None,
        error_classes: Iterable[str] | None = None,
        by_id: bool = True,
        scan_ids: bool = False,
    ) -> list[DlqRecord]:
        """Records matching every filter given, by id; ages are seconds since the last failure.
        ``after_id`` with ``limit`` reads one page (ids above it): what a sensor tick reads.
        ``by_id=False``: in whatever order an index gives (a few matches of a large set, no
        sort). ``scan_ids``: read along the primary key, checking the status row by row (the
        first ``limit`` of a status most records have, without sorting all of them)."""
        where: list[str] = []
        params: dict[str, Any] = {}
        expanding: list[str] = []
        if after_id is not None:
            where.append("id > :after_id")
            params["after_id"] = int(after_id)
        if error_classes is not None:
            where.append("error_class IN :classes")
            params["classes"] = [str(c) for c in error_classes] or ["-"]
            expanding.append("classes")
        if status is not None:
            where.append(f"{self._by_id('status') if scan_ids else 'status'} IN :statuses")
            params["statuses"] = [status] if isinstance(status, str) else [str(s) for s in status]
            expanding.append("statuses")
        if ids is not None:
            where.append("id IN :ids")
            params["ids"] = [int(i) for i in ids] or [-1]
            expanding.append("ids")
        for column, value in (
            ("job_type", job_type),
            ("error_class", error_class),
            ("fingerprint", fingerprint),
            ("request_id", request_id),
        ):
            if value is not None:
                where.append(f"{column} = :{column}")
                params[column] = value
        now = self.clock()
        if older_than is not None:
            where.append("last_failed_at <= :old")
            params["old"] = now - older_than
        if newer_than is not None:
            where.append("last_failed_at >= :new")
            params["new"] = now - newer_than
        sql = f"SELECT {COLUMNS} FROM dlq_records"  # nosec B608: SQL from code constants, values bound
        if where:
            sql += " WHERE " + " AND ".join(where)
        if by_id:
            sql += " ORDER BY id"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        stmt = text(sql)
        if expanding:
            stmt = stmt.bindparams(*(bindparam(n, expanding=True) for n in expanding))
        with self.db.statement() as conn:
            return [DlqRecord.from_row(r) for r in conn.execute(stmt, params)]

    def records_of_run(self, run_id: str) -> list[DlqRecord]:
        """The records a run's failures were counted on (each written or updated where its
        failure was decided), by id."""
        with self.db.statement() as conn:
            rows = conn.execute(
                text(f"SELECT {COLUMNS} FROM dlq_records WHERE id IN"  # nosec B608: SQL from code constants, values bound
                     " (SELECT record_id FROM dlq_failures WHERE run_id = :run) ORDER BY id"),
                {"run": run_id},
            ).all()
        return [DlqRecord.from_row(r) for r in rows]

    def audit(self, record_id: int) -> list[dict[str, Any]]:
        with self.db.statement() as conn:
            rows = conn.execute(
                text(
                    "SELECT action, actor, from_status, to_status, detail, at FROM dlq_audit"
                    " WHERE record_id = :id ORDER BY id"
                ),
                {"id": record_id},
            ).all()
        return [dict(r._mapping) for r in rows]

    def failures(self, record_id: int) -> list[str]:
        """The run ids that failed for this record, each once."""
        with self.db.statement() as conn:
            return [
                r.run_id
                for r in conn.execute(
                    text("SELECT run_id FROM dlq_failures WHERE record_id = :id ORDER BY seen_at"),
                    {"id": record_id},
                )
            ]

    def key_page(
        self, statuses: Iterable[str], *, after_id: int, limit: int, window: int = 10_000
    ) -> tuple[list[tuple[int, str | None]], int]:
        """``(id, idempotency_key)`` of the records in ``statuses`` among the ids above
        ``after_id`` and at most ``window`` past it, by id, at most ``limit``: one page without
        the records' bodies, read along the primary key (at most ``window`` rows examined,
        whatever the table holds). Returns the page and where the next one starts (0: the
        oldest again)."""
        with self.db.statement() as conn:
            rows = conn.execute(
                text(
                    "SELECT id, idempotency_key FROM dlq_records WHERE id > :after"
                    f" AND id <= :hi AND {self._by_id('status')} IN :statuses"
                    " ORDER BY id LIMIT :limit"  # nosec B608: SQL from code constants, values bound
                ).bindparams(bindparam("statuses", expanding=True)),
                {"statuses": [str(s) for s in statuses], "after": after_id,
                 "hi": after_id + window, "limit": limit},
            ).all()
            if len(rows) >= limit:
                following = int(rows[-1].id)
            else:
                newest = conn.execute(text("SELECT MAX(id) FROM dlq_records")).scalar() or 0
                following = after_id + window if after_id + window < int(newest) else 0
        return [(int(r.id), r.idempotency_key) for r in rows], following

    def _by_id(self, column: str) -> str:
        """``column`` as a condition SQLite checks row by row along the primary key instead of
        through an index on it (which would read every match, then sort by id)."""
        return column if self.db.is_postgres else f"+{column}"

    def tally(self, statuses: Iterable[str]) -> dict[tuple[str, str], int]:
        """How many records there are per (status, class) among ``statuses``: one grouped count
        in the database (the covering index ``dlq_records_status_class``), a few rows back."""
        with self.db.statement() as conn:
            rows = conn.execute(
                text(
                    "SELECT status, error_class, COUNT(*) AS n FROM dlq_records"
                    " WHERE status IN :statuses GROUP BY status, error_class"
                ).bindparams(bindparam("statuses", expanding=True)),
                {"statuses": [str(s) for s in statuses]},
            ).all()
        return {(str(r.status), str(r.error_class)): int(r.n) for r in rows}

    def change_mark(self) -> int:
        """A number that changes whenever a record is written (every write of this store adds
        an audit line); 0 when none.

        Not the newest audit id alone: on Postgres ids are taken at insert and rows appear at
        commit, so a write can become visible after a newer one was read::

            T1 inserts audit N (uncommitted)    T2 inserts N+1, commits
            reader: MAX = N+1, publishes        T1 commits: MAX still N+1, nothing moves

        The mark is ``MAX * (W + 1) + rows among the newest W ids`` (W = :data:`MARK_WINDOW`):
        T1's commit adds a row inside the window, so the mark moves. Bounded work (a range of
        W ids on the primary key); a write in flight while W newer ones commit is still missed
        until the next write."""
        with self.db.statement() as conn:
            row = conn.execute(
                text(
                    "SELECT m.top, (SELECT COUNT(*) FROM dlq_audit WHERE id > m.top - :w)"
                    " FROM (SELECT COALESCE(MAX(id), 0) AS top FROM dlq_audit) m"
                ),
                {"w": MARK_WINDOW},
            ).one()
        return int(row[0]) * (MARK_WINDOW + 1) + int(row[1])

    def counts(self) -> dict[str, int]:
        with self.db.statement() as conn:
            rows = conn.execute(
                text("SELECT status, COUNT(*) AS n FROM dlq_records GROUP BY status")
            ).all()
        out = {str(s): 0 for s in DlqStatus}
        out.update({r.status: int(r.n) for r in rows})
        return out

    @staticmethod
    def unresolved_key_reference(column: str) -> str:
        """SQL, true while an unresolved record (open, replay requested, replaying) names the
        idempotency key in ``column``: a replay may still run under that key."""
        return (
            "EXISTS (SELECT 1 FROM dlq_records d WHERE d.idempotency_key = "
            f"{column} AND d.status IN ({_UNRESOLVED_SQL}))"  # nosec B608: SQL from code constants, values bound
        )

    @staticmethod
    def unresolved_request_reference(column: str) -> str:
        """SQL, true while an unresolved record holds the request whose id is in ``column``."""
        return (
            "EXISTS (SELECT 1 FROM dlq_records d WHERE d.request_id = "
            f"{column} AND d.status IN ({_UNRESOLVED_SQL}))"  # nosec B608: SQL from code constants, values bound
        )

    @staticmethod
    def request_reference(column: str) -> str:
        """SQL, true when any record (whatever its status) holds the request in ``column``."""
        return f"EXISTS (SELECT 1 FROM dlq_records d WHERE d.request_id = {column})"  # nosec B608: SQL from code constants, values bound

    def at_retention_risk(self, limit_seconds: float, warn_before: float) -> list[DlqRecord]:
        """Unresolved records that a retention limit of ``limit_seconds`` (counted from the first
        failure: Dagster's run storage, the idempotency reaper) reaches within ``warn_before``."""
        cutoff = self.clock() - (limit_seconds - warn_before)
        return [
            r
            for r in self.list_records(status=["open", "replay_requested", "replaying"])
            if r.first_failed_at <= cutoff
        ]

    def _select(self, conn: Connection, where: str, params: dict[str, Any], *, lock: bool) -> Any:
        suffix = " FOR UPDATE" if lock and self.db.is_postgres else ""
        return conn.execute(
            text(f"SELECT {COLUMNS} FROM dlq_records WHERE {where}{suffix}"), params  # nosec B608: SQL from code constants, values bound
        ).first()


_AGE = re.compile(r"(\d{1,12}(?:\.\d{1,9})?) ?([smhdw]?)")
_AGE_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def parse_age(value: str | float | None) -> float | None:
    """``"90s"``, ``"15m"``, ``"2h"``, ``"3d"``, ``"1w"`` or seconds -> seconds."""
    if value is None or isinstance(value, (int, float)):
        return None if value is None else float(value)
    match = _AGE.fullmatch(value.strip()) if len(value) <= 64 else None  # bounded, then matched
    if not match:
        raise ValueError(f"age {value[:40]!r}: expected a number with s, m, h, d or w (e.g. 2h)")
    return float(match.group(1)) * _AGE_UNITS[match.group(2)]
