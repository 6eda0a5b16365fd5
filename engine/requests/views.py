"""What readers see of the requests: a request by id or key, filtered lists, counts, the
states people read, the figures metrics and the tenant views chart, the runs that hold
requests, retention's expiries and conditions, and the refused input. Reads only: every write
is another part of :class:`engine.requests.RequestStore`, which extends :class:`RequestViews`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import bindparam, text

from engine.requests.base import CONDITIONS, StoreBase
from engine.requests.model import CancelState, JobRequest, RequestStatus, state_of
from resources.dlq import UNRESOLVED
from resources.storage.retention import Expiry


class RequestViews(StoreBase):
    """Reads of the intake tables over a :class:`Database`. Thread-safe; share one per
    process."""

    def get(self, request_id: int) -> JobRequest | None:
        with self.db.statement() as conn:
            row = conn.execute(text(self._q["request_by_id"]), {"id": request_id}).first()
        return None if row is None else JobRequest.from_row(row)

    def dedupe_of(self, request_id: int | None, key: str | None = None) -> str | None:
        """The dedupe window the request (by id, else by key) was stored with, as
        :func:`engine.requests.dedupe_label` prints it; None when no such request is kept."""
        request = self.get(request_id) if request_id is not None else None
        if request is None and key:
            request = self.get_by_key(key)
        return None if request is None else request.dedupe

    def get_many(self, request_ids: Sequence[int]) -> list[JobRequest]:
        if not request_ids:
            return []
        sql = text(self._q["requests_by_ids"]).bindparams(bindparam("ids", expanding=True))
        with self.db.statement() as conn:
            return [JobRequest.from_row(r) for r in conn.execute(sql, {"ids": list(request_ids)})]

    def get_by_key(self, key: str) -> JobRequest | None:
        with self.db.statement() as conn:
            row = conn.execute(text(self._q["request_by_key"]), {"key": key}).first()
        return None if row is None else JobRequest.from_row(row)

    def find(
        self,
        *,
        status: Sequence[str] | None = None,
        job_type: str | None = None,
        tenant: str | None = None,
        limit: int = 50,
    ) -> list[JobRequest]:
        """Requests matching every filter given, newest first, at most ``limit``."""
        where: list[str] = []
        params: dict[str, Any] = {"limit": int(limit)}
        if status:
            where.append(self._q["status_filter"])
            params["statuses"] = [str(s) for s in status]
        if job_type is not None:
            where.append(self._q["job_type_filter"])
            params["jt"] = job_type
        if tenant is not None:
            where.append(self._q["tenant_filter"])
            params["tenant"] = tenant
        clause = " AND ".join(where) or self._q["match_all"]
        stmt = text(self._q["find_requests"].format(where=clause))
        if status:
            stmt = stmt.bindparams(bindparam("statuses", expanding=True))
        with self.db.statement() as conn:
            return [JobRequest.from_row(r) for r in conn.execute(stmt, params)]

    def counts(self, job_type: str | None = None) -> dict[str, int]:
        """Requests per status (every status present, zero if none)."""
        with self.db.statement() as conn:
            if job_type:
                rows = conn.execute(text(self._q["counts_of_type"]), {"jt": job_type}).all()
            else:
                rows = conn.execute(text(self._q["counts"])).all()
        out = {str(s): 0 for s in RequestStatus}
        out.update({r.status: int(r.n) for r in rows})
        return out

    def coalesced_into(self, request_id: int) -> list[JobRequest]:
        """The requests coalesced into ``request_id`` (oldest first)."""
        with self.db.statement() as conn:
            rows = conn.execute(text(self._q["coalesced_into"]), {"id": request_id}).all()
        return [JobRequest.from_row(r) for r in rows]

    def superseded_by(self, request_id: int) -> str | None:
        """The key of the version that replaced this request, if any."""
        with self.db.statement() as conn:
            return conn.execute(text(self._q["superseded_by"]), {"id": request_id}).scalar()

    def holders(self) -> list[str]:
        """The runs that hold requests now (``running`` or ``launched`` under their run id):
        what a supervisor checks against the runs still alive."""
        with self.db.statement() as conn:
            rows = conn.execute(text(self._q["holders"])).all()
        return sorted(str(r[0]) for r in rows)

    def failed_without_dlq_record(self, limit: int = 200) -> list[JobRequest]:
        """Requests marked ``failed`` that no DLQ record points at: what a sensor missed, or a
        micro-batch failure that did not fail its step (the DLQ sweep records them)."""
        with self.db.statement() as conn:
            rows = conn.execute(text(self._q["failed_without_dlq_record"]),
                                {"limit": limit}).all()
        return [JobRequest.from_row(r) for r in rows]

    def failed_in_run(self, run_id: str) -> list[JobRequest]:
        """The requests a (batch) run marked failed."""
        with self.db.statement() as conn:
            rows = conn.execute(text(self._q["failed_in_run"]), {"run": run_id}).all()
        return [JobRequest.from_row(r) for r in rows]

    def states(self, requests: Sequence[JobRequest]) -> dict[int, str]:
        """What happened to each request, in one word (:func:`engine.requests.state_of`), with
        one query for the open dead letters among them."""
        failed = [r.id for r in requests if r.status is RequestStatus.FAILED]
        kept: set[int] = set()
        if failed:
            sql = text(self._q["open_dead_letters_of"]).bindparams(
                bindparam("ids", expanding=True), bindparam("open", expanding=True))
            with self.db.statement() as conn:
                kept = {int(i) for i in conn.execute(
                    sql, {"ids": failed, "open": [str(s) for s in UNRESOLVED]}).scalars()}
        return {r.id: state_of(r, dead_lettered=r.id in kept) for r in requests}

    # -- figures (metrics, capacity, tenants) ----------------------------------------------------

    def queue_stats(self) -> list[dict[str, Any]]:
        """Per job type and status (pending, launched): how many, and the oldest ``created_at``."""
        with self.db.statement() as conn:
            return [dict(r._mapping) for r in conn.execute(text(self._q["queue_stats"]))]

    def arrivals(self, since: float, until: float | None = None) -> dict[str, int]:
        """Requests created since ``since`` (and before ``until``) per job type (an index on
        ``created_at``)."""
        with self.db.statement() as conn:
            if until is None:
                rows = conn.execute(text(self._q["arrivals"]), {"since": since}).all()
            else:
                rows = conn.execute(text(self._q["arrivals_between"]),
                                    {"since": since, "until": until}).all()
        return {str(r.job_type): int(r.n) for r in rows}

    def cancel_stats(self, since: float) -> dict[str, int]:
        """Cancels asked since ``since``, per :class:`CancelState` (every state, zero if none)."""
        with self.db.statement() as conn:
            rows = conn.execute(text(self._q["cancel_stats"]), {"since": since}).all()
        out = {str(s): 0 for s in CancelState}
        out.update({str(r.cancel_state): int(r.n) for r in rows})
        return out

    def waiting_by_tenant(self) -> dict[str, int]:
        """Pending requests per tenant."""
        return {t: n for t, (n, _) in self.oldest_waiting_by_tenant().items()}

    def tenant_waits(self, since: float, limit: int = 20_000) -> list[tuple[str, float]]:
        """``(tenant, seconds waited)`` of the requests first claimed since ``since``, the
        newest ``limit`` of them (a bounded sample for percentiles)."""
        with self.db.statement() as conn:
            rows = conn.execute(
                text(self._q["tenant_waits"]), {"since": since, "limit": limit}
            ).all()
        return [(str(r.tenant), float(r.waited)) for r in rows]

    def oldest_waiting_by_tenant(self) -> dict[str, tuple[int, float]]:
        """``{tenant: (pending requests, oldest one's created_at)}``."""
        with self.db.statement() as conn:
            rows = conn.execute(text(self._q["oldest_waiting_by_tenant"])).all()
        return {str(r.tenant): (int(r.n), float(r.oldest)) for r in rows}

    def overtaking(self, tenant: str, since: float) -> int:
        """Requests of other tenants created after ``since`` and claimed already."""
        with self.db.statement() as conn:
            return int(conn.execute(
                text(self._q["overtaking"]), {"since": since, "tenant": tenant}
            ).scalar_one())

    def correlation_ids_since(self, since: float) -> dict[int, str | None]:
        """Request id -> correlation id of the requests created since ``since``."""
        with self.db.statement() as conn:
            rows = conn.execute(text(self._q["correlation_ids_since"]), {"since": since})
            return {int(r.id): r.correlation_id for r in rows}

    # -- retention -------------------------------------------------------------------------------

    def expired(
        self, older_than: float, *, dead_lettered: str, keep: Sequence[str] = ()
    ) -> Expiry:
        """Finished requests last changed more than ``older_than`` seconds ago: completed ones,
        and failed ones the DLQ holds (``dead_lettered``: SQL over ``job_requests.id``, true when
        a DLQ record holds the failure; a failed request not yet dead-lettered is kept for the
        sweep). ``keep`` conditions (an unresolved DLQ record) keep a request whatever its age.
        Purge with ``.purge(db)``, count with ``.count(db)``."""
        return Expiry.of(
            "job_requests",
            "id",
            self._q["expired_requests"].format(dead_lettered=dead_lettered),
            {"cutoff": self.clock() - older_than},
            keep=keep,
            children=(("request_cancels", "request_id"), ("request_sources", "request_id")),
        )

    def expired_rejections(self, older_than: float) -> Expiry:
        """Rejections kept more than ``older_than`` seconds."""
        return Expiry.of(
            "job_rejections", "id", "created_at <= :cutoff", {"cutoff": self.clock() - older_than}
        )

    @staticmethod
    def unfinished_key_reference(column: str) -> str:
        """SQL, true while a request that has not completed carries the key in ``column``: it
        may still run (or be replayed) under that key."""
        return CONDITIONS["unfinished_key_reference"].format(column=column)

    @staticmethod
    def unfinished_request_reference(column: str) -> str:
        """SQL, true while the request whose id is in ``column`` exists and has not completed."""
        return CONDITIONS["unfinished_request_reference"].format(column=column)

    # -- refused input ---------------------------------------------------------------------------

    def rejections(
        self,
        job_type: str | None = None,
        *,
        source: str | None = None,
        limit: int | None = None,
        newest_first: bool = False,
    ) -> list[dict[str, Any]]:
        """Refused requests (oldest first, or newest first), of one job type or way in."""
        where = [self._q[f"rejection_{c}_filter"]
                 for c, v in (("job_type", job_type), ("source", source)) if v]
        sql = self._q["rejections"].format(
            where=" AND ".join(where) or self._q["match_all"],
            order="DESC" if newest_first else "ASC",
            limit=f" LIMIT {int(limit)}" if limit is not None else "",
        )
        with self.db.statement() as conn:
            rows = conn.execute(text(sql), {"job_type": job_type, "source": source}).all()
        return [dict(r._mapping) for r in rows]

    def rejection(self, rejection_id: int) -> dict[str, Any] | None:
        """One refused request, or None."""
        with self.db.statement() as conn:
            row = conn.execute(text(self._q["rejection_by_id"]), {"id": rejection_id}).first()
        return None if row is None else dict(row._mapping)
