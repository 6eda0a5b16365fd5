"""Reconciliation and compensation: find what the happy path left inconsistent and fix it once.

:class:`Reconciler` (plain, no Dagster) runs the checks; the ``reconciliation`` asset runs it on
``reconciliation_schedule`` and puts the counts in its materialisation metadata. First each job
type's own checks (its ``reconcile`` hook, counted under the names in its ``checks``: an effect
made at a downstream and never recorded, work given up half-way), then the platform's own:

- ``stuck_claims``: idempotency claims in progress long past their lease (the worker is gone and
  nothing retried). Fix: hand them to the DLQ (replayable with the same key); side-effect-free
  job types are pushed to completion by requesting the replay at once. The job type of a key
  nothing else names is the one whose key prefix it carries.
- ``stale_outbox``: live events unpublished past a threshold. Fix: publish them now. A
  dead-lettered event, and a later event of its aggregate waiting behind it, is no stuck
  publisher: they are counted apart (``dead_outbox``, ``outbox_behind_dead``) and wait for an
  operator (``sekali outbox dead|replay|discard``).
- ``expired_idempotency``: completed keys past retention (the reaper). The retention must be at
  least :data:`MIN_RETENTION_SECONDS` (a weekend's failures must still be replayable on Monday).

Then retention (:mod:`engine.upkeep.retention`): DLQ records whose key completed are resolved (a
replay could only repeat the intent), and every table that grows is purged in bounded batches,
never a row that something unresolved still references (``purged_*`` in the metadata).

Each fixing action has its own key, claimed in the idempotency store, and is recorded in
``reconciliation_actions`` in the same transaction as its change (:meth:`Reconciler.act`); a
check counts only what has no recorded action, so a second pass finds nothing and nothing is
compensated twice. A hook gets the reconciler (its database, clock, ``grace``, ``lookback``,
``settle``, the downstream clients by name, ``act`` and ``done``) and the report to count in.
"""

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sqlalchemy import Column, Float, Table, Text, text
from sqlalchemy.engine import Connection

from engine import tags as tag
from engine.attempts import AttemptRecorder
from engine.contract import JobType
from engine.registry import JOB_TYPES, key_owner
from engine.requests import RequestStore
from engine.upkeep.retention import expiries, purge_expired, resolve_completed_dead_letters
from resources.dlq import (
    MIN_RETENTION_SECONDS,
    DlqStore,
    DlqViews,
    FailureClass,
    FailureInfo,
    RetentionTooShort,
)
from resources.errors import AlreadyInProgress
from resources.idempotency import Completed, IdempotencyStore, LedgerViews
from resources.outbox.publisher import (
    OutboxPublisher,
    held_by_dead_letters,
    unpublished_older_than,
)
from resources.storage.db import Database, metadata
from resources.storage.queries import load_queries
from resources.storage.retention import Expiry
from resources.storage.settings import DEFAULT_GATEWAY_SETTLE_SECONDS, RetentionSettings

_Q = load_queries(Path(__file__).with_suffix(".sql"))
log = logging.getLogger(__name__)

reconciliation_actions = Table(
    "reconciliation_actions",
    metadata,
    Column("action_key", Text, primary_key=True),
    Column("kind", Text, nullable=False),
    Column("subject", Text, nullable=False),
    Column("detail", Text),
    Column("created_at", Float, nullable=False),
)

PLATFORM_CHECKS = ("stuck_claims", "stale_outbox", "expired_idempotency")


def checks(job_types: Mapping[str, JobType] | None = None) -> tuple[str, ...]:
    """Every check's name in the order a run counts them: the job types' own (in name order),
    then the platform's."""
    types = (JOB_TYPES if job_types is None else job_types).values()
    return (*[check for jt in types for check in jt.upkeep.checks], *PLATFORM_CHECKS)


@dataclass
class ReconciliationResult:
    found: dict[str, int] = field(default_factory=lambda: dict.fromkeys(checks(), 0))
    fixed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(checks(), 0))
    actions: list[str] = field(default_factory=list)
    resolved_dead_letters: list[int] = field(default_factory=list)
    purged: dict[str, int] = field(default_factory=dict)
    dead_outbox: int = 0
    outbox_behind_dead: int = 0

    @property
    def total_found(self) -> int:
        return sum(self.found.values())

    @property
    def total_fixed(self) -> int:
        return sum(self.fixed.values())

    def metadata(self) -> dict[str, Any]:
        out: dict[str, Any] = {"found_total": self.total_found, "fixed_total": self.total_fixed}
        for check in self.found:
            out[f"found_{check}"] = self.found[check]
            out[f"fixed_{check}"] = self.fixed[check]
        out["resolved_dead_letters"] = len(self.resolved_dead_letters)
        out["dead_outbox"] = self.dead_outbox
        out["outbox_behind_dead"] = self.outbox_behind_dead
        out.update({f"purged_{table}": n for table, n in self.purged.items()})
        return out


