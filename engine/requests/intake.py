"""How requests come in: a producer's enqueue (one conditional insert on the unique key, in
the caller's transaction when it passes one: the transactional outbox), the record of a run
nobody enqueued, and the refusals of bad input, kept small whatever was sent."""

from __future__ import annotations

from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Connection

from engine.requests.model import (
    DEFAULT_PRIORITY_AGING,
    Debounced,
    EnqueueResult,
    JobRequest,
    RequestStatus,
)
from engine.requests.views import RequestViews
from engine.tenants import DEFAULT_TENANT
from resources.errors import IdempotencyConflict
from resources.idempotency import payload_hash
from resources.storage.json_text import canonical, digest, masked_digest, storable


class RequestIntake(RequestViews):
    """The writes that add rows: requests and rejections."""

    def enqueue(
        self,
        job_type: str,
        key: str,
        payload: dict[str, Any],
        *,
        queue: str,
        correlation_id: str | None = None,
        traceparent: str | None = None,
        conn: Connection | None = None,
        priority: int = 0,
        dedupe_window: float | None = None,
        debounce: Debounced | None = None,
        aging: float = DEFAULT_PRIORITY_AGING,
        amends: str | None = None,
        tenant: str = DEFAULT_TENANT,
    ) -> EnqueueResult:
        """Write a pending request, or return the existing one for the same key and payload.

        The claim order is ``claim_rank = now - priority * aging``: the request is served as if
        it had arrived ``priority * aging`` seconds earlier (see :meth:`claim_for_launch`).
        ``priority``, ``dedupe_window`` and ``debounce`` are stored as given (the caller,
        :func:`engine.intake.enqueue`, checked them and derived the key); a duplicate keeps the
        first request's. Raises :class:`IdempotencyConflict` when the key exists with another
        payload or type.
        """
        given = payload_hash(payload)
        now = self.clock()
        params = {
            "job_type": job_type,
            "key": key,
            "payload": canonical(payload),
            "hash": given,
            "queue": queue,
            "cid": correlation_id,
            "traceparent": traceparent,
            "now": now,
            "priority": int(priority),
            "rank": now - int(priority) * aging,
            "dedupe_window": dedupe_window,
            "debounce_key": debounce.key if debounce else None,
            "debounce_wait": debounce.wait if debounce else None,
            "debounce_max_wait": debounce.max_wait if debounce else None,
            "amends": amends,
            "status": "pending",
            "run_id": None,
            "tenant": tenant,
        }
        if conn is not None:
            return self._enqueue(conn, params, given)
        with self.db.transaction() as own:
            return self._enqueue(own, params, given)

    def record_run(
        self,
        job_type: str,
        key: str,
        payload: dict[str, Any],
        *,
        queue: str,
        source: str,
        run_id: str | None,
        correlation_id: str | None = None,
        status: RequestStatus = RequestStatus.RUNNING,
    ) -> JobRequest | None:
        """The request record of a run nobody enqueued (launched by hand from the Launchpad, or
        a replay of a dead letter that had none): written ``running`` under its run (or
        ``failed``, for a run about to be launched: never ``pending``, which the intake and the
        workers would take a second time) with its ``source``. The same key and payload stored
        before is that request (the run then takes it through :meth:`mark_running`); None when
        the key is stored with another payload or type (the ledger refuses the run's
        conflicting payload itself)."""
        now = self.clock()
        given = payload_hash(payload)
        params: dict[str, Any] = {
            "job_type": job_type, "key": key, "payload": canonical(payload),
            "hash": given, "queue": queue, "cid": correlation_id,
            "traceparent": None, "now": now, "priority": 0, "rank": now, "dedupe_window": None,
            "debounce_key": None, "debounce_wait": None, "debounce_max_wait": None,
            "amends": None, "status": str(status), "run_id": run_id, "tenant": DEFAULT_TENANT,
        }
        try:
            with self.db.transaction() as conn:
                result = self._enqueue(conn, params, given)
                if result.created:
                    conn.execute(text(self._q["insert_source"]), {"id": result.id, "s": source})
        except IdempotencyConflict:
            return None
        return self.get(result.id)

    def _enqueue(self, conn: Connection, params: dict[str, Any], given: str) -> EnqueueResult:
        row = conn.execute(text(self._q["insert_request"]), params).first()
        if row is not None:
            return EnqueueResult(JobRequest.from_row(row), created=True)
        existing = conn.execute(
            text(self._q["request_row_by_key"]), {"key": params["key"]}
        ).first()
        if existing is None:  # pragma: no cover - the conflicting row was rolled back meanwhile
            return self._enqueue(conn, params, given)
        request = JobRequest.from_row(existing)
        if request.payload_hash != given or request.job_type != params["job_type"]:
            raise IdempotencyConflict(request.key, request.payload_hash, given)
        return EnqueueResult(request, created=False)

    def reject(
        self,
        job_type: Any,
        payload: Any,
        *,
        field: str,
        error: str,
        key: Any = None,
        source: str = "enqueue",
        excerpt_bytes: int = 1024,
        conn: Connection | None = None,
    ) -> int:
        """Keep one refused request; returns the rejection id.

        Whatever was sent, the row is small and storable on both databases, and holds no value
        of the payload: its shape (keys and the kind of each value, ``{"to": "<str 15>"}``:
        :func:`resources.storage.json_text.masked_digest`) within ``excerpt_bytes``, with the
        size and sha256 of the whole (to match it against what the producer sent), and the job
        type, key, field and error bounded the same way.
        """
        described = masked_digest(payload, excerpt_bytes)
        params = {
            "job_type": _bounded(job_type, excerpt_bytes) or "",
            "key": _bounded(key, excerpt_bytes),
            "payload": described.excerpt,
            "size": described.size,
            "sha": described.sha256,
            "field": storable(field, excerpt_bytes),
            "error": storable(error, excerpt_bytes),
            "source": storable(source, 64),
            "now": self.clock(),
        }
        sql = text(self._q["insert_rejection"])
        if conn is not None:
            return int(conn.execute(sql, params).scalar_one())
        with self.db.statement() as own:
            return int(own.execute(sql, params).scalar_one())


def _bounded(value: Any, max_bytes: int) -> str | None:
    """A job type or key as a rejection keeps it: text bounded and storable; None stays None;
    anything else (an int, a list) by its bounded description."""
    if value is None:
        return None
    if isinstance(value, str):
        return storable(value, max_bytes)
    return digest(value, max_bytes).excerpt
