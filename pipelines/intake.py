"""``enqueue``: the producer's way in. Validates, derives the key, writes a job request.

Guarantees:

- The request passes the validation boundary (:func:`pipelines.validation.admit`: limits,
  storable text, then the job type's own checks) before anything is written; a bad one raises
  :class:`ValidationError` naming the field and the limit, and is kept, bounded, in
  ``job_rejections`` (nothing is lost, nothing huge is stored) with ``source``, the way in
  (``cli`` for ``sekali enqueue``).
- The key defaults to the job type's ``key_for(validated payload)``: the business intent, so
  two producers sending the same intent share one request.
- Same key, same payload: a no-op returning the existing request (``result.created`` is False).
  Same key, other payload: :class:`IdempotencyConflict` naming the key.
- ``conn=``: the request joins the caller's transaction (transactional outbox): it exists if and
  only if the caller's business change commits. A rejection is then written on its own connection
  on Postgres (so it survives the caller's rollback) and inside the caller's transaction on SQLite
  (a second writer would wait on the caller's own write lock).

The intake sensor (``sensors/intake.py``) turns pending requests into runs.
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any

from sqlalchemy.engine import Connection

from pipelines.requests import EnqueueResult, RequestStore
from pipelines.validation import admit
from resources.storage.db import Database, shared_database
from resources.storage.migrations import upgrade
from resources.storage.settings import Settings
from resources.telemetry.tracing import configure_tracing, inject, set_attributes, span

log = logging.getLogger(__name__)

_migrated: set[int] = set()
_migrated_lock = threading.Lock()


def _ensure_schema(db: Database) -> None:
    """Apply ``sql/`` once per Database per process (cheap no-op afterwards)."""
    with _migrated_lock:
        if id(db) not in _migrated:
            upgrade(db)
            _migrated.add(id(db))


def _default_db() -> Database:
    return shared_database(Settings.from_env().database_url)


def enqueue(
    job_type: str,
    payload: dict[str, Any] | str,
    key: str | None = None,
    correlation_id: str | None = None,
    *,
    conn: Connection | None = None,
    db: Database | None = None,
    source: str = "enqueue",
) -> EnqueueResult:
    """Write a job request for ``job_type``; see the module docstring for the guarantees.

    ``payload`` is a dict or its JSON text. ``db`` defaults to ``DATABASE_URL`` (or the
    embedded SQLite); with ``conn=`` the database is the connection's own. With tracing on, this
    starts the request's trace (``sekali.enqueue``, a child of the caller's span if any) and the
    request row keeps its context, so the run that serves it continues the same trace.
    """
    configure_tracing()
    with span("sekali.enqueue", job_type=job_type, idempotency_key=key):
        result = _enqueue(job_type, payload, key, correlation_id, conn=conn, db=db, source=source)
        set_attributes(idempotency_key=result.key, request_id=result.id, created=result.created)
        return result


def _enqueue(
    job_type: str,
    payload: dict[str, Any] | str,
    key: str | None,
    correlation_id: str | None,
    *,
    conn: Connection | None,
    db: Database | None,
    source: str,
) -> EnqueueResult:
    if db is None:
        db = Database(conn.engine) if conn is not None else _default_db()
    if conn is None:
        _ensure_schema(db)
    store = RequestStore(db)
    admitted = admit(
        store, job_type, payload, key, source=source, correlation_id=correlation_id, conn=conn
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
    )
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
