"""Reconciliation and compensation: find what the happy path left inconsistent and fix it once.

:class:`Reconciler` (plain, no Dagster) runs these checks; the ``reconciliation`` asset runs it
on ``reconciliation_schedule`` and puts the counts in its materialisation metadata:

- ``charged_not_confirmed``: the gateway has a charge for an order we still show unpaid
  (the worker died between charge and record). Fix: confirm it (``reconcile:confirm-charge:{o}``).
  Also a charge whose answer never came (``charged_not_confirmed`` without a ``charge_id``)
  that the gateway still does not know once ``charge_sent_at`` is past the settle window (longer
  than the provider's longest processing time, so "not found" is conclusive): nothing was
  charged, and the order is reopened (``payment_pending``) so a retry or replay charges it,
  once per unanswered send (``reconcile:reopen-unsettled:{o}:{sent_at}``).
- ``double_charged``: more than one charge for one order, under its reference or any other
  reference a charge of it went out under (``payment_references``: a run under another key of
  the same order). Fix: a refund is marked pending for each extra charge
  (``compensate:refund-pending:{o}:{charge}``).
- ``paid_without_charge``: we show paid, the gateway has no such charge. Flagged for a person
  (``reconcile:flag-paid-without-charge:{o}``).
- ``needs_compensation``: a fulfilment failed half-way and was given up: its key ``fulfil:{o}``
  failed permanently (or is absent), or it is ``retryable`` and its DLQ record was discarded.
  Fix: cancel its reservation (``compensate:cancel-reservation:{cart}``) and, if it was paid,
  mark a refund pending. A key that is retryable or in progress is left alone (a retry or
  replay resumes from its recovery point and needs the reservations); the release re-checks
  this inside its transaction, holding the order's row lock the job's phases take.
- ``stuck_claims``: idempotency claims in progress long past their lease (the worker is gone and
  nothing retried). Fix: hand them to the DLQ (replayable with the same key); side-effect-free
  job types are pushed to completion by requesting the replay at once.
- ``stale_outbox``: events unpublished past a threshold. Fix: publish them now.
- ``expired_idempotency``: completed keys past retention (the reaper). The retention must be at
  least :data:`MIN_RETENTION_SECONDS` (a weekend's failures must still be replayable on Monday).

Then retention (:mod:`pipelines.retention`): DLQ records whose key completed are resolved (a
replay could only repeat the intent), and every table that grows is purged in bounded batches,
never a row that something unresolved still references (``purged_*`` in the metadata).

Each fixing action has its own key, claimed in the idempotency store, and is recorded in
``reconciliation_actions`` in the same transaction as its change; a check counts only what has
no recorded action, so a second pass finds nothing and nothing is compensated twice.
"""

import functools
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy import Column, Float, Table, Text, text
from sqlalchemy.engine import Connection

from pipelines import tags as tag
from pipelines.attempts import AttemptRecorder
from pipelines.domain.inventory import Inventory
from pipelines.jobs.fulfilment import cart_for, key_for
from pipelines.jobs.payment import sent_references
from pipelines.requests import RequestStore
from pipelines.retention import expiries, purge_expired, resolve_completed_dead_letters
from resources.dlq import (
    MIN_RETENTION_SECONDS,
    DlqStore,
    FailureClass,
    FailureInfo,
    RetentionTooShort,
)
from resources.errors import AlreadyInProgress
from resources.idempotency import Completed, IdempotencyStore
from resources.outbox.publisher import OutboxPublisher, unpublished_older_than
from resources.storage.db import Database, metadata
from resources.storage.retention import Expiry
from resources.storage.settings import DEFAULT_GATEWAY_SETTLE_SECONDS, RetentionSettings

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

CHECKS = (
    "charged_not_confirmed",
    "double_charged",
    "paid_without_charge",
    "needs_compensation",
    "stuck_claims",
    "stale_outbox",
    "expired_idempotency",
)

# Which job type owns a key, by prefix (used when no attempt or request names it).
KEY_PREFIXES = {
    "payment:": "charge_payment",
    "email:": "send_email",
    "inventory-reserve:": "reserve_inventory",
    "report:": "rebuild_report_cache",
    "fulfil:": "fulfill_order",
}
SIDE_EFFECT_FREE = frozenset({"rebuild_report_cache"})


