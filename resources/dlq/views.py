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
from pathlib import Path
from typing import Any

from sqlalchemy import bindparam, text
from sqlalchemy.engine import Connection

from resources.dlq.records import (
    DEDUPE_KEY_BYTES,
    MARK_WINDOW,
    UNRESOLVED,
    DlqRecord,
    DlqRecordNotFound,
    DlqStatus,
    dlq_records,
)
from resources.storage.db import Database
from resources.storage.json_text import storable_key
from resources.storage.queries import filled_queries, load_dialect_queries, load_queries

Clock = Callable[[], float]

_QUERY_FILE = Path(__file__).with_name("queries.sql")
QUERIES = {dialect: filled_queries(queries, columns=[c.name for c in dlq_records.c])
           for dialect, queries in load_dialect_queries(_QUERY_FILE).items()}
"""The DLQ's named statements per dialect (a record's columns named once, by the table);
only this package reads them."""
_CONDITIONS = load_queries(_QUERY_FILE)
_UNRESOLVED_SQL = ", ".join(f"'{s}'" for s in UNRESOLVED)


class DlqViews:
    """Reads of the DLQ over a :class:`Database`. Thread-safe; share one per process."""

    def __init__(self, db: Database, *, clock: Clock = time.time) -> None:
        self.db = db
        self.clock = clock
        self._q = QUERIES[db.dialect]

    def get(self, record_id: int) -> DlqRecord:
        with self.db.statement() as conn:
            row = conn.execute(text(self._q["record_by_id"]), {"id": record_id}).first()
        if row is None:
            raise DlqRecordNotFound(record_id)
        return DlqRecord.from_row(row)

    def find(self, dedupe_key: str) -> DlqRecord | None:
        with self.db.statement() as conn:
            key = storable_key(dedupe_key, DEDUPE_KEY_BYTES)
            row = conn.execute(text(self._q["record_by_key"]), {"k": key}).first()
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
            column = self.db.sql_dialect.along_key("status") if scan_ids else "status"
            where.append(f"{column} IN :statuses")
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
        sql = self._q["select_records"].format(
            where=" AND ".join(where) or self._q["match_all"],
            order=" ORDER BY id" if by_id else "",
            limit=f" LIMIT {int(limit)}" if limit is not None else "",
        )
        stmt = text(sql)
        if expanding:
            stmt = stmt.bindparams(*(bindparam(n, expanding=True) for n in expanding))
        with self.db.statement() as conn:
            return [DlqRecord.from_row(r) for r in conn.execute(stmt, params)]

    @staticmethod
    def statuses_of_key(conn: Connection, key: str) -> set[str]:
        """The statuses of the records naming idempotency key ``key``, read in the caller's
        transaction."""
        return {str(r.status) for r in conn.execute(
            text(QUERIES[conn.dialect.name]["statuses_of_key"]), {"k": key})}

    def records_of_run(self, run_id: str) -> list[DlqRecord]:
        """The records a run's failures were counted on (each written or updated where its
        failure was decided), by id."""
        with self.db.statement() as conn:
            rows = conn.execute(text(self._q["records_of_run"]), {"run": run_id}).all()
        return [DlqRecord.from_row(r) for r in rows]

    def audit(self, record_id: int) -> list[dict[str, Any]]:
        with self.db.statement() as conn:
            rows = conn.execute(text(self._q["audit_of"]), {"id": record_id}).all()
        return [dict(r._mapping) for r in rows]

    def failures(self, record_id: int) -> list[str]:
        """The run ids that failed for this record, each once."""
        with self.db.statement() as conn:
            rows = conn.execute(text(self._q["failures_of"]), {"id": record_id})
            return [r.run_id for r in rows]

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
                text(self._q["key_page"]).bindparams(bindparam("statuses", expanding=True)),
                {"statuses": [str(s) for s in statuses], "after": after_id,
                 "hi": after_id + window, "limit": limit},
            ).all()
            if len(rows) >= limit:
                following = int(rows[-1].id)
            else:
                newest = conn.execute(text(self._q["newest_id"])).scalar() or 0
                following = after_id + window if after_id + window < int(newest) else 0
        return [(int(r.id), r.idempotency_key) for r in rows], following

    def tally(self, statuses: Iterable[str]) -> dict[tuple[str, str], int]:
        """How many records there are per (status, class) among ``statuses``: one grouped count
        in the database (the covering index ``dlq_records_status_class``), a few rows back."""
        with self.db.statement() as conn:
            rows = conn.execute(
                text(self._q["tally"]).bindparams(bindparam("statuses", expanding=True)),
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
            row = conn.execute(text(self._q["change_mark"]), {"w": MARK_WINDOW}).one()
        return int(row[0]) * (MARK_WINDOW + 1) + int(row[1])

    def counts(self) -> dict[str, int]:
        with self.db.statement() as conn:
            rows = conn.execute(text(self._q["counts"])).all()
        out = {str(s): 0 for s in DlqStatus}
        out.update({r.status: int(r.n) for r in rows})
        return out

    def open_by_class(self) -> dict[str, int]:
        """How many records are not yet resolved or discarded, per error class."""
        with self.db.statement() as conn:
            rows = conn.execute(text(self._q["open_by_class"])).all()
        return {str(r.error_class): int(r.n) for r in rows}

    def inflow_by_class(self, since: float) -> dict[str, int]:
        """How many records first failed at or after ``since``, per error class."""
        with self.db.statement() as conn:
            rows = conn.execute(text(self._q["inflow_by_class"]), {"since": since}).all()
        return {str(r.error_class): int(r.n) for r in rows}

    def inflow_between(self, start: float, end: float | None = None) -> int:
        """How many records first failed at or after ``start`` (and before ``end``)."""
        name, params = (("inflow_since", {"start": start}) if end is None else
                        ("inflow_between", {"start": start, "end": end}))
        with self.db.statement() as conn:
            return int(conn.execute(text(self._q[name]), params).scalar_one())

    @staticmethod
    def unresolved_key_reference(column: str) -> str:
        """SQL, true while an unresolved record (open, replay requested, replaying) names the
        idempotency key in ``column``: a replay may still run under that key."""
        return _CONDITIONS["unresolved_key_reference"].format(
            column=column, unresolved=_UNRESOLVED_SQL)

    @staticmethod
    def unresolved_request_reference(column: str) -> str:
        """SQL, true while an unresolved record holds the request whose id is in ``column``."""
        return _CONDITIONS["unresolved_request_reference"].format(
            column=column, unresolved=_UNRESOLVED_SQL)

    @staticmethod
    def request_reference(column: str) -> str:
        """SQL, true when any record (whatever its status) holds the request in ``column``."""
        return _CONDITIONS["request_reference"].format(column=column)

    def at_retention_risk(self, limit_seconds: float, warn_before: float) -> list[DlqRecord]:
        """Unresolved records that a retention limit of ``limit_seconds`` (counted from the first
        failure: Dagster's run storage, the idempotency reaper) reaches within ``warn_before``."""
        cutoff = self.clock() - (limit_seconds - warn_before)
        return [
            r
            for r in self.list_records(status=["open", "replay_requested", "replaying"])
            if r.first_failed_at <= cutoff
        ]


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
