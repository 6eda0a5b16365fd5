"""The dead letter queue: what failed for good, kept with its reason until a person decides.

A DLQ is not a trash can. Each record is one failed job request (or, when a run names no request,
one job type and idempotency key), however many runs failed for it. It keeps what is needed to
understand the failure (error class, fingerprint, last error and trace, failure count, first and
last failure time, correlation id) and to replay it safely (the job type, the run config and the
tags of the run, the original idempotency key). An audit trail says who did what.

Guarantees (SQLite and Postgres alike):

- :meth:`DlqStore.record_failure` is idempotent per failed run: each (record, run, step) is
  listed once in ``dlq_failures``, so a sensor and a sweep that both see a run make one record and
  count one failure. Concurrent callers for one request make one record (unique ``dedupe_key``).
- Every status change is one conditional ``UPDATE`` checked against :data:`TRANSITIONS`, and is
  written to ``dlq_audit`` in the same transaction.
- :meth:`DlqStore.request_replay` moves only ``open`` records, and resets only their idempotency
  keys (``failed`` -> ``retryable``, :meth:`IdempotencyStore.reset`); a second request for the
  same record is a no-op. :meth:`DlqStore.claim_for_replay` hands each requested record to one
  caller with a new replay number, so ``dlq-replay:{id}:{n}`` run keys never repeat a replay.
- Records are never dropped while open: :meth:`DlqStore.purge` deletes only resolved or discarded
  ones past their retention.
- Whatever a failure holds, it is stored (SQLite and Postgres): NUL and lone surrogates in its
  text are escaped, every text column is bounded (message 4,000 bytes, trace 16,000, ids and
  keys a few hundred), and a payload, run config or tags whose JSON text is larger than
  :data:`JSON_LIMIT_FACTOR` times ``InputLimits.payload_bytes`` (or has no JSON text) is kept as
  a ``{"sekali_truncated": ...}`` object with its size, sha256 and excerpt. The idempotency key
  is stored whole (:func:`resources.dlq.records.whole_key`), so every lookup by key (the
  replay's reset, resolving a completed key, amending, retention's references) finds the key
  that ran; a key no database stores whole (NUL, a lone surrogate, past :data:`KEY_BYTES`) was
  refused at the boundary and never ran: the record keeps none, its run config keeps it
  (escaped), and a replay is refused there. The dedupe key, longer or escaped, is kept as a
  prefix and a hash of the whole, so distinct keys stay distinct.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import bindparam, text
from sqlalchemy.engine import Connection

from resources.dlq.records import (
    DETAIL_BYTES,
    JSON_LIMIT_FACTOR,
    MIN_RETENTION_SECONDS,
    SUPERSEDED,
    DlqRecord,
    DlqRecordNotFound,
    DlqStatus,
    FailureInfo,
    RecordedFailure,
    ReplayDecision,
    RetentionTooShort,
    sources_of,
    storable_failure,
)
from resources.dlq.views import Clock, DlqViews
from resources.retry.classify import FailureClass
from resources.storage import retention
from resources.storage.db import Database
from resources.storage.json_text import digest, storable, to_text
from resources.storage.settings import ID_BYTES, InputLimits

_D = DlqStatus



def _after_failure(
    record: DlqRecord, info: FailureInfo, failed_at: float
) -> tuple[DlqStatus, str]:
    """A known record's status and audit action after another failure: a failed replay of this
    record, or a failure after it was resolved, opens it again; otherwise it keeps its status."""
    if record.status is _D.REPLAYING and info.dlq_id == record.id:
        return _D.OPEN, "replay_failed"
    if record.status is _D.RESOLVED and failed_at > record.status_changed_at:
        return _D.OPEN, "reopened"
    return record.status, "failed_again"


_FINAL = frozenset({FailureClass.PERMANENT, FailureClass.CRASH_LOOP, FailureClass.TIMED_OUT,
                    FailureClass.DATA_BUG})
"""The classes that decide a request's fate (its key failed for good): a replay, not a retry."""


def _says_less(record: DlqRecord, info: FailureInfo) -> bool:
    """Whether a later failure of an open record keeps the record's error rather than replacing
    it: a transient failure after a final one, from a copy of the request rather than a replay
    of the record. At-least-once delivery runs copies: one may give up on a transient error
    (the key held by another worker, the database away) after another copy's claim decided the
    key for good; relabelled transient, a crash loop would read as "replay it". The failure is
    still counted and kept in ``dlq_failures``. A replay's failure carries its own error, and a
    final failure replaces a transient one."""
    return (record.status is _D.OPEN and info.dlq_id != record.id
            and FailureClass.parse(info.error_class) is FailureClass.TRANSIENT
            and FailureClass.parse(record.error_class) in _FINAL)