@dataclass
class ReconciliationReport:
    found: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CHECKS, 0))
    fixed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CHECKS, 0))
    actions: list[str] = field(default_factory=list)
    resolved_dead_letters: list[int] = field(default_factory=list)
    purged: dict[str, int] = field(default_factory=dict)

    @property
    def total_found(self) -> int:
        return sum(self.found.values())

    @property
    def total_fixed(self) -> int:
        return sum(self.fixed.values())

    def metadata(self) -> dict[str, Any]:
        out: dict[str, Any] = {"found_total": self.total_found, "fixed_total": self.total_fixed}
        for check in CHECKS:
            out[f"found_{check}"] = self.found[check]
            out[f"fixed_{check}"] = self.fixed[check]
        out["resolved_dead_letters"] = len(self.resolved_dead_letters)
        out.update({f"purged_{table}": n for table, n in self.purged.items()})
        return out


class Reconciler:
    """Runs every check once. Safe to run concurrently with itself and with the jobs: every
    fix is a claimed, recorded action (a second runner finds the key completed)."""

    def __init__(
        self,
        db: Database,
        *,
        store: IdempotencyStore,
        dlq: DlqStore,
        gateway: Any = None,
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
        self.gateway = gateway
        self.publisher = publisher
        self.grace = grace_seconds
        self.lookback = lookback_seconds
        self.outbox_threshold = outbox_threshold_seconds
        self.retention = retention
        self.settle = settle_seconds
        self.clock = clock

    def run(self) -> ReconciliationReport:
        report = ReconciliationReport()
        if self.gateway is not None:
            self._payments(report)
        self._compensations(report)
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

    # -- actions ----------------------------------------------------------------------------

    def done(self, action_key: str) -> bool:
        with self.db.statement() as conn:
            return (
                conn.execute(
                    text("SELECT 1 FROM reconciliation_actions WHERE action_key = :k"),
                    {"k": action_key},
                ).first()
                is not None
            )

    def act(
        self,
        report: ReconciliationReport,
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
                    text(
                        "INSERT INTO reconciliation_actions (action_key, kind, subject, detail,"
                        " created_at) VALUES (:k, :kind, :s, :d, :now)"
                        " ON CONFLICT (action_key) DO NOTHING"
                    ),
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

    # -- payments ---------------------------------------------------------------------------

    def _payments(self, report: ReconciliationReport) -> None:
        now = self.clock()
        with self.db.statement() as conn:
            orders = conn.execute(
                text(
                    "SELECT order_id, payment_status, payment_reference, charge_id,"
                    " charge_sent_at FROM orders"
                    " WHERE payment_reference IS NOT NULL AND updated_at <= :settled"
                    " AND updated_at >= :since ORDER BY order_id"
                ),
                {"settled": now - self.grace, "since": now - self.lookback},
            ).all()
        for order in orders:
            with self.db.statement() as conn:
                references = {order.payment_reference, *sent_references(conn, order.order_id)}
            found = {c.charge_id: c for ref in sorted(references)
                     for c in self.gateway.find_charges(ref)}
            charges = sorted(found.values(), key=lambda c: (c.created_at, c.charge_id))
            ids = [c.charge_id for c in charges]
            if order.payment_status in ("payment_pending", "charged_not_confirmed") and charges:
                report.found["charged_not_confirmed"] += 1
                first = charges[0].charge_id
                report.fixed["charged_not_confirmed"] += self.act(
                    report,
                    f"reconcile:confirm-charge:{order.order_id}",
                    "confirm_charge",
                    order.order_id,
                    functools.partial(_confirm, order_id=order.order_id, charge_id=first, now=now),
                )
            elif (
                order.payment_status == "charged_not_confirmed"
                and order.charge_id is None
                and order.charge_sent_at is not None
                and order.charge_sent_at <= now - self.settle
            ):
                report.found["charged_not_confirmed"] += 1
                report.fixed["charged_not_confirmed"] += self.act(
                    report,
                    f"reconcile:reopen-unsettled:{order.order_id}:{order.charge_sent_at!r}",
                    "reopen_unsettled_charge",
                    order.order_id,
                    functools.partial(
                        _reopen, order_id=order.order_id, sent_at=order.charge_sent_at, now=now
                    ),
                )
            if order.payment_status == "paid" and order.charge_id not in ids:
                key = f"reconcile:flag-paid-without-charge:{order.order_id}"
                if not self.done(key):
                    report.found["paid_without_charge"] += 1
                    report.fixed["paid_without_charge"] += self.act(
                        report,
                        key,
                        "paid_without_charge",
                        order.order_id,
                        _record({"charge_id": order.charge_id, "gateway": ids}),
                    )
            kept = order.charge_id if order.charge_id in ids else (ids[0] if ids else None)
            for extra in [i for i in ids if i != kept]:
                key = f"compensate:refund-pending:{order.order_id}:{extra}"
                if self.done(key):
                    continue
                report.found["double_charged"] += 1
                report.fixed["double_charged"] += self.act(
                    report,
                    key,
                    "refund_pending",
                    order.order_id,
                    _record({"refund_charge_id": extra, "kept_charge_id": kept}),
                )

    # -- fulfilment compensation ------------------------------------------------------------

    def _compensations(self, report: ReconciliationReport) -> None:
        with self.db.statement() as conn:
            # 'fulfil:' || order_id is fulfilment.key_for: in-flight orders given up in the DLQ
            orders = conn.execute(
                text(
                    "SELECT order_id, payment_status, charge_id FROM orders o"
                    " WHERE fulfilment_status = 'needs_compensation'"
                    " OR (fulfilment_status IN ('processing', 'reserved') AND EXISTS ("
                    "SELECT 1 FROM dlq_records d WHERE d.status = 'discarded'"
                    " AND d.idempotency_key = 'fulfil:' || o.order_id))"
                    " ORDER BY order_id"
                )
            ).all()
        inventory = Inventory(self.db)
        for order in orders:
            key = key_for({"order_id": order.order_id})
            with self.db.statement() as conn:
                if not _given_up(conn, key):
                    continue  # a retry or replay may still resume it: not ours to undo
            cart = cart_for(order.order_id)
            cancel = f"compensate:cancel-reservation:{cart}"
            refund = f"compensate:refund-pending:{order.order_id}:{order.charge_id}"
            todo = [
                k
                for k in (cancel, refund if order.payment_status == "paid" else None)
                if k is not None and not self.done(k)
            ]
            if not todo:
                continue
            report.found["needs_compensation"] += 1
            fixed = False
            if cancel in todo:
                fixed |= self.act(
                    report,
                    cancel,
                    "cancel_reservation",
                    order.order_id,
                    functools.partial(
                        _release, inventory=inventory, cart_id=cart, order_id=order.order_id,
                        key=key,
                    ),
                )
            if refund in todo:
                fixed |= self.act(
                    report,
                    refund,
                    "refund_pending",
                    order.order_id,
                    _record({"refund_charge_id": order.charge_id}),
                )
            report.fixed["needs_compensation"] += int(fixed)

    # -- claims stuck in progress -----------------------------------------------------------

    def _stuck_claims(self, report: ReconciliationReport) -> None:
        with self.db.statement() as conn:
            claims = conn.execute(
                text(
                    "SELECT key, fence FROM idempotency_records WHERE status = 'in_progress'"
                    " AND lease_expires_at <= :cutoff AND key NOT LIKE 'reconcile:%'"
                    " AND key NOT LIKE 'compensate:%' ORDER BY key"
                ),
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
                _record({"dlq_id": record_id}),
            )

    def _dead_letter_claim(self, key: str, fence: int) -> int:
        request = RequestStore(self.db).get_by_key(key)
        attempt = AttemptRecorder(self.db).latest_for_key(key)
        job_type = (
            (request.job_type if request else None)
            or (attempt["job_type"] if attempt else None)
            or next(
                (jt for prefix, jt in KEY_PREFIXES.items() if key.startswith(prefix)), "unknown"
            )
        )
        payload = request.payload if request else None
        request_id = int(request.id) if request else None
        config: dict[str, Any] = {"payload": payload, "key": key}
        if request_id is not None:
            config["request_id"] = request_id
        run_config = {"ops": {f"{job_type}_op": {"config": config}}} if payload else {}
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
                run_config=run_config,
                tags={
                    tag.KEY: key,
                    **({tag.REQUEST_ID: str(request_id)} if request_id is not None else {}),
                },
                correlation_id=request.correlation_id if request else None,
            ),
            actor="reconciliation",
        )
        if job_type in SIDE_EFFECT_FREE and run_config:
            self.dlq.request_replay(
                [recorded.record.id],
                actor="reconciliation",
                reason="side-effect free: pushed to completion",
            )
        return recorded.record.id

    # -- outbox -----------------------------------------------------------------------------

    def _outbox(self, report: ReconciliationReport) -> None:
        stale = unpublished_older_than(self.db, self.outbox_threshold, now=self.clock())
        report.found["stale_outbox"] = len(stale)
        if stale and self.publisher is not None:
            self.publisher.publish_pending(max_batches=max(1, len(stale) // 50 + 2))
            left = set(unpublished_older_than(self.db, self.outbox_threshold, now=self.clock()))
            report.fixed["stale_outbox"] = len([i for i in stale if i not in left])


def expired_actions(
    older_than: float, *, now: float, watched_seconds: float, keep: Sequence[str] = ()
) -> Expiry:
    """Recorded actions older than ``older_than`` whose subject no check looks at any more: an
    action's row is what stops a check from compensating twice, so it stays while its order is
    in a state a check reads (given up or in flight) or changed within ``watched_seconds``
    (the payment lookback plus grace), or while ``keep`` holds (its claim is unfinished)."""
    watched = (
        "EXISTS (SELECT 1 FROM orders o WHERE o.order_id = reconciliation_actions.subject"
        " AND (o.fulfilment_status IN ('needs_compensation', 'processing', 'reserved')"
        " OR o.updated_at >= :watched_since))"
    )
    return Expiry.of(
        "reconciliation_actions",
        "action_key",
        "created_at <= :cutoff",
        {"cutoff": now - older_than, "watched_since": now - watched_seconds},
        keep=[watched, *keep],
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
    """Every table's :class:`Expiry` (:func:`pipelines.retention.expiries` and this module's
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


def _record(detail: dict[str, Any]) -> Callable[[Connection], Any]:
    """A fix that changes nothing but the record itself (a flag, a refund marked pending)."""

    def fix(_conn: Connection) -> Any:
        return detail

    return fix


class NotGivenUp(Exception):  # noqa: N818 - a signal to skip, not an error
    """The fulfilment key became retryable or in progress since the check: do not compensate."""


def _given_up(conn: Connection, key: str, *, lock: str = "") -> bool:
    """True when nothing may resume ``key``: it failed permanently or is absent, or it is
    retryable and its DLQ record was discarded (and none is open or replaying)."""
    row = conn.execute(
        text(f"SELECT status FROM idempotency_records WHERE key = :k{lock}"), {"k": key}
    ).first()
    if row is None or row.status == "failed":
        return True
    if row.status != "retryable":
        return False  # in progress or completed
    statuses = {
        r.status
        for r in conn.execute(
            text("SELECT status FROM dlq_records WHERE idempotency_key = :k"), {"k": key}
        )
    }
    return "discarded" in statuses and not statuses & {"open", "replay_requested", "replaying"}


def _release(
    conn: Connection, *, inventory: Inventory, cart_id: str, order_id: str, key: str
) -> dict[str, Any]:
    """Release the cart, re-checking in this transaction that its fulfilment was given up. The
    order's row lock is the one every fulfilment phase holds, so no phase runs meanwhile."""
    lock = " FOR UPDATE" if inventory.db.is_postgres else ""
    conn.execute(text(f"SELECT 1 FROM orders WHERE order_id = :o{lock}"), {"o": order_id})
    if not _given_up(conn, key, lock=lock):
        raise NotGivenUp(key)
    return {"released": inventory.release(conn, cart_id)}


def _reopen(conn: Connection, *, order_id: str, sent_at: float, now: float) -> dict[str, Any]:
    """Back to ``payment_pending`` only if the order still waits on that very send: a job that
    resolved it, or sent again (a new ``charge_sent_at``), meanwhile wins."""
    reopened = conn.execute(
        text(
            "UPDATE orders SET payment_status = 'payment_pending', charge_sent_at = NULL,"
            " updated_at = :now WHERE order_id = :o AND payment_status = 'charged_not_confirmed'"
            " AND charge_id IS NULL AND charge_sent_at = :sent"
        ),
        {"o": order_id, "sent": sent_at, "now": now},
    ).rowcount
    return {"charge_sent_at": sent_at, "not_found_after_settle": True, "reopened": reopened == 1}


def _confirm(conn: Connection, *, order_id: str, charge_id: str, now: float) -> dict[str, Any]:
    conn.execute(
        text(
            "UPDATE orders SET payment_status = 'paid', charge_id = :c, updated_at = :now"
            " WHERE order_id = :o AND payment_status IN ('payment_pending',"
            " 'charged_not_confirmed')"
        ),
        {"c": charge_id, "o": order_id, "now": now},
    )
    return {"charge_id": charge_id}
