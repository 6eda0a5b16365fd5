"""Cancelling requests: the operator's cancel (decided at once when the request never ran and
no delivery holds its key, else requested), the op that stops at a cancel point, the settling
of cancels that waited for the holder of a key, and what a cancel's readers ask.

A cancel never races a claim or a run into an effect after it: the decision is taken in one
transaction holding the request's row, and the status moves that could follow have no
``cancelled`` source (the timelines are :meth:`RequestCancels.cancel`'s).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import bindparam, text
from sqlalchemy.engine import Connection

from engine.requests.model import (
    INTRODUCED_BY,
    NOT_STARTED,
    CancelDecision,
    CancelState,
    JobRequest,
    RequestStatus,
    iso,
)
from engine.requests.views import RequestViews
from resources.dlq import DlqStatus, DlqStore, sources_of
from resources.errors import CancelUnavailable
from resources.idempotency import IdempotencyStore
from resources.storage.db import Database

_S = RequestStatus


class RequestCancels(RequestViews):
    """The cancel of requests, audited in ``request_cancels``."""

    def cancel(self, request_id: int, *, by: str, reason: str | None = None) -> CancelDecision:
        """Cancel one request, audited (``by``, ``reason``, when). One transaction holding the
        request's row (``FOR UPDATE``; SQLite's ``BEGIN IMMEDIATE``), decided by its status:

        - pending, launched (claimed, its run not started), failed (dead-lettered), with its key
          held by no live holder in the ledger: ``cancelled`` at once. The intake claims only
          pending/launched rows and every run path starts with
          :meth:`mark_running`, whose conditional update has no ``cancelled`` source, so the
          request never runs, whichever of cancel and claim commits first::

              claim commits first   -> the row is ``launched``: cancelled; its run's
                                       mark_running moves nothing and the op runs nothing
              cancel commits first  -> the claim skips it (not pending)
              mark_running first    -> the row is ``running``: the case below

        - the same with its key held by a live holder (:meth:`IdempotencyStore.held`): only
          ``requested``, as for a running one. The row says nothing of that holder: a second
          delivery of a running request took the row (``running`` to ``running``), found the
          key held and gave up, failing the request, while the first still works::

              w1 holds the key, passes its last cancel point; w2 takes the row, gives up: failed
              cancel at once  -> cancelled; w1 sends: an effect after the cancel (the model's
                                 finding_cancel)
              cancel requested -> w1 completes (the cancel refused), stops at a cancel point
                                 (cancelled), or gives up: its failure path, the key free, ends
                                 the request cancelled (:meth:`settle_requested_cancel`)

        - running: ``requested``. The op stops at its next cancel point
          (:meth:`engine.context.JobContext.cancel_point`: before its next checkpoint or
          downstream call, never between a send and its record) and the request ends
          ``cancelled``, or it completes first and the statement that completes it refuses the
          cancel (the completion's ``refuse_on_completion``).
        - completed, coalesced: ``refused``, saying why.

        Raises :class:`CancelUnavailable` while a process that cannot read ``cancelled`` may run
        (:meth:`writable`), and ``KeyError`` for an unknown id.
        """
        if not self.writable(_S.CANCELLED):
            raise CancelUnavailable(
                "cancelling needs every process to know the status 'cancelled' (migration"
                f" {INTRODUCED_BY[_S.CANCELLED]}): run `sekali db contract` once no process of"
                " the previous release runs, then cancel again"
            )
        with self.db.transaction() as conn:
            row = conn.execute(text(self._q["lock_request"]), {"id": request_id}).first()
            if row is None:
                raise KeyError(request_id)
            request = JobRequest.from_row(row)
            now = self.clock()
            held = IdempotencyStore.held(conn, request.key, now)
            decided = request.cancel_state in (CancelState.CANCELLED, CancelState.REFUSED)
            if decided or (request.cancel_state is CancelState.REQUESTED
                           and (request.status is _S.RUNNING or held)):
                assert request.cancel_state is not None
                return CancelDecision(request, request.cancel_state,
                                      request.cancel_detail or "", new=False)
            status: RequestStatus = request.status
            if request.status in NOT_STARTED and request.superseded_by is None and held:
                state = CancelState.REQUESTED
                detail = ("requested: another delivery still holds its key; it stops at its"
                          " next cancel point, completes first, or the cancel ends when it"
                          " gives up")
            elif request.status in NOT_STARTED and request.superseded_by is None:
                state, status = CancelState.CANCELLED, _S.CANCELLED
                detail = ("cancelled before it ran" if request.status is not _S.FAILED else
                          "cancelled after a failed run: no replay runs it")
            elif request.status in NOT_STARTED:
                state = CancelState.REFUSED
                detail = (f"refused: superseded by {request.superseded_by}, which carries its"
                          " intent: cancel that one")
            elif request.status is _S.RUNNING:
                state = CancelState.REQUESTED
                detail = ("requested: running, it stops at its next cancel point (before its"
                          " next side effect) or completes first")
            elif request.status is _S.COALESCED:
                state = CancelState.REFUSED
                detail = (f"refused: coalesced into request {request.coalesced_into}, which"
                          " ran instead: cancel that one")
            else:
                state = CancelState.REFUSED
                detail = f"refused: it had completed (at {iso(request.updated_at)})"
            if status is not request.status:
                moved = conn.execute(
                    text(self._q["set_status_seen"]),
                    {"status": str(status), "now": now, "id": request_id,
                     "seen": str(request.status)},
                ).rowcount
                assert moved == 1  # the row is locked: its status cannot have moved
            conn.execute(  # replaces a cancel requested while a run that then failed was running
                text(self._q["upsert_cancel"]),
                {"id": request_id, "state": str(state), "reason": reason, "by": by, "now": now,
                 "decided": None if state is CancelState.REQUESTED else now, "detail": detail},
            )
            row = conn.execute(text(self._q["request_by_id"]), {"id": request_id}).first()
            return CancelDecision(JobRequest.from_row(row), state, detail, new=True)

    def settle_requested_cancel(self, request_id: int, why: str, *, conn: Connection) -> bool:
        """End a cancel that waited for the holder of the request's key, once that holder gave
        up: a request not running under its row (pending, launched, failed) whose cancel is
        ``requested`` and whose key no live holder holds any more ends ``cancelled``, in the
        caller's transaction (the one that dead-letters it: :func:`engine.dead_letters.
        dead_letter`, which then records no dead letter and closes the open ones). ``why``:
        the failure, for the cancel's detail. True if it ended so; False leaves everything as
        it was (no cancel asked, or still held: the holder decides it later)."""
        row = conn.execute(text(self._q["lock_request"]), {"id": request_id}).first()
        if row is None:
            return False
        request = JobRequest.from_row(row)
        now = self.clock()
        if (request.cancel_state is not CancelState.REQUESTED
                or request.status not in NOT_STARTED or request.superseded_by is not None
                or IdempotencyStore.held(conn, request.key, now)):
            return False
        params = {"id": request_id, "now": now, "seen": str(request.status),
                  "detail": f"cancelled: the delivery holding its key ended ({why})"[:2000]}
        moved = conn.execute(text(self._q["cancel_unheld"]), params).rowcount
        if moved:
            conn.execute(text(self._q["decide_requested_cancel"]), params)
        return bool(moved)

    def settle_waiting_cancels(self, *, actor: str, limit: int = 200) -> list[int]:
        """End the cancels still waiting for a holder of the key that ended without a failure
        path (killed, its run gone): each request not running under its row whose cancel is
        ``requested`` ends ``cancelled`` once no live holder holds its key
        (:meth:`settle_requested_cancel`, one transaction each), its open dead letters closed.
        The DLQ sweep's safety net; returns the ids ended."""
        with self.db.statement() as conn:
            waiting = conn.execute(
                text(self._q["waiting_cancels"]), {"n": limit}
            ).scalars().all()
        ended = []
        for request_id in waiting:
            with self.db.transaction() as conn:
                if self.settle_requested_cancel(
                    int(request_id), "it ended without deciding; its lease ran out", conn=conn
                ):
                    ended.append(int(request_id))
        for request_id in ended:
            close_dead_letters(self.db, request_id, actor, "cancelled: the holder of its key ended")
        return ended

    def mark_cancelled(self, request_id: int, detail: str, *, run_id: str | None = None) -> bool:
        """The op stopped at a cancel point: the request ends ``cancelled`` with what was done
        (``detail``). Only a request whose cancel was asked moves."""
        params = {"detail": detail[:2000], "now": self.clock(), "run_id": run_id,
                  "id": request_id}
        with self.db.transaction() as conn:
            moved = conn.execute(text(self._q["mark_cancelled"]), params).rowcount
            if moved:
                conn.execute(text(self._q["record_cancelled"]), params)
        return bool(moved)

    def cancel_asked(self, key: str, *, conn: Connection | None = None) -> CancelState | None:
        """The cancel state of the request stored under ``key`` (None: none asked, or no
        request). In ``conn`` when given (a cancel point inside the effect's transaction)."""
        sql = text(self._q["cancel_state_of_key"])
        if conn is not None:
            value = conn.execute(sql, {"key": key}).scalar()
        else:
            with self.db.statement() as own:
                value = own.execute(sql, {"key": key}).scalar()
        return CancelState(value) if value else None

    def cancels_asked(self, keys: Sequence[str]) -> dict[str, CancelState]:
        """The cancel state of each request stored under one of ``keys`` that has one (one
        statement for a batch's keys)."""
        if not keys:
            return {}
        sql = text(self._q["cancel_states_of_keys"]).bindparams(
            bindparam("keys", expanding=True))
        with self.db.statement() as conn:
            return {str(k): CancelState(v) for k, v in conn.execute(sql, {"keys": list(keys)})}


def cancel_requests(
    store: RequestCancels, refs: Sequence[int | str], *, by: str, reason: str | None = None
) -> list[CancelDecision | KeyError]:
    """Cancel requests by id or key (a string of digits is an id first, then a key), one
    :meth:`RequestStore.cancel` each, in order: the Python call behind ``sekali requests
    cancel`` and the ``cancel_requests`` job. An unknown reference gives its ``KeyError`` in
    place; :class:`CancelUnavailable` is raised before anything changes."""
    out: list[CancelDecision | KeyError] = []
    for ref in refs:
        request = None
        if isinstance(ref, int) or (ref.isdigit() and len(ref) <= 18):
            request = store.get(int(ref))
        if request is None and isinstance(ref, str):
            request = store.get_by_key(ref)
        if request is None:
            out.append(KeyError(ref))
            continue
        decision = store.cancel(request.id, by=by, reason=reason)
        if decision.new and request.status is _S.FAILED and decision.state is CancelState.CANCELLED:
            close_dead_letters(store.db, request.id, by, reason)
        out.append(decision)
    return out


def cancel_view(ref: int | str, decided: CancelDecision | KeyError) -> dict[str, Any]:
    """One reference's row of :func:`cancel_requests` (the CLI's output, the job's table): the
    request, its status, the cancel's state and detail, whether this call decided it; a
    reference that names no request is ``unknown``."""
    if isinstance(decided, CancelDecision):
        state = str(decided.state)
        detail = decided.detail.removeprefix(f"{state}: ")  # shown after the state already
        return {"ref": ref, "id": decided.request.id, "key": decided.request.key,
                "status": str(decided.request.status), "cancel": state,
                "detail": detail, "new": decided.new}
    return {"ref": ref, "id": None, "key": None, "status": None, "cancel": "unknown",
            "detail": "no request with this id or key", "new": False}


def close_dead_letters(db: Database, request_id: int, by: str, reason: str | None) -> None:
    """A cancelled request's open dead letters are discarded, so no replay is offered."""
    dlq = DlqStore(db)
    ids = [r.id for r in dlq.list_records(request_id=request_id,
                                          status=sources_of(DlqStatus.DISCARDED))]
    if ids:
        why = f"request {request_id} cancelled: {reason or 'no reason'}"
        dlq.discard(ids, actor=by, reason=why)
