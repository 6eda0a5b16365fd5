"""How a request moves once it is in: taken by a run or a worker, completed, failed, given back
for a retry, taken back from a run that ended, requeued, superseded by a newer version.

Every move is one conditional ``UPDATE`` (``move_requests``) whose ``WHERE status IN`` lists
the statuses :data:`engine.requests.TRANSITIONS` lets move to the target: a move the table
does not allow changes no row, whichever writer raced it. A worker's moves also name its run
(``owner``), so a worker that lost a request moves nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import bindparam, text
from sqlalchemy.engine import Connection

from engine.requests.model import UNTAKEN_BACKOFF, JobRequest, RequestStatus, sources_into
from engine.requests.views import RequestViews

_S = RequestStatus


class RequestLifecycle(RequestViews):
    """The status changes of requests a run or a worker holds."""

    def _move_many(
        self,
        request_ids: Sequence[int],
        target: RequestStatus,
        *,
        run_id: str | None = None,
        error: str | None = None,
        error_class: str | None = None,
        count_attempt: bool = False,
        run_key: str | None = None,
        current: bool = False,
        only: Sequence[RequestStatus] | None = None,
        owner: str | None = None,
        available_at: float | None = None,
        conn: Connection | None = None,
    ) -> set[int]:
        """Move every request that may go to ``target`` in one statement; returns those moved.
        ``current``: only requests no newer version superseded. ``only``: only from these
        statuses (of those that may go to ``target``). ``owner``: only requests its worker
        still holds (``run_id``: :meth:`claim_for_worker`). ``available_at``: a request moved
        back to ``pending`` waits until then. ``conn``: in the caller's transaction."""
        if not request_ids:
            return set()
        filters = " AND run_key = :run_key" if run_key is not None else ""
        if current:
            filters += " AND superseded_by IS NULL"
        if owner is not None:
            filters += " AND run_id = :owner"
        sql = text(
            self._q["move_requests"].format(filters=filters, attempt=1 if count_attempt else 0)
        ).bindparams(bindparam("sources", expanding=True), bindparam("ids", expanding=True))
        params = {
            "target": str(target),
            "now": self.clock(),
            "run_id": run_id,
            "error": error,
            "error_class": error_class,
            "ids": list(request_ids),
            "sources": [str(x) for x in sources_into(target) if only is None or x in only],
            "run_key": run_key,
            "owner": owner,
            "available_at": available_at,
        }
        if conn is not None:
            return self._moved(conn, sql, params, target)
        if target is not _S.COMPLETED:
            with self.db.statement() as own:
                return {int(i) for i in own.execute(sql, params).scalars()}
        with self.db.transaction() as own:
            return self._moved(own, sql, params, target)

    def _moved(
        self, conn: Connection, sql: Any, params: dict[str, Any], target: RequestStatus
    ) -> set[int]:
        """Run the move; a completion refuses, in the same transaction, a cancel still
        ``requested`` (one asked while it ran, not honoured at a cancel point), so a completed
        request never reads as cancelled and a cancel never dangles. A cancel committed before
        the completion's row update is seen here; one after it waits for the row and finds the
        request completed (:meth:`engine.requests.RequestStore.cancel`)."""
        moved = {int(i) for i in conn.execute(sql, params).scalars()}
        if moved and target is _S.COMPLETED:
            conn.execute(
                text(self._q["refuse_on_completion"]).bindparams(bindparam("ids", expanding=True)),
                {"ids": sorted(moved), "now": params["now"]},
            )
        return moved

    def mark_running(self, request_id: int, *, run_id: str | None = None) -> bool:
        """The op took the request (counts an attempt). False if it is already completed."""
        return bool(self._move_many([request_id], _S.RUNNING, run_id=run_id, count_attempt=True))

    def mark_running_many(
        self, request_ids: Sequence[int], *, run_id: str | None = None
    ) -> set[int]:
        """:meth:`mark_running` for a batch in one statement; returns the ids taken."""
        return self._move_many(request_ids, _S.RUNNING, run_id=run_id, count_attempt=True)

    def mark_completed(
        self, request_id: int, *, run_id: str | None = None, run_key: str | None = None
    ) -> bool:
        """``run_key``: only if the request was launched under that run key (reconciliation)."""
        return bool(self._move_many([request_id], _S.COMPLETED, run_id=run_id, run_key=run_key))

    def mark_completed_many(
        self, request_ids: Sequence[int], *, run_id: str | None = None, owner: str | None = None
    ) -> set[int]:
        """:meth:`mark_completed` for a batch in one statement; returns the ids moved.
        ``owner``: only those its worker still holds."""
        return self._move_many(request_ids, _S.COMPLETED, run_id=run_id, owner=owner)

    def mark_failed(
        self,
        request_id: int,
        error: str,
        *,
        error_class: str | None = None,
        run_id: str | None = None,
        run_key: str | None = None,
        owner: str | None = None,
        conn: Connection | None = None,
    ) -> bool:
        """Record a failure with the class the failure path decided (with its DLQ record in
        ``conn``'s transaction: :func:`engine.failures.dead_letter`). ``owner``: only if its
        worker still holds it."""
        moved = self._move_many(
            [request_id],
            _S.FAILED,
            run_id=run_id,
            error=error[:2000],
            error_class=error_class,
            run_key=run_key,
            owner=owner,
            conn=conn,
        )
        return bool(moved)

    def retry_later(
        self, request_id: int, *, owner: str, at: float, error: str, error_class: str
    ) -> bool:
        """A resident worker gives a request back for its retry: ``pending`` again, claimed
        no earlier than ``at`` (the policy's delay), with the error that made it retry. Only
        while ``owner`` still holds it."""
        return bool(self._move_many(
            [request_id], _S.PENDING, owner=owner, available_at=at, error=error[:2000],
            error_class=error_class, only=(_S.RUNNING,),
        ))

    def take_back(self, owners: Sequence[str], available: Callable[[str], float | None]
                  ) -> list[JobRequest]:
        """The requests the runs ``owners`` held when they ended (a worker killed, cut off,
        or ended by Dagster) go back to ``pending``: ``running`` ones (a step had taken them:
        the worker may have died mid-handler) become available when ``available(key)`` says
        (the ledger's lease on the key: a takeover before it would find the key held), and
        ``launched`` ones at once. Returns the requests moved, as they were."""
        if not owners:
            return []
        sql = text(self._q["held_by_runs"]).bindparams(bindparam("owners", expanding=True))
        with self.db.statement() as conn:
            held = [JobRequest.from_row(r) for r in conn.execute(sql, {"owners": list(owners)})]
        moved = []
        now = self.clock()
        for request in held:
            at = available(request.key) if request.status is _S.RUNNING else None
            if self._move_many(
                [request.id], _S.PENDING, owner=request.run_id,
                available_at=at if at is not None and at > now else None,
                only=(_S.RUNNING, _S.LAUNCHED),
            ):
                moved.append(request)
        return moved

    def settle_unsettled(
        self,
        request_ids: Sequence[int],
        *,
        run_id: str,
        run_key: str | None,
        error: str,
        taken_class: str | None,
        backoff: Callable[[JobRequest], float] = lambda r: UNTAKEN_BACKOFF.seconds(r),
    ) -> tuple[int, int]:
        """Settle the requests a run ended without settling, launched under ``run_key``:
        those no step took (still ``pending`` or ``launched``: they never ran, whatever
        Dagster did with the run) go back to ``pending``, claimable after ``backoff(request)``
        seconds, ``"{error}; no step had taken it"`` kept as their last error; those a step took
        (``running``) fail with ``taken_class`` (None: the DLQ reads the step's own failure).
        Returns (how many went back, how many failed)."""
        now = self.clock()
        back = 0
        for request in self.get_many(request_ids):
            if request.status not in (_S.PENDING, _S.LAUNCHED):
                continue
            back += len(self._move_many(
                [request.id], _S.PENDING, run_key=run_key, only=(_S.PENDING, _S.LAUNCHED),
                available_at=now + backoff(request),
                error=f"{error}; no step had taken it: back in the queue"[:2000],
            ))
        taken = self._move_many(
            request_ids, _S.FAILED, run_id=run_id, error=error[:2000], error_class=taken_class,
            run_key=run_key, only=(_S.RUNNING,),
        )
        return back, len(taken)

    def requeue(self, request_id: int) -> bool:
        """A failed request goes back to pending (operator or DLQ replay); never one a newer
        version superseded (:meth:`supersede`)."""
        return bool(self._move_many([request_id], _S.PENDING, current=True, only=(_S.FAILED,)))

    def supersede(self, request_id: int, by_key: str, *, conn: Connection) -> bool:
        """Close a failed request for good: a newer version (``by_key``) carries its intent.
        Only a ``failed`` request not superseded before moves (a request a retry is running
        is not closed under it); in the caller's transaction, with the version's link."""
        moved = conn.execute(
            text(self._q["supersede"]),
            {"by": by_key, "now": self.clock(), "id": request_id},  # admitted: whole
        ).rowcount
        return bool(moved)
