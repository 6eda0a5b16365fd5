"""Retention: how long each table that grows keeps what is finished, and what it never drops.

The reconciliation run (:class:`engine.upkeep.reconciliation.Reconciler`, on
``reconciliation_schedule``) purges every table below in bounded batches, each through its
owner's ``expired(...)`` (:class:`resources.storage.retention.Expiry`), with the retention of
:class:`resources.storage.settings.RetentionSettings`. A row still referenced by something
unresolved is kept whatever its age; the references are written by the owners of the
referencing tables and passed as ``keep`` conditions. Per table (retention field in quotes):

- ``job_requests`` after ``requests`` since their last change, if completed, or failed and held
  by a DLQ record that is resolved or discarded (none unresolved);
- ``dlq_records`` (with their failures and audit) after ``dlq`` since their status changed, if
  resolved or discarded and their request (if any) has completed or is gone;
- ``job_attempts`` after ``attempts`` since they started, unless their request has not
  completed, or their key is not completed or has an unresolved DLQ record;
- ``idempotency_records`` after ``idempotency`` since completion (or, for a failed or retryable
  key, since its failure), if neither an unresolved DLQ record nor an unfinished request names
  the key; never one in progress;
- ``job_rejections`` after ``rejections`` (nothing references them), and each job type's own
  tables (its ``retained``) after their setting;
- ``outbox`` rows after ``outbox`` since publication (never unpublished ones), ``inbox`` entries
  after ``inbox`` unless their event is unpublished (it may be delivered again);
- ``outbox_dead_letters`` after ``dlq`` since they were replayed or discarded (never an open
  one, nor a replayed one whose event is still unpublished);
- ``reconciliation_actions`` after ``reconciliation_actions``, unless a check may still look at
  their subject (:func:`engine.upkeep.reconciliation.expired_actions`).

The order follows the references (requests pin DLQ records; both pin keys; all three pin
attempts), so a finished request, its record, key and attempts leave in the same run.

The ledger and the DLQ also meet here the other way round: a DLQ record can stay open for a
request whose key completed (the worker died after the key completed and before the step
reported success). Replaying it is a suppressed duplicate while the key is kept, and would be a
second effect once the key's retention had passed. :func:`resolve_completed_dead_letters`
resolves such records (the reconciliation run and the replay sensor call it), audited, and marks
their requests completed.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from engine.attempts import AttemptRecorder
from engine.registry import JOB_TYPES, get_job_type
from engine.requests import RequestStore
from resources.dlq import DlqRecord, DlqStatus, DlqStore
from resources.idempotency import IdempotencyStore, Record, Status, payload_hash
from resources.outbox import OutboxDeadLetters, expired_inbox, expired_outbox
from resources.storage.db import Database
from resources.storage.retention import Expiry, count_rows
from resources.storage.settings import RetentionSettings
from resources.telemetry.redact import redact

log = logging.getLogger(__name__)

Clock = Callable[[], float]

PLATFORM_SETTING = {
    "job_requests": "requests",
    "dlq_records": "dlq",
    "idempotency_records": "idempotency",
    "job_attempts": "attempts",
    "job_rejections": "rejections",
    "outbox": "outbox",
    "inbox": "inbox",
    "outbox_dead_letters": "dlq",
    "reconciliation_actions": "reconciliation_actions",
}
"""The platform's purged tables and the :class:`RetentionSettings` field that says how long
each keeps rows; the job types add their own (``retained``)."""


def settings_of_tables() -> dict[str, str]:
    """Every purged table (the platform's and the job types' own) and its retention field."""
    own = {r.table: r.setting for jt in JOB_TYPES.values() for r in jt.upkeep.retained}
    return {**PLATFORM_SETTING, **own}


def expiries(
    db: Database,
    settings: RetentionSettings,
    *,
    ledger: IdempotencyStore,
    dlq: DlqStore,
    clock: Clock,
) -> dict[str, Expiry]:
    """What each table (but ``reconciliation_actions``, its owner adds it) may delete now, in
    the order to purge them."""
    requests = RequestStore(db, clock=clock)
    now = clock()
    return {
        "job_requests": requests.expired(
            settings.requests,
            dead_lettered=dlq.request_reference("job_requests.id"),
            keep=[dlq.unresolved_request_reference("job_requests.id")],
        ),
        "dlq_records": dlq.expired(
            settings.dlq, keep=[requests.unfinished_request_reference("dlq_records.request_id")]
        ),
        "idempotency_records": ledger.expired(
            settings.idempotency,
            include_failed=True,
            keep=[
                dlq.unresolved_key_reference("idempotency_records.key"),
                requests.unfinished_key_reference("idempotency_records.key"),
            ],
        ),
        "job_attempts": AttemptRecorder(db, clock=clock).expired(
            settings.attempts,
            keep=[
                requests.unfinished_request_reference("job_attempts.request_id"),
                dlq.unresolved_key_reference("job_attempts.idempotency_key"),
                ledger.unfinished_key_reference("job_attempts.idempotency_key"),
            ],
        ),
        "job_rejections": requests.expired_rejections(settings.rejections),
        **{
            r.table: r.expired(settings.tables()[r.setting], now)
            for jt in JOB_TYPES.values()
            for r in jt.upkeep.retained
        },
        "outbox": expired_outbox(settings.outbox, now=now),
        "inbox": expired_inbox(settings.inbox, now=now),
        "outbox_dead_letters": OutboxDeadLetters(db, clock=clock).expired(settings.dlq),
    }


def purge_expired(
    db: Database, expired: Mapping[str, Expiry], settings: RetentionSettings
) -> dict[str, int]:
    """Purge each table in order, bounded by the settings' batch size and count; returns the
    rows deleted per table."""
    purged = {
        table: expiry.purge(db, batch_size=settings.batch_size, max_batches=settings.max_batches)
        for table, expiry in expired.items()
    }
    if any(purged.values()):
        log.info("retention purged %s", {t: n for t, n in purged.items() if n})
    return purged


@dataclass(frozen=True)
class TableRetention:
    """One table against its retention, as the doctor reports it."""

    table: str
    retention_seconds: float
    rows: int
    expired: int


def backlog(
    db: Database, expired: Mapping[str, Expiry], settings: RetentionSettings
) -> list[TableRetention]:
    """Every table's size and how many of its rows are past retention and unreferenced (rows
    a purge would delete: a number that stays high means the purge is not running)."""
    retention = settings.tables()
    setting = settings_of_tables()
    return [
        TableRetention(table, retention[setting[table]], count_rows(db, table), expiry.count(db))
        for table, expiry in expired.items()
    ]


def resolve_completed_dead_letters(
    dlq: DlqStore,
    ledger: IdempotencyStore,
    requests: RequestStore,
    *,
    actor: str,
    statuses: Iterable[DlqStatus] = (DlqStatus.OPEN, DlqStatus.REPLAY_REQUESTED),
) -> list[int]:
    """Resolve the records in ``statuses`` whose idempotency key completed, and mark their
    requests completed: the intent is done, a replay could only repeat it. Completed means
    after the record's last failure (a late retry, a relaunch or a run launched by hand did the
    work), or with the record's own payload (the worker died after the key completed and before
    the step reported success). A key completed before the failure with another payload is a
    conflict, and a record whose payload cannot be checked stays too: a person decides.
    Returns the ids resolved. Reads :data:`RESOLVE_PAGE` records at a time
    (:func:`resolve_completed_page`)."""
    resolved: list[int] = []
    after = 0
    while True:
        ids, after = resolve_completed_page(
            dlq, ledger, requests, actor=actor, statuses=statuses, after_id=after
        )
        resolved += ids
        if after == 0:
            return resolved


RESOLVE_PAGE = 500
"""Records one :func:`resolve_completed_page` reads (a DLQ sensor tick reads one page)."""


def resolve_completed_page(
    dlq: DlqStore,
    ledger: IdempotencyStore,
    requests: RequestStore,
    *,
    actor: str,
    statuses: Iterable[DlqStatus] = (DlqStatus.OPEN, DlqStatus.REPLAY_REQUESTED),
    after_id: int = 0,
    limit: int = RESOLVE_PAGE,
) -> tuple[list[int], int]:
    """:func:`resolve_completed_dead_letters` over one page: the records with ids above
    ``after_id``, at most ``limit`` (and within :meth:`DlqStore.key_page`'s window). Returns
    the ids resolved and where the next page starts (0 after the last page: the oldest
    again)."""
    page, following = dlq.key_page([str(s) for s in statuses], after_id=after_id, limit=limit)
    done = ledger.records([key for _, key in page if key], status=Status.COMPLETED)
    candidates = [record_id for record_id, key in page if key in done]
    records = dlq.list_records(ids=candidates, status=list(statuses)) if candidates else []
    resolved = []
    for record in records:
        key = record.idempotency_key or ""
        completed = done.get(key)
        if completed is None:
            continue
        when = dt.datetime.fromtimestamp(completed.updated_at, tz=dt.UTC).isoformat()
        if completed.updated_at > record.last_failed_at:
            detail = f"key {key} completed elsewhere at {when}, after the last failure"
        elif _same_intent(record, completed):
            detail = (
                f"key {key} completed at {when} with this payload (its worker stopped before "
                "the step reported it): the intent is done, nothing to replay"
            )
        else:
            continue
        if dlq.resolve(record.id, actor=actor, detail=detail):
            resolved.append(record.id)
            if record.request_id is not None:
                requests.mark_completed(record.request_id)
            log.warning("resolved DLQ record %d: %s", record.id, redact(detail))
    return resolved, following


def _same_intent(record: DlqRecord, completed: Record) -> bool:
    if not isinstance(record.payload, dict):
        return False  # nothing to compare: the key alone cannot tell a conflict apart
    try:
        job_type = get_job_type(record.job_type)
        clean = job_type.validate(dict(record.payload))
    except Exception:  # noqa: BLE001 - unknown job type or bad payload: a person decides
        return False
    return payload_hash(clean) == completed.payload_hash