class Reconciler:
    """Runs every check once. Safe to run concurrently with itself and with the jobs: every
    fix is a claimed, recorded action (a second runner finds the key completed). ``clients``
    are the downstream clients by name that the job types' checks look effects up at; a check
    whose client is absent is skipped."""

    def __init__(
        self,
        db: Database,
        *,
        store: IdempotencyStore,
        dlq: DlqStore,
        clients: Mapping[str, Any] | None = None,
        publisher: OutboxPublisher | None = None,
        grace_seconds: float = 600.0,
        lookback_seconds: float = 2 * 86400.0,
        outbox_threshold_seconds: float = 300.0,
        idempotency_retention_seconds: float | None = None,
        retention: RetentionSettings | None = None,
        settle_seconds: float = DEFAULT_GATEWAY_SETTLE_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        retention = retention or RetentionSettings()
        if idempotency_retention_seconds is not None:
            retention = replace(retention, idempotency=idempotency_retention_seconds)
        for seconds in (retention.idempotency, retention.dlq):
            if seconds < MIN_RETENTION_SECONDS:
                raise RetentionTooShort(seconds, MIN_RETENTION_SECONDS)
        self.db = db
        self.store = store
        self.dlq = dlq
        self.clients = dict(clients or {})
        self.publisher = publisher
        self.grace = grace_seconds
        self.lookback = lookback_seconds
        self.outbox_threshold = outbox_threshold_seconds
        self.retention = retention
        self.settle = settle_seconds
        self.clock = clock

    def run(self) -> ReconciliationResult:
        report = ReconciliationResult()
        for jt in JOB_TYPES.values():
            if jt.upkeep.reconcile is not None:
                jt.upkeep.reconcile(self, report)
        self._stuck_claims(report)
        self._outbox(report)
        report.resolved_dead_letters = resolve_completed_dead_letters(
            self.dlq, self.store, RequestStore(self.db, clock=self.clock), actor="reconciliation"
        )
        report.purged = purge_expired(self.db, self.expiries(), self.retention)
        purged = report.purged["idempotency_records"]
        report.found["expired_idempotency"] = report.fixed["expired_idempotency"] = purged
        log.info("reconciliation found %d, fixed %d", report.total_found, report.total_fixed)
        return report

    def expiries(self) -> dict[str, Expiry]:
        """What retention may delete now, per table, in the order to purge them."""
        return retention_expiries(
            self.db,
            self.retention,
            ledger=self.store,
            dlq=self.dlq,
            clock=self.clock,
            watched_seconds=self.lookback + self.grace,
        )

    def client(self, name: str) -> Any:
        """The downstream client ``name``, or None when this run has none."""
        return self.clients.get(name)

    # -- actions ----------------------------------------------------------------------------

    def done(self, action_key: str) -> bool:
        with self.db.statement() as conn:
            return (
                conn.execute(
                    text(_Q["action_done"]),
                    {"k": action_key},
                ).first()
                is not None
            )

    def act(
        self,
        report: ReconciliationResult,
        action_key: str,
        kind: str,
        subject: str,
        fix: Callable[[Connection], Any],
    ) -> bool:
        """Do ``fix`` once for ``action_key``: claimed in the idempotency store, applied, recorded
        and completed in one transaction. False if it was done before (by us or a concurrent
        reconciler)."""
        try:
            outcome = self.store.begin(action_key, payload={"kind": kind, "subject": subject})
        except AlreadyInProgress:
            return False  # a concurrent reconciler is doing it
        if isinstance(outcome, Completed):
            return False
        try:
            with self.db.transaction() as conn:
                detail = fix(conn)
                conn.execute(
                    text(_Q["record_action"]),
                    {
                        "k": action_key,
                        "kind": kind,
                        "s": subject,
                        "d": json.dumps(detail, default=str),
                        "now": self.clock(),
                    },
                )
                self.store.complete(outcome, {"kind": kind, "detail": detail}, conn=conn)
        except NotGivenUp as exc:  # the state changed under us: try again on a later pass
            self.store.fail(outcome, exc, "transient")
            return False
        except Exception as exc:
            self.store.fail(outcome, exc, "transient")
            raise
        report.actions.append(action_key)
        log.warning("reconciliation: %s %s (%s)", kind, subject, action_key)
        return True

    # -- claims stuck in progress -----------------------------------------------------------

    def _stuck_claims(self, report: ReconciliationResult) -> None:
        with self.db.statement() as conn:
            claims = conn.execute(
                text(_Q["stuck_claims"]),
                {"cutoff": self.clock() - self.grace},
            ).all()
        for claim in claims:
            action = f"reconcile:stuck-claim:{claim.key}:{claim.fence}"
            if self.done(action):
                continue
            report.found["stuck_claims"] += 1
            record_id = self._dead_letter_claim(claim.key, int(claim.fence))
            report.fixed["stuck_claims"] += self.act(
                report,
                action,
                "stuck_claim_to_dlq",
                claim.key,
                record_only({"dlq_id": record_id}),
            )

    def _dead_letter_claim(self, key: str, fence: int) -> int:
        request = RequestStore(self.db).get_by_key(key)
        attempt = AttemptRecorder(self.db).latest_for_key(key)
        job_type = (
            (request.job_type if request else None)
            or (attempt["job_type"] if attempt else None)
            or key_owner(key)
            or "unknown"
        )
        payload = request.payload if request else None
        request_id = int(request.id) if request else None
        recorded = self.dlq.record_failure(
            FailureInfo(
                job_type=job_type,
                dedupe_key=f"request:{request_id}"
                if request_id is not None
                else f"key:{job_type}:{key}",
                error_type="LeaseExpired",
                message=f"claim on {key} in progress past its lease (fence {fence}); "
                "its worker is gone and nothing retried it",
                error_class=FailureClass.TRANSIENT,
                run_id=f"reconcile:{key}:{fence}",
                idempotency_key=key,
                request_id=request_id,
                payload=payload,
                tags={
                    tag.KEY: key,
                    **({tag.REQUEST_ID: str(request_id)} if request_id is not None else {}),
                },
                correlation_id=request.correlation_id if request else None,
            ),
            actor="reconciliation",
        )
        if job_type in side_effect_free() and payload:
            self.dlq.request_replay(
                [recorded.record.id],
                actor="reconciliation",
                reason="side-effect free: pushed to completion",
            )
        return recorded.record.id

    # -- outbox -----------------------------------------------------------------------------

    def _outbox(self, report: ReconciliationResult) -> None:
        stale = unpublished_older_than(self.db, self.outbox_threshold, now=self.clock())
        report.found["stale_outbox"] = len(stale)
        if stale and self.publisher is not None:
            self.publisher.publish_pending(max_batches=max(1, len(stale) // 50 + 2))
            left = set(unpublished_older_than(self.db, self.outbox_threshold, now=self.clock()))
            report.fixed["stale_outbox"] = len([i for i in stale if i not in left])
        report.dead_outbox, report.outbox_behind_dead = held_by_dead_letters(self.db)


def side_effect_free(job_types: Mapping[str, JobType] | None = None) -> frozenset[str]:
    """The job types without a side effect: a stuck claim of theirs is replayed at once."""
    types = JOB_TYPES if job_types is None else job_types
    return frozenset(name for name, jt in types.items() if not jt.side_effect)


def expired_actions(
    older_than: float, *, now: float, watched_seconds: float, keep: Sequence[str] = ()
) -> Expiry:
    """Recorded actions older than ``older_than`` whose subject no check looks at any more: an
    action's row is what stops a check from compensating twice, so it stays while a job type's
    ``watches`` holds for it (its subject is in a state a check reads, or changed within
    ``watched_seconds``: the lookback plus grace), or while ``keep`` holds (its claim is
    unfinished)."""
    watched = [condition for jt in JOB_TYPES.values() for condition in jt.upkeep.watches]
    return Expiry.of(
        "reconciliation_actions",
        "action_key",
        "created_at <= :cutoff",
        {"cutoff": now - older_than, "watched_since": now - watched_seconds},
        keep=[*watched, *keep],
    )


def retention_expiries(
    db: Database,
    settings: RetentionSettings,
    *,
    ledger: IdempotencyStore,
    dlq: DlqStore,
    clock: Callable[[], float],
    watched_seconds: float,
) -> dict[str, Expiry]:
    """Every table's :class:`Expiry` (:func:`engine.upkeep.retention.expiries` and this module's
    own ``reconciliation_actions``), in the order to purge them."""
    return {
        **expiries(db, settings, ledger=ledger, dlq=dlq, clock=clock),
        "reconciliation_actions": expired_actions(
            settings.reconciliation_actions,
            now=clock(),
            watched_seconds=watched_seconds,
            keep=[ledger.unfinished_key_reference("reconciliation_actions.subject")],
        ),
    }


def record_only(detail: dict[str, Any]) -> Callable[[Connection], Any]:
    """A fix that changes nothing but the record itself (a flag, a refund marked pending)."""

    def fix(_conn: Connection) -> Any:
        return detail

    return fix


class NotGivenUp(Exception):  # a signal to skip, not an error
    """The key became retryable or in progress since the check: do not compensate (the fix
    raises it inside :meth:`Reconciler.act`, which then records nothing)."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def given_up(conn: Connection, key: str, *, lock: bool = False) -> bool:
    """True when nothing may resume ``key``: it failed permanently or is absent, or it is
    retryable and its DLQ record was discarded (and none is open or replaying). ``lock``: the
    key's record stays locked until the caller's transaction ends."""
    status = LedgerViews.status_in(conn, key, lock=lock)
    if status is None or status == "failed":
        return True
    if status != "retryable":
        return False  # in progress or completed
    statuses = DlqViews.statuses_of_key(conn, key)
    return "discarded" in statuses and not statuses & {"open", "replay_requested", "replaying"}
