"""Bounded purges: what retention may delete, deleted a batch at a time.

Each table's owner states which of its rows have expired as an :class:`Expiry`: a ``WHERE``
over its own columns, including the conditions that keep a row still referenced by something
unresolved (written by the owners of the referencing tables, e.g.
``DlqStore.unresolved_key_reference``). Why batches: one ``DELETE`` of a month of attempts holds
its locks and grows the WAL for as long as it runs, and a schedule that fell behind would make
it worse. A batch is one short transaction of at most ``batch_size`` rows; a purge runs at most
``max_batches`` of them and leaves the rest for the next run (the doctor reports a backlog).

Guarantee: a row is deleted only if the condition holds for it when it is deleted. A batch is
chosen ``FOR UPDATE SKIP LOCKED`` on Postgres (SQLite's ``BEGIN IMMEDIATE`` excludes every other
writer), so no chosen row changes before its delete, and the delete repeats the condition all
the same; it goes by key, so a batch costs its own rows, not a scan of the table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import bindparam, text

from resources.storage.db import Database
from resources.storage.queries import load_dialect_queries

_Q = load_dialect_queries(Path(__file__).with_suffix(".sql"))

BATCH_SIZE = 1000
MAX_BATCHES = 20


@dataclass(frozen=True)
class Expiry:
    """The rows of ``table`` that retention may delete now: those matching ``where`` (with
    ``params``). ``key`` names the columns that identify a row (``id``, ``consumer,
    event_id``); ``children`` lists ``(table, column)`` pairs whose rows point at ``key`` (a
    single column then) and go with it."""

    table: str
    key: str
    where: str
    params: Mapping[str, Any] = field(default_factory=dict)
    children: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(
        cls,
        table: str,
        key: str,
        condition: str,
        params: Mapping[str, Any],
        *,
        keep: Sequence[str] = (),
        children: tuple[tuple[str, str], ...] = (),
    ) -> Expiry:
        """Rows matching ``condition`` that none of the ``keep`` conditions holds."""
        where = " AND ".join([f"({condition})", *(f"NOT ({k})" for k in keep)])
        return cls(table, key, where, params, children)

    def purge(
        self, db: Database, *, batch_size: int = BATCH_SIZE, max_batches: int = MAX_BATCHES
    ) -> int:
        """Delete the expired rows, at most ``batch_size`` per transaction and ``max_batches``
        transactions; returns how many were deleted."""
        if batch_size < 1 or max_batches < 1:
            raise ValueError("batch_size and max_batches must be at least 1")
        q = _Q[db.dialect]
        names = {"table": self.table, "key": self.key, "where": self.where}
        choose = text(q["choose_batch"].format(**names))
        delete = _keyed(q["delete_rows"].format(**names))
        single = "," not in self.key
        deleted = 0
        for _ in range(max_batches):
            with db.transaction() as conn:
                rows = conn.execute(choose, {**self.params, "_batch_size": batch_size}).all()
                keys = [row[0] if single else tuple(row) for row in rows]
                if keys:
                    for child, column in self.children:
                        children = q["delete_children"].format(child=child, column=column)
                        conn.execute(_keyed(children), {"_keys": keys})
                    deleted += int(
                        conn.execute(delete, {**self.params, "_keys": keys}).rowcount
                    )
            if len(keys) < batch_size:
                break
        return deleted

    def count(self, db: Database) -> int:
        """How many rows :meth:`purge` would delete now (all of them, not one run's worth)."""
        with db.statement() as conn:
            sql = text(_Q[db.dialect]["count_expired"].format(table=self.table, where=self.where))
            return int(conn.execute(sql, dict(self.params)).scalar_one())


def _keyed(statement: str) -> Any:
    """``statement`` with ``:_keys`` expanded to the chosen keys: the delete goes by key (an
    index), not a scan."""
    return text(statement).bindparams(bindparam("_keys", expanding=True))


def count_rows(db: Database, table: str) -> int:
    """Every row of ``table`` (the doctor puts it beside the expired ones)."""
    with db.statement() as conn:
        count = _Q[db.dialect]["count_rows"].format(table=table)
        return int(conn.execute(text(count)).scalar_one())
