"""``enqueue``: the producer's way in. Validates, derives the key, writes a job request.

Guarantees:

- The request passes the validation boundary (:func:`engine.validation.admit`: limits,
  storable text, then the job type's own checks) before anything is written; a bad one raises
  :class:`ValidationError` naming the field and the limit, and is kept, bounded, in
  ``job_rejections`` (nothing is lost, nothing huge is stored) with ``source``, the way in
  (``cli`` for ``sekali enqueue``).
- The key defaults to the job type's ``key_for(validated payload)``: the business intent, so
  two producers sending the same intent share one request.
- Same key, same payload: a no-op returning the existing request (``result.created`` is False).
  Same key, other payload: :class:`IdempotencyConflict` naming the key.
- ``priority`` (``PRIORITY_MIN``..``PRIORITY_MAX``, default 0) is checked at the boundary and
  stored with the request's claim rank (``created_at - priority * SEKALI_INTAKE_PRIORITY_AGING``,
  default 60 s a step); the intake claims the lowest rank first and tags the run
  ``dagster/priority``.
- A job type's dedupe window is applied here: the stored key is ``<key>@<window start>``
  (:func:`engine.requests.windowed_key`), so the same key is one intent within the window and
  a new one after it; the request row keeps the window (``dedupe_window``).
- A debounced job type's request carries its group and timings; the intake runs one request of
  a group per burst (see :meth:`RequestStore.claim_for_launch`).
- The request's tenant is its job type's fairness key over the validated payload (the default
  tenant without one): the intake shares claims between tenants by weight (:mod:`engine.tenants`).
- ``conn=``: the request joins the caller's transaction (transactional outbox): it exists if and
  only if the caller's business change commits. A rejection is then written on its own connection
  on Postgres (so it survives the caller's rollback) and inside the caller's transaction on SQLite
  (a second writer would wait on the caller's own write lock).

The intake sensor (``sensors/intake.py``) turns pending requests into runs.
"""

from __future__ import annotations

import logging
import math
import os
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Connection

from engine.delivery import Delivery, DeliveryPolicy
from engine.requests import DEFAULT_PRIORITY_AGING, Debounced, EnqueueResult, RequestStore
from engine.validation import admit
from engine.worker import notify_workers
from resources.storage.db import Database, shared_database
from resources.storage.migrations import ensure_schema
from resources.storage.settings import Settings
from resources.telemetry.tracing import configure_tracing, inject, traced

log = logging.getLogger(__name__)

def _wake_after_commit(conn: Connection | None, queue: str) -> None:
    """Wake an idle resident worker of ``queue``: now, or when the caller's transaction commits
    (a worker woken earlier would not see the request yet)."""
    if conn is not None and conn.in_transaction():
        event.listen(conn, "commit", lambda _conn: notify_workers(queue), once=True)
    else:
        notify_workers(queue)


def priority_aging(env: Mapping[str, str] | None = None) -> float:
    """Seconds of waiting worth one priority step: ``SEKALI_INTAKE_PRIORITY_AGING`` (default 60).
    A value that is not a positive number is a ValueError naming the variable."""
    raw = (os.environ if env is None else env).get("SEKALI_INTAKE_PRIORITY_AGING", "")
    if not raw.strip():
        return DEFAULT_PRIORITY_AGING
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"SEKALI_INTAKE_PRIORITY_AGING={raw!r}: expected seconds > 0")
    return value


def _default_db() -> Database:
    return shared_database(Settings.from_env().database_url)


def _created(result: EnqueueResult) -> dict[str, Any]:
    return {"idempotency_key": result.key, "request_id": result.id, "created": result.created}


@traced("sekali.enqueue", before=configure_tracing, returned=_created,
        attributes={"job_type": "job_type", "idempotency_key": "key"})
def enqueue(
    job_type: str,
    payload: dict[str, Any] | str,
    key: str | None = None,
    correlation_id: str | None = None,
    *,
    conn: Connection | None = None,
    db: Database | None = None,
    source: str = "enqueue",
    priority: Any = 0,
    clock: Callable[[], float] = time.time,
) -> EnqueueResult:
    """Write a job request for ``job_type``; see the module docstring for the guarantees.

    ``clock`` is the request's time (its dedupe window and debounce timing; tests move it).

    ``payload`` is a dict or its JSON text. ``db`` defaults to ``DATABASE_URL`` (or the
    embedded SQLite); with ``conn=`` the database is the connection's own. With tracing on, this
    starts the request's trace (``sekali.enqueue``, a child of the caller's span if any) and the
    request row keeps its context, so the run that serves it continues the same trace.
    """
    if db is None:
        db = Database(conn.engine) if conn is not None else _default_db()
    if conn is None:
        ensure_schema(db)
    store = RequestStore(db, clock=clock)
    admitted = admit(
        store, job_type, payload, key, source=source, correlation_id=correlation_id, conn=conn,
        priority=priority, dedupe_at=clock(),
    )
    spec = admitted.job_type
    group = spec.debounce_key_for(admitted.payload)
    debounce = (
        Debounced(group, spec.flow.debounce.wait, spec.flow.debounce.max_wait)
        if group is not None and spec.flow.debounce is not None
        else None
    )
    correlation_id = correlation_id or uuid.uuid4().hex  # the correlation chain starts here
    result = store.enqueue(
        admitted.job_type.name,
        admitted.key,
        admitted.payload,
        queue=admitted.job_type.queue,
        correlation_id=correlation_id,
        traceparent=inject(),
        conn=conn,
        priority=admitted.priority,
        dedupe_window=spec.keying.dedupe_window,
        debounce=debounce,
        aging=priority_aging(),
        tenant=admitted.tenant,
    )
    if result.created and DeliveryPolicy.from_env().of(spec) is Delivery.RESIDENT:
        _wake_after_commit(conn, admitted.job_type.queue)
    log.info(
        "enqueued %s key=%s request=%s created=%s",
        job_type,
        result.key,
        result.id,
        result.created,
        extra={
            "job_type": job_type,
            "key": result.key,
            "request_id": result.id,
            "correlation_id": correlation_id,
        },
    )
    return result