def _error_of(record: DlqRecord) -> dict[str, Any]:
    """The bound values of ``failed_again`` that carry a failure's error, as ``record`` holds
    them: its run, step and error stay."""
    return {"run_id": record.run_id, "step": record.step, "eclass": record.error_class,
            "etype": record.error_type, "fp": record.fingerprint, "msg": record.last_error,
            "trace": record.trace}


class DlqStore(DlqViews):
    """The DLQ over a :class:`Database`: every write of its tables, and (from
    :class:`DlqViews`) every read. Thread-safe; share one per process."""

    def __init__(
        self, db: Database, *, clock: Clock = time.time, limits: InputLimits | None = None
    ) -> None:
        super().__init__(db, clock=clock)
        self.json_limit = JSON_LIMIT_FACTOR * (limits or InputLimits.from_env()).payload_bytes

    # -- dead-lettering ---------------------------------------------------------------------

    def record_failure(
        self, info: FailureInfo, *, actor: str = "dlq_sensor", conn: Connection | None = None
    ) -> RecordedFailure:
        """Create or update the record for ``info``; a run and step seen before changes nothing.
        Any text is stored, escaped and bounded (module docstring). ``conn``: in the caller's
        transaction (the request's final state and its record commit together)."""
        if conn is not None:
            return self._record_failure(conn, info, actor)
        with self.db.transaction() as own:
            return self._record_failure(own, info, actor)

    def _record_failure(self, conn: Connection, info: FailureInfo, actor: str) -> RecordedFailure:
        info = storable_failure(info)
        now = self.clock()
        failed_at = info.failed_at if info.failed_at is not None else now
        params = self._failure_params(info, failed_at, now)
        record, created = self._find_or_insert(conn, info, params)
        seen = conn.execute(
            text(self._q["insert_failure"]),
            {"rid": record.id, "run": info.run_id, "step": info.step, "now": now},
        ).rowcount
        detail = f"run {info.run_id} {info.error_type}"
        if created:
            self._audit(conn, record.id, "dead_lettered", actor, None, _D.OPEN, detail, now)
            return RecordedFailure(record, True, True)
        if not seen:
            return RecordedFailure(record, False, False)
        status, action = _after_failure(record, info, failed_at)
        if _says_less(record, info):
            params = {**params, **_error_of(record)}
        conn.execute(
            text(self._q["failed_again"]), {**params, "status": str(status), "id": record.id}
        )
        self._audit(conn, record.id, action, actor, record.status, status, detail, now)
        updated = conn.execute(text(self._q["record_by_id"]), {"id": record.id}).first()
        assert updated is not None
        return RecordedFailure(DlqRecord.from_row(updated), False, True)

    def _failure_params(self, info: FailureInfo, failed_at: float, now: float) -> dict[str, Any]:
        """The bound values of ``insert_record`` and ``failed_again`` for a storable ``info``."""
        return {
            "dedupe_key": info.dedupe_key,
            "job_type": info.job_type,
            "ikey": info.idempotency_key,
            "request_id": info.request_id,
            "run_id": info.run_id,
            "step": info.step,
            "payload": None if info.payload is None else self._json(info.payload),
            "run_config": self._json(info.run_config),
            "tags": self._json(info.tags),
            "eclass": str(info.error_class),
            "etype": info.error_type,
            "fp": info.fingerprint,
            "msg": info.message,
            "trace": info.trace,
            "failed_at": failed_at,
            "cid": info.correlation_id,
            "now": now,
            "trace_id": info.trace_id,
        }

    def _find_or_insert(
        self, conn: Connection, info: FailureInfo, params: dict[str, Any]
    ) -> tuple[DlqRecord, bool]:
        """The record ``info`` belongs to, locked (the replayed one it names, else its dedupe
        key's), inserted when there is none; and whether it was inserted now."""
        row = None
        if info.dlq_id is not None:
            row = conn.execute(text(self._q["lock_by_id"]), {"id": info.dlq_id}).first()
        if row is None:  # looked up first: an insert that meets a conflict spends an id
            row = conn.execute(text(self._q["lock_by_key"]), {"k": info.dedupe_key}).first()
        if row is not None:
            return DlqRecord.from_row(row), False
        row = conn.execute(text(self._q["insert_record"]), params).first()
        if row is not None:
            return DlqRecord.from_row(row), True
        # another process inserted it meanwhile
        row = conn.execute(text(self._q["lock_by_key"]), {"k": info.dedupe_key}).first()
        assert row is not None
        return DlqRecord.from_row(row), False

    # -- operators --------------------------------------------------------------------------

    def request_replay(
        self,
        ids: Iterable[int],
        *,
        actor: str,
        reason: str = "",
        idempotency: Any = None,
        dry_run: bool = False,
    ) -> list[ReplayDecision]:
        """Ask for a replay of each ``open`` record; others are reported, not touched.

        For each record moved, its idempotency key is reset from ``failed`` to ``retryable``
        through ``idempotency.reset(key)`` (an :class:`IdempotencyStore`), and only for those.
        ``dry_run`` changes nothing and says what would be replayed.
        """
        decisions: list[ReplayDecision] = []
        for record_id in ids:
            record = self.get(record_id)
            if record.status is not _D.OPEN:
                decisions.append(ReplayDecision(record, False, f"status is {record.status}"))
                continue
            if dry_run:
                decisions.append(ReplayDecision(record, True, "would replay (dry run)"))
                continue
            moved = self._move(
                record.id,
                _D.REPLAY_REQUESTED,
                actor=actor,
                action="replay_requested",
                detail=reason,
            )
            if not moved:
                decisions.append(ReplayDecision(self.get(record.id), False, "changed meanwhile"))
                continue
            reset = False
            if idempotency is not None and record.idempotency_key:
                reset = bool(idempotency.reset(record.idempotency_key))
            decisions.append(ReplayDecision(self.get(record.id), True, "replay requested", reset))
        return decisions

    def discard(self, ids: Iterable[int], *, actor: str, reason: str) -> list[ReplayDecision]:
        """Give up on records for good (kept, marked ``discarded``, with the reason)."""
        if not reason.strip():
            raise ValueError("a discard needs a reason")
        out = []
        for record_id in ids:
            moved = self._move(
                record_id, _D.DISCARDED, actor=actor, action="discarded", detail=reason
            )
            record = self.get(record_id)
            out.append(
                ReplayDecision(
                    record, moved, "discarded" if moved else f"status is {record.status}"
                )
            )
        return out

    def supersede(
        self, record_id: int, *, actor: str, detail: str, conn: Connection
    ) -> bool:
        """Close an ``open`` record because a new version of its request carries the intent
        (status ``discarded``, audit action ``superseded``, ``detail`` naming the version), in
        the caller's transaction so the close and the version's link commit together. False
        when the record is no longer open (another amendment or replay got there first)."""
        now = self.clock()
        moved = conn.execute(
            text(self._q["supersede"]), {"now": now, "id": record_id}
        ).rowcount
        if moved:
            self._audit(conn, record_id, SUPERSEDED, actor, _D.OPEN, _D.DISCARDED, detail, now)
        return bool(moved)

    def note(self, record_id: int, action: str, *, actor: str, detail: str = "") -> None:
        """An audit line that changes no status (a bulk replay's skipped record, with why)."""
        with self.db.transaction() as conn:
            self._audit(conn, record_id, action, actor, None, None, detail, self.clock())

    # -- the replay sensor ------------------------------------------------------------------

    def claim_for_replay(self, limit: int, *, actor: str = "dlq_replay_sensor") -> list[DlqRecord]:
        """Move up to ``limit`` ``replay_requested`` records (oldest request first) to
        ``replaying`` with their replay number increased, and return them."""
        if limit <= 0:
            return []
        now = self.clock()
        with self.db.transaction() as conn:
            ids = [
                int(r.id)
                for r in conn.execute(text(self._q["replay_requested_ids"]), {"limit": limit})
            ]
            if not ids:
                return []
            conn.execute(
                text(self._q["start_replays"]).bindparams(bindparam("ids", expanding=True)),
                {"ids": ids, "now": now},
            )
            for record_id in ids:
                self._audit(
                    conn,
                    record_id,
                    "replay_launched",
                    actor,
                    _D.REPLAY_REQUESTED,
                    _D.REPLAYING,
                    None,
                    now,
                )
            rows = conn.execute(
                text(self._q["records_by_ids"]).bindparams(bindparam("ids", expanding=True)),
                {"ids": ids},
            ).all()
        return sorted((DlqRecord.from_row(r) for r in rows), key=lambda r: r.id)

    def refuse_replay(
        self, record_id: int, *, actor: str, detail: str, error_class: FailureClass | None = None
    ) -> bool:
        """A ``replaying`` record whose replay run cannot be built goes back to ``open`` (it
        would otherwise stay ``replaying`` for good); ``detail`` says why, for the operator.
        ``error_class``: the record's class from now on (``permanent`` when the stored request
        itself is refused: replaying it again cannot help)."""
        return self._move(
            record_id,
            _D.OPEN,
            actor=actor,
            action="replay_refused",
            detail=detail,
            sources=[str(_D.REPLAYING)],
            error_class=error_class,
        )

    def resolve(self, record_id: int, *, actor: str, detail: str = "") -> bool:
        """The request completed (a replay succeeded, or it finished some other way)."""
        return self._move(record_id, _D.RESOLVED, actor=actor, action="resolved", detail=detail)

    # -- retention --------------------------------------------------------------------------

    def purge(
        self,
        retention_seconds: float,
        *,
        keep: Sequence[str] = (),
        batch_size: int = retention.BATCH_SIZE,
        max_batches: int = retention.MAX_BATCHES,
    ) -> int:
        """Delete resolved and discarded records whose last change is older than the retention,
        with their failures and audit trail; returns how many (in batches:
        :mod:`resources.storage.retention`). Open records are never dropped; nor is one that a
        ``keep`` condition over ``dlq_records`` holds (an unfinished request still pointing at
        it: the DLQ sweep would dead-letter that request again)."""
        return self.expired(retention_seconds, keep=keep).purge(
            self.db, batch_size=batch_size, max_batches=max_batches
        )

    def expired(self, retention_seconds: float, *, keep: Sequence[str] = ()) -> retention.Expiry:
        """What :meth:`purge` with the same arguments deletes now."""
        if retention_seconds < MIN_RETENTION_SECONDS:
            raise RetentionTooShort(retention_seconds, MIN_RETENTION_SECONDS)
        return retention.Expiry.of(
            "dlq_records",
            "id",
            self._q["expired"],
            {"cutoff": self.clock() - retention_seconds},
            keep=keep,
            children=(("dlq_failures", "record_id"), ("dlq_audit", "record_id")),
        )

    # -- internals --------------------------------------------------------------------------

    def _json(self, value: Any) -> str:
        """``value``'s JSON text (ASCII: escapes keep NUL and surrogates storable), or, past
        :attr:`json_limit` or without a JSON text, a small object that says what it was."""
        try:
            stored = to_text(value)
        except Exception:  # noqa: BLE001 - cycles, nesting past the recursion limit, bad keys
            stored = None
        if stored is not None and len(stored) <= self.json_limit:
            return stored
        described = digest(value, 1024)
        return to_text(
            {
                "sekali_truncated": True,
                "size": described.size,
                "sha256": described.sha256,
                "excerpt": described.excerpt,
            }
        )

    def _move(
        self,
        record_id: int,
        target: DlqStatus,
        *,
        actor: str,
        action: str,
        detail: str = "",
        sources: Sequence[str] | None = None,
        error_class: FailureClass | None = None,
    ) -> bool:
        now = self.clock()
        with self.db.transaction() as conn:
            before = conn.execute(text(self._q["lock_by_id"]), {"id": record_id}).first()
            if before is None:
                raise DlqRecordNotFound(record_id)
            moved = conn.execute(
                text(self._q["move"]).bindparams(bindparam("sources", expanding=True)),
                {
                    "target": str(target),
                    "now": now,
                    "id": record_id,
                    "eclass": None if error_class is None else str(error_class),
                    "sources": list(sources) if sources is not None else sources_of(target),
                },
            ).rowcount
            if moved:
                self._audit(
                    conn,
                    record_id,
                    action,
                    actor,
                    DlqStatus(before._mapping["status"]),
                    target,
                    detail,
                    now,
                )
        return bool(moved)

    def _audit(
        self,
        conn: Connection,
        record_id: int,
        action: str,
        actor: str,
        from_status: DlqStatus | None,
        to_status: DlqStatus | None,
        detail: str | None,
        now: float,
    ) -> None:
        conn.execute(
            text(self._q["insert_audit"]),
            {
                "rid": record_id,
                "action": action,
                "actor": storable(actor, ID_BYTES),
                "f": None if from_status is None else str(from_status),
                "t": None if to_status is None else str(to_status),
                "detail": None if detail is None else storable(detail, DETAIL_BYTES),
                "at": now,
            },
        )
