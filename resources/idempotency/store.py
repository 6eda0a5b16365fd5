"""The idempotency store: a key names one business intent, and its effect happens once.

A record per key holds the payload hash, a status, the owner of the current lease, a fencing token
that grows on every claim, the attempt count, a recovery point, and the stored result or failure.

Guarantees (on SQLite and Postgres alike):

- ``begin`` decides in one conditional statement (an upsert whose ``WHERE`` says when a claim may
  be taken), so two workers can never both hold a live claim on one key.
- Every later write (``heartbeat``, ``checkpoint``, ``complete``, ``fail``) is conditional on the
  owner token: a holder whose lease was taken over changes nothing and gets :class:`LeaseLost`.
  Pass ``conn=`` to put the write in your own transaction beside the business change; then the
  effect and the record commit together or not at all.
- The payload hash is checked on every path, completed keys included: the same key with another
  payload is an :class:`IdempotencyConflict`, never a silent replay.

The statuses and their transitions are written beside :class:`Status` (:mod:`.records`); every
statement is a named query of ``queries.sql`` (the claims and batch writes per dialect, run by
:mod:`.dialects`).

Time comes from an injected clock (``time.time`` by default). Workers' clocks must agree to well
within a lease; the lease should be several times the p99 duration of the work between heartbeats
(``sekali doctor`` checks that).

A timeline of the race the lease-plus-owner-token design stops::

    t=0   worker A begins key K (fence 1), charges, then stalls (GC pause, SIGSTOP)
    t=60  A's lease expires; worker B begins K: takeover, fence 2, resumes at A's checkpoint
    t=61  B completes K
    t=62  A wakes and calls complete(K): owner token no longer matches -> LeaseLost, nothing written
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from sqlalchemy import bindparam, text
from sqlalchemy.engine import Connection

from resources.errors import (
    AlreadyInProgress,
    IdempotencyConflict,
    LeaseLost,
    SekaliError,
    StoredFailure,
)
from resources.idempotency.keepers import BatchLeaseKeeper, LeaseKeeper
from resources.idempotency.records import (
    BeginOutcome,
    Claim,
    Completed,
    Record,
    Status,
    payload_hash,
)
from resources.idempotency.views import Clock, LedgerViews
from resources.storage.db import Database
from resources.storage.driver import connect, within
from resources.storage.json_text import to_text
from resources.storage.migrations import ensure_schema

__all__ = ["IdempotencyStore"]

logger = logging.getLogger(__name__)


class IdempotencyStore(LedgerViews):
    """The ledger over a :class:`Database`: every write of ``idempotency_records`` but
    retention's, and (from :class:`LedgerViews`) every read. Thread-safe; share one per
    process."""

    def __init__(
        self,
        db: Database,
        *,
        lease_seconds: float = 60.0,
        retention_seconds: float = 7 * 24 * 3600.0,
        clock: Clock = time.time,
    ) -> None:
        if lease_seconds <= 0:
            raise ValueError("lease_seconds must be positive")
        super().__init__(db, clock=clock)
        self.lease_seconds = lease_seconds
        self.retention_seconds = retention_seconds

    @classmethod
    def from_url(
        cls, url: str, *, lease_seconds: float = 60.0, create_schema: bool = True, **kwargs: Any
    ) -> IdempotencyStore:
        """Open the store at a SQLAlchemy URL. ``create_schema`` (the default): check the schema
        first, applying ``sql/`` where ``SEKALI_AUTO_MIGRATE`` allows (:func:`ensure_schema`)."""
        db = Database.from_url(url)
        if create_schema:
            ensure_schema(db)
        return cls(db, lease_seconds=lease_seconds, **kwargs)

    # -- claiming ---------------------------------------------------------------------------

    def begin(
        self, key: str, *, payload: Any = None, lease_seconds: float | None = None
    ) -> Claim | Completed:
        """Claim ``key``, or return its stored result.

        One round trip on Postgres (one conditional statement that also reads the record it did
        not claim); one ``BEGIN IMMEDIATE`` transaction of two statements on SQLite.

        Raises :class:`IdempotencyConflict` (payload differs), :class:`AlreadyInProgress`
        (another owner's lease is live: retry later) or :class:`StoredFailure` (failed
        permanently before: an operator must reset it). ``lease_seconds``: this claim's lease
        (default the store's), kept by its heartbeats.
        """
        if not key:
            raise ValueError("key must be a non-empty string")
        lease = self._lease(lease_seconds)
        digest = payload_hash(payload)
        owner = uuid.uuid4().hex
        for _ in range(5):
            now = self.clock()
            params = {
                "key": key,
                "hash": digest,
                "owner": owner,
                "now": now,
                "expires": now + lease,
                "solo": 1,
            }
            found = self._ledger.claim(self.db, params)
            if found is None:
                continue  # inserted concurrently after our snapshot: look again
            return self._outcome(*found, digest, now, lease)
        raise SekaliError(f"could not read or claim {key!r} after 5 tries; the store is unstable")

    def begin_many(
        self, items: Sequence[tuple[str, Any]], *, lease_seconds: float | None = None
    ) -> list[BeginOutcome]:
        """:meth:`begin` for a batch of ``(key, payload)``: one statement on Postgres, one
        transaction on SQLite, with exactly the single call's guarantees for every key.

        Returns one outcome per item, in order: a :class:`Claim`, a :class:`Completed`, or the
        error :meth:`begin` would raise for that key (returned, not raised), so one key's
        conflict or live lease never stops its neighbours. A key may appear once per batch.
        Every claim of the batch takes ``lease_seconds`` (default the store's).
        """
        lease = self._lease(lease_seconds)
        keys = [key for key, _ in items]
        if not all(keys):
            raise ValueError("every key must be a non-empty string")
        if len(set(keys)) != len(keys):
            raise ValueError("a key may appear only once in a batch")
        digests = {key: payload_hash(payload) for key, payload in items}
        owners = {key: uuid.uuid4().hex for key in keys}
        answers: dict[str, BeginOutcome] = {}
        todo = sorted(keys)
        for _ in range(5):
            if not todo:
                break
            now = self.clock()
            expires = now + lease
            found = self._ledger.claim_many(self.db, todo, digests, owners, now, expires)
            for key, (record, claimed, previous) in found.items():
                try:
                    answers[key] = self._outcome(record, claimed, previous, digests[key], now,
                                                 lease)
                except SekaliError as exc:
                    answers[key] = exc
            todo = [key for key in todo if key not in found]  # inserted after our snapshot
        for key in todo:
            answers[key] = SekaliError(
                f"could not read or claim {key!r} after 5 tries; the store is unstable"
            )
        return [answers[key] for key in keys]

    def _lease(self, lease_seconds: float | None) -> float:
        if lease_seconds is None:
            return self.lease_seconds
        if not lease_seconds > 0:
            raise ValueError("lease_seconds must be positive")
        return float(lease_seconds)

    def _outcome(
        self, record: Record, claimed: bool, previous: str | None, digest: str, now: float,
        lease: float,
    ) -> Claim | Completed:
        if record.payload_hash != digest:
            raise IdempotencyConflict(record.key, record.payload_hash, digest)
        if claimed:
            assert record.owner_token is not None and record.lease_expires_at is not None
            return Claim(
                key=record.key,
                owner_token=record.owner_token,
                fence=record.fence,
                attempt=record.attempt,
                lease_expires_at=record.lease_expires_at,
                recovery_point=record.recovery_point,
                recovery_data=record.recovery_data,
                takeover=previous == Status.IN_PROGRESS,
                payload_hash=digest,
                crashes=record.crashes,
                lease_seconds=lease,
            )
        if record.status is Status.COMPLETED:
            return Completed(record.key, record.result, record.fence, record.attempt)
        if record.status is Status.FAILED:
            raise StoredFailure(record.key, record.error_class, record.error_message)
        expires = record.lease_expires_at or now
        raise AlreadyInProgress(record.key, record.lease_expires_at, max(0.0, expires - now))

    # -- the owner's writes -----------------------------------------------------------------

    def _owner_update(
        self, claim: Claim, write: str, params: dict[str, Any], conn: Connection | None
    ) -> None:
        """Apply the owner's write ``write`` (a statement conditional on the owner token);
        :class:`LeaseLost` when it changed no row."""
        sql = self._ledger.sql(write)
        params = {**params, "key": claim.key, "owner": claim.owner_token, "now": self.clock()}
        if conn is not None:
            rowcount = within(conn).run(sql, params)
        else:
            with connect(self.db) as own:
                rowcount = own.run(sql, params)
        if rowcount != 1:
            raise LeaseLost(claim.key, claim.owner_token)

    def heartbeat(
        self, claim: Claim, *, conn: Connection | None = None, until: float | None = None
    ) -> float:
        """Extend the lease; returns the new expiry. :class:`LeaseLost` if it was taken over.
        ``until``: the latest expiry the holder may have (store time: its claim + its bound +
        a lease), so a renewal never carries a bounded holder past it."""
        expires = self.clock() + claim.lease_seconds
        if until is not None:
            expires = min(expires, until)
        self._owner_update(claim, "heartbeat", {"expires": expires}, conn)
        return expires

    def checkpoint(
        self, claim: Claim, point: str, data: Any = None, *, conn: Connection | None = None
    ) -> None:
        """Record a recovery point (and extend the lease).

        Pass the ``conn`` of the transaction that made the phase's effect, so the effect and its
        checkpoint commit together: a crash then leaves both or neither.
        """
        self._owner_update(
            claim,
            "checkpoint",
            {"point": point, "data": to_text(data), "expires": self.clock() + claim.lease_seconds},
            conn,
        )

    def complete(self, claim: Claim, result: Any = None, *, conn: Connection | None = None) -> None:
        """Store the result; later ``begin`` calls return it. The ack must come after this."""
        self._owner_update(
            claim,
            "complete",
            {"result": to_text(result), "retain": self.clock() + self.retention_seconds},
            conn,
        )

    def fail(
        self,
        claim: Claim,
        error: BaseException | str,
        kind: str | None = None,
        *,
        conn: Connection | None = None,
    ) -> None:
        """Record a failure. ``transient`` releases the key for a retry; ``permanent`` stores it,
        so duplicates get the stored failure until an operator resets the key.

        ``kind`` defaults to the error's own classification (``SekaliError.permanent``), and to
        transient for anything else.
        """
        if kind is None:
            kind = "permanent" if getattr(error, "permanent", False) else "transient"
        if kind not in ("permanent", "transient"):
            raise ValueError(f"kind must be 'permanent' or 'transient', not {kind!r}")
        status = Status.FAILED if kind == "permanent" else Status.RETRYABLE
        error_class = type(error).__name__ if isinstance(error, BaseException) else "Error"
        self._owner_update(
            claim,
            "fail",
            {"status": status.value, "eclass": error_class, "emsg": str(error)[:4000]},
            conn,
        )

    # -- the owner's writes, for a batch --------------------------------------------------------

    def heartbeat_many(
        self, claims: Sequence[Claim], *, conn: Connection | None = None
    ) -> tuple[float, set[str]]:
        """Extend the leases of a batch in one statement (Postgres) or one transaction (SQLite).

        Returns the new expiry and the keys whose lease was lost (taken over, or no longer in
        progress): nothing is written for those, exactly as :meth:`heartbeat` would refuse.
        Every lease is extended by the longest of the claims' (a batch claims them alike).
        """
        expires = self.clock() + max((c.lease_seconds for c in claims), default=0.0)
        written = self._owner_update_many(claims, "heartbeat", {"expires": expires}, None, conn)
        return expires, {c.key for c in claims} - written

    def complete_many(
        self, items: Sequence[tuple[Claim, Any]], *, conn: Connection | None = None
    ) -> list[LeaseLost | None]:
        """:meth:`complete` for a batch of ``(claim, result)``: one statement on Postgres, one
        transaction on SQLite (or the caller's, with ``conn``).

        Returns one entry per item, in order: None when stored, the :class:`LeaseLost` the single
        call would raise when the claim was taken over (nothing is written for that key). The
        ack of each key must come after this.
        """
        claims = [claim for claim, _ in items]
        results = {claim.key: to_text(result) for claim, result in items}
        written = self._owner_update_many(
            claims,
            "complete",
            {"retain": self.clock() + self.retention_seconds},
            results,
            conn,
        )
        return [
            None if claim.key in written else LeaseLost(claim.key, claim.owner_token)
            for claim in claims
        ]

    def _owner_update_many(
        self,
        claims: Sequence[Claim],
        write: str,
        params: dict[str, Any],
        results: dict[str, str] | None,
        conn: Connection | None,
    ) -> set[str]:
        """Apply an owner's write to every claim still owned; returns the keys written."""
        if not claims:
            return set()
        if len({c.key for c in claims}) != len(claims):
            raise ValueError("a key may appear only once in a batch")
        params = {**params, "now": self.clock()}
        return self._ledger.owner_update_many(self.db, claims, write, params, results, conn)

    def run_alone(self, claim: Claim) -> None:
        """Say that this claim's handler runs alone now (a suspect isolated from its batch):
        if its worker dies before the key ends, the next claim counts a crash against the key.
        A batch's claims count none until then (a group's death names no culprit).
        :class:`LeaseLost` if the claim was taken over."""
        self._owner_update(claim, "run_alone", {}, None)

    def survived(self, claim: Claim) -> bool:
        """Say that this claim's holder is alive after all: it learnt :class:`LeaseLost`, so it
        stalled past its lease (a freeze, a paused VM) rather than died. The takeover that
        counted it as a crash (:attr:`Claim.crashes`) is taken back, so only holders that never
        came back count towards the crash-loop bound. Only for a claim that ran alone (a
        per-request claim, or after :meth:`run_alone`); only when the key was taken over
        (its fence moved past this claim's) and a crash is counted. Returns whether it was."""
        with self.db.statement() as conn:
            return (
                conn.execute(
                    text(self._q["survived"]),
                    {"key": claim.key, "fence": claim.fence, "now": self.clock()},
                ).rowcount
                == 1
            )

    # -- operators and retention ------------------------------------------------------------

    def reset(self, key: str) -> bool:
        """Operator action: a permanently failed key becomes retryable (used by DLQ replay), its
        crash count back to zero (the operator replays a crash loop once its cause is fixed)."""
        with self.db.statement() as conn:
            return (
                conn.execute(
                    text(self._q["reset"]),
                    {"key": key, "now": self.clock()},
                ).rowcount
                == 1
            )

    def continue_fences(
        self, key: str, payload: Any, after: Sequence[str], *, conn: Connection
    ) -> bool:
        """Create ``key`` (absent) as ``retryable`` with the highest fence of the keys in
        ``after``, so its first claim's fence is above every fence they wrote: a new key that
        carries the same intent (a new version of it) writes the same fenced rows, and a fence
        restarting at 1 would be refused there. ``payload`` must be what :meth:`begin` will be
        given. In the caller's transaction; False when ``key`` exists already."""
        if not after:
            return False
        fence = conn.execute(
            text(self._q["highest_fence"]).bindparams(bindparam("keys", expanding=True)),
            {"keys": list(after)},
        ).scalar()
        now = self.clock()
        return bool(
            conn.execute(
                text(self._q["continue_fences"]),
                {"key": key, "hash": payload_hash(payload), "fence": int(fence or 0),
                 "now": now},
            ).rowcount
        )

    # -- convenience ------------------------------------------------------------------------

    @contextlib.contextmanager
    def keep_alive(
        self,
        claim: Claim,
        *,
        interval: float | None = None,
        confirmed_at: float | None = None,
        runtime: float | None = None,
    ) -> Iterator[LeaseKeeper]:
        """Heartbeat in the background while the block runs; ``keeper.check()`` raises
        :class:`LeaseLost` once a heartbeat found the lease taken over.

        ``confirmed_at``: the ``time.monotonic()`` taken just before the claim (or the last
        heartbeat) was asked for, so :meth:`LeaseKeeper.confirm` can skip a heartbeat while the
        claim is that fresh. ``runtime``: the work's bound in seconds from then (the job
        type's ``max_runtime_seconds``): the keeper renews no further (:class:`LeaseKeeper`).
        """
        keeper = LeaseKeeper(self, claim, interval or claim.lease_seconds / 3, confirmed_at,
                             runtime=runtime)
        keeper.start()
        try:
            yield keeper
        finally:
            keeper.stop()

    @contextlib.contextmanager
    def keep_alive_many(
        self,
        claims: Sequence[Claim],
        *,
        interval: float | None = None,
        confirmed_at: float | None = None,
    ) -> Iterator[BatchLeaseKeeper]:
        """:meth:`keep_alive` for a batch: one thread, one statement per beat for every claim."""
        shortest = min((c.lease_seconds for c in claims), default=self.lease_seconds)
        keeper = BatchLeaseKeeper(self, claims, interval or shortest / 3, confirmed_at)
        keeper.start()
        try:
            yield keeper
        finally:
            keeper.stop()

    def fresh_for(self, claims: Sequence[Claim]) -> float:
        """How long after a claim or heartbeat the lease is surely still ours without asking:
        a tenth of the (shortest) lease (a takeover needs the whole lease to pass first)."""
        return min((c.lease_seconds for c in claims), default=self.lease_seconds) / 10

    def run_once(
        self, key: str, fn: Callable[[], Any], *, payload: Any = None, wait: float = 0.0
    ) -> Any:
        """Run ``fn`` at most once per key and return its JSON-serialisable result; every later
        caller gets the stored result. A caller that finds the key in progress waits up to
        ``wait`` seconds for it to finish, then raises :class:`AlreadyInProgress`."""
        deadline = time.monotonic() + wait
        delay = 0.01
        while True:
            try:
                outcome = self.begin(key, payload=payload)
                break
            except AlreadyInProgress:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
                delay = min(delay * 2, 0.5)
        if isinstance(outcome, Completed):
            return outcome.result
        with self.keep_alive(outcome) as keeper:
            try:
                result = fn()
            except BaseException as exc:
                try:
                    self.fail(outcome, exc)
                except Exception:  # noqa: BLE001 - the caller needs fn's error, not this one
                    logger.warning("could not record the failure of %s", key, exc_info=True)
                raise
            keeper.check()
        self.complete(outcome, result)
        return result
