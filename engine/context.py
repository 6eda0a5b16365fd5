"""The :class:`JobContext` a handler works through for one claimed attempt: the claim and its
lease keeper, the one fence it writes with, the attempt record and its timings, the downstream
clients, transactions with row locks, and the concurrency slot of its key.

A handler is a plain function ``handler(ctx, payload) -> result`` that needs no Dagster
context, so the per-request op, the intake's batch ops and the chaos harness all run the same
code through :func:`engine.runtime.execute_request`.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from sqlalchemy.engine import Connection, Row

from engine.attempts import Attempt
from engine.contract import JobType, crash_point
from engine.requests import CancelState, RequestStore
from engine.services import MissingLocks, Services
from resources.errors import RequestCancelled
from resources.flow import Slot
from resources.idempotency import Claim, Keeper
from resources.locks import BaseLock, Fence, fenced, lock_row
from resources.telemetry.tracing import span

T = TypeVar("T")

SEND_BOUND = 0.4
"""The send bound, as a fraction of the lease: after a confirmation (:meth:`JobContext.
confirm_lease`), and of the declared lease after the send's stamp (:meth:`JobContext.
stamp_send`). A settle window must be longer than this much of the declared lease plus the
downstream's longest processing time; an adaptive lease grown past the declared one never
lengthens it."""
SEND_TRIES = 3
"""How many times one attempt confirms its lease and tries a downstream call whose client found
the send bound passed before sending (a pause or a stall each time); then the attempt gives up
as transient, nothing sent. See :meth:`JobContext.confirm_lease`."""


@dataclass
class JobContext:
    """Everything a handler may touch for one claimed attempt."""

    services: Services
    claim: Claim
    attempt: Attempt
    payload: dict[str, Any]
    correlation_id: str | None = None
    keeper: Keeper | None = None
    completed: bool = False
    slot: Slot | None = None
    """The concurrency slot of this payload's key that the caller already holds (a micro-batch
    holds its keys' slots around its effects): :meth:`concurrency_slot` then uses it."""
    cancels: CancelWatch | None = None
    """The cancels of the batch this request runs in, read for all of them at once
    (:class:`CancelWatch`); None: each cancel point asks the store."""
    declared_lease: float | None = None
    """The job type's declared lease (:attr:`engine.durations.LeaseChoice.declared`): a send's
    window after its stamp follows it, not the lease the durations grew; None: the lease."""
    lock: BaseLock | None = None
    """The lock of the job type's exclusive resource while the handler holds it
    (:meth:`exclusive`); None for a type that declares none."""
    _lock_wait: float = field(default=0.0, repr=False)
    _sent: bool = field(default=False, repr=False)
    _stamped: float | None = field(default=None, repr=False)
    _done: list[str] = field(default_factory=list, repr=False)

    @property
    def key(self) -> str:
        return self.claim.key

    @property
    def write_fence(self) -> Fence:
        """The one fence this attempt writes with (:mod:`resources.locks.fencing`): the lock's
        (scope the resource, token the lock's fence) while the handler holds its job type's
        exclusive resource, else the claim's (scope the key, token the ledger's fence). Either
        way a holder that lost its grant to a newer one has its fenced write rejected."""
        if self.lock is not None:
            return Fence.of_lock(self.lock)
        return Fence.of_claim(self.claim)

    @property
    def fence(self) -> int:
        """The token of :attr:`write_fence` (what ``fenced_update`` records on a row)."""
        return self.write_fence.token

    @contextlib.contextmanager
    def exclusive(self, job_type: JobType) -> Iterator[None]:
        """Hold the lock of ``job_type``'s exclusive resource for this payload around the
        block (the engine wraps the handler in it), so no two handlers on the resource
        overlap while the lock is held; a no-op for a type that declares none.

        Waits at most ``Exclusive.wait`` and never past the handler's bound (then
        :class:`LockNotAcquired`, transient); renews until the block ends or the handler's
        bound passes (an abandoned handler's lock then expires by its TTL). The lock may still
        expire under a holder paused longer than its TTL; the fenced write stops that holder::

            t=0   A holds report:r (fence 4), pauses (SIGSTOP) before its write
            t=ttl the lock expires; B, another key on report:r, gets it (fence 5), writes
            later A resumes, writes with (report:r, 4): rejected, nothing of it committed
        """
        resource = job_type.exclusive_on(self.payload)
        exclusive = job_type.running.exclusive
        if resource is None or exclusive is None:
            yield
            return
        if self.services.locks is None:
            raise MissingLocks(job_type.name)
        until = self.keeper.until if self.keeper is not None else None
        left = job_type.running.max_runtime_seconds if until is None else until - time.monotonic()
        lock = self.services.locks(resource, blocking_timeout=max(0.0, min(exclusive.wait, left)),
                                   max_hold=max(left, 0.001))
        self.check_lease()
        started = time.perf_counter()
        with span("lock.exclusive", lock=resource):
            lock.acquire()
        self._add_lock_wait(time.perf_counter() - started)
        if until is not None:  # renewal ends with the handler's bound, not a wait later
            lock.max_hold = max(until - time.monotonic(), 0.001)
        self.lock = lock
        held = time.perf_counter()
        try:
            self.check_lease()
            yield
        finally:
            self.lock = None
            lock.release()
            self.attempt.add_duration("lock_held", time.perf_counter() - held)

    @contextlib.contextmanager
    def fenced_transaction(self, name: str = "transaction") -> Iterator[Connection]:
        """A transaction on the app database that commits only if :attr:`write_fence` is still
        the newest of its scope (:func:`resources.locks.fenced`): :class:`FencedWriteRejected`
        and nothing committed otherwise. The database decides, not a local look at the lock. A
        rejection under a lock is counted in that lock's stats too (``fenced_rejected``)."""
        self.check_lease()
        fence = self.write_fence
        observer = self.lock.observer if self.lock is not None else None
        started = time.perf_counter()
        with self.timed(name), fenced(self.services.db, fence, observer=observer) as conn:
            self._add_lock_wait(time.perf_counter() - started)
            yield conn

    def crash_point(self, name: str) -> None:
        crash_point(name)

    def client(self, name: str) -> Any:
        """The client of the downstream ``name``, one the job type declares in ``clients``:
        :class:`MissingClient` when the services carry none."""
        return self.services.client(name)

    def check_lease(self) -> None:
        """Raise :class:`LeaseLost` if a heartbeat found the lease taken over: stop now."""
        if self.keeper is not None:
            self.keeper.check()

    def stamp_send(self) -> float:
        """The wall-clock time to write down as a send's ``sent_at``, read now: the time a
        settle window counts from. The next :meth:`confirm_lease` caps its send bound at this
        time plus 0.4 of the declared lease (on the monotonic clock), so no byte of the send
        leaves later than ``sent_at + 0.4 * declared``, however long the process paused
        between writing the send down and confirming: a window of the provider's longest
        processing time plus 0.4 of the declared lease is then conclusive. The declared lease,
        not the claim's: an operator sized the window against it, and an adaptive lease grown
        to a job type's ceiling (300 s for a charge: 120 s after ``sent_at``, the whole default
        window) would leave the provider no time before the lookup. Call it right before the
        transaction that writes the send down, once per try."""
        wall, self._stamped = time.time(), time.monotonic()
        return wall

    def confirm_lease(self) -> float:
        """Make sure the lease is still ours now: raises :class:`LeaseLost` if the key was taken
        over. Returns the send bound: a monotonic time after which no request may leave for the
        downstream on the strength of this confirmation.

        Every job type calls it right before each call to a downstream (an SMTP send, a charge):
        effects no fenced write guards. :meth:`check_lease` only reads
        what the background heartbeat last saw, which a worker just resumed from a pause has not
        refreshed yet; this asks the store, unless the claim or a heartbeat was confirmed within
        a tenth of the lease by the monotonic clock (no takeover can happen before the whole
        lease has passed, and a paused process sees the pause on that clock, so it asks).

        The bound is ``asked + 0.4 * lease``, ``asked`` read on the monotonic clock BEFORE the
        round trip, and never later than the send's stamp plus 0.4 of the lease
        (:meth:`stamp_send`): a settle window counts from the ``sent_at`` written down before
        this call, and a pause between the two must not carry the send past it. Timeline
        without the cap: ``sent_at`` at 0, the handler's thread stalls for a lease L while
        the keeper thread beats, the confirmation at L, the send at 1.4 L; a lookup at
        ``sent_at`` plus a window of the provider's time finds nothing yet and charges again.

        The lease was last confirmed at or after ``asked - lease / 10`` (the freshness
        shortcut), so the bound is at most half a lease after the store extended the
        lease to ``confirmation + lease``. A pause after this call is seen by the downstream
        client, which refuses to write the request once the bound passed
        (:class:`SendDeadlinePassed`: nothing sent). Timeline, lease L, keys ignored::

            m0      A reads the monotonic clock, then heartbeats: expiry E >= m0 + L (store time)
            m0+.4L  A's bound: A's client writes no byte after it (a connect is cut to it too)
            E       the lease may run out; a takeover B judges E on its own clock, skewed by s
            E - s   the earliest B can claim; B then waits the settle window from A's sent_at
                    before it looks up by reference and charges blind
            later   A wakes: its bound passed, it sends nothing, re-confirms, gets LeaseLost

        So A's bytes and B's blind charge cannot both happen as long as the skew between the
        clocks judging expiry stays under 0.6 L (18 s with a 30 s lease); the settle window only
        adds margin. Half the lease, not all of it, because skew, the store's own processing
        time and the bound check itself all eat into it. What is left: a pause between the
        client's bound check and its socket write (a few instructions), documented in
        ``docs/design.md``. Each bound granted is written down on the attempt
        (``Attempt.send_bounds``), the evidence ``sekali chaos`` checks every arrival against.

        The bound never reaches past the job type's ``max_runtime_seconds`` (the keeper's
        ``until``): from then on this raises :class:`resources.errors.HandlerTimedOut`, so a
        handler abandoned by the engine (:func:`engine.runtime.execute_request`) that wakes
        up late sends nothing.
        """
        self.check_lease()
        self._stop_if_cancelled("before a downstream call")
        self._sent = True
        asked, asked_wall = time.monotonic(), time.time()
        if self.keeper is not None:
            self.keeper.confirm()
        else:
            self.services.store.heartbeat(self.claim)
        lease = self.claim.lease_seconds
        bound = asked + SEND_BOUND * lease
        if self._stamped is not None:
            sized = min(lease, self.declared_lease or lease)  # what the settle window assumed
            bound = min(bound, self._stamped + SEND_BOUND * sized)
        until = self.keeper.until if self.keeper is not None else None
        if until is not None:  # the handler's own bound ends every send bound too
            bound = min(bound, until)
        self.attempt.add_send_bound(asked_wall, asked_wall + (bound - asked))
        return bound

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        """Record the duration of a critical step, as a span of the request's trace too."""
        started = time.perf_counter()
        try:
            with span(f"step.{name}", key=self.claim.key, fence=self.claim.fence):
                yield
        finally:
            self.attempt.add_duration(name, time.perf_counter() - started)

    @contextlib.contextmanager
    def transaction(self, name: str = "transaction") -> Iterator[Connection]:
        """A transaction on the app database; the time to get it counts as lock wait (on SQLite
        ``BEGIN IMMEDIATE`` waits for the write lock)."""
        self.check_lease()
        started = time.perf_counter()
        with self.timed(name), self.services.db.transaction() as conn:
            self._add_lock_wait(time.perf_counter() - started)
            yield conn

    @contextlib.contextmanager
    def locked_row(
        self, table: str, column: str, value: str, name: str = "transaction"
    ) -> Iterator[tuple[Connection, Row[Any] | None]]:
        """A transaction holding the row lock on ``table.column = value``
        (:func:`resources.locks.lock_row`: ``FOR UPDATE`` on Postgres; SQLite's ``BEGIN
        IMMEDIATE`` already excludes every other writer)."""
        self.check_lease()
        started = time.perf_counter()
        with self.timed(name), self.services.db.transaction() as conn:
            with span("lock.row", lock=f"{table}:{value}", fence=self.fence):
                row = lock_row(conn, table, column, value)
            self._add_lock_wait(time.perf_counter() - started)
            yield conn, row

    @contextlib.contextmanager
    def concurrency_slot(self, job_type: JobType) -> Iterator[Slot | None]:
        """Hold one of ``job_type``'s concurrency slots for this payload's key around a side
        effect: at most its ``Concurrency.limit`` such blocks run at once per key, across workers.

        Waits in line (up to the limits' ``wait``), then :class:`LimitNotAcquired`: transient,
        contention, so it spends no retry budget. The wait is recorded as the duration
        ``concurrency_wait``; the lease is checked again after the wait, before the effect. A no-op
        (yielding None) when the type declares no key or the services carry no limits.
        """
        concurrency = job_type.flow.concurrency
        key = job_type.concurrency_key_for(self.payload)
        limits = self.services.concurrency
        if concurrency is None or key is None or limits is None:
            yield None
            return
        if self.slot is not None:  # held by the batch around every request of this key
            self.check_lease()
            yield self.slot
            return
        self.check_lease()
        started = time.perf_counter()
        with limits.hold(job_type.name, key, concurrency.limit,
                         lease=self.claim.lease_seconds) as slot:
            self.attempt.add_duration("concurrency_wait", time.perf_counter() - started)
            self.check_lease()
            yield slot

    def _add_lock_wait(self, seconds: float) -> None:
        self._lock_wait += seconds
        self.attempt.lock_wait_seconds = round(self._lock_wait, 6)

    def checkpoint(self, point: str, data: Any = None, *, conn: Connection) -> None:
        """Record a recovery point in the transaction that made this phase's effect; a cancel
        point first (:meth:`cancel_point`: a cancel rolls this phase back with the
        transaction)."""
        self.cancel_point(f"checkpoint {point}", conn=conn)
        self.services.store.checkpoint(self.claim, point, data, conn=conn)
        self._done.append(point)

    def cancel_point(self, where: str, *, conn: Connection | None = None) -> None:
        """Raise :class:`RequestCancelled` if the request under this key was cancelled.

        Called at the attempt's start (:func:`engine.runtime.execute_request`) and at each
        :meth:`checkpoint` (inside the transaction that writes it). Never once this attempt may
        have sent something (:meth:`confirm_lease` passed: the send must be recorded, so the
        attempt runs to its end and the cancel is refused when it completes), nor when an
        earlier attempt left a recovery point (its effect may be under way: the phase it names
        is carried on, not stopped half-way). A cancel committed just after a passed cancel
        point is refused the same way: the request either completes with the cancel refused,
        or stops before an effect.

        :meth:`confirm_lease` asks too, right before each downstream call, and there an earlier
        attempt's recovery point does not excuse the attempt: the job type has settled what
        that attempt sent (waited out its window, looked it up, found nothing) before sending
        anew, so stopping there leaves no effect under way (a job type that wrote the send down
        first takes it back when this raises, as after any refusal). Without it a delivery that
        claimed the key after a cancel, following an attempt that wrote its send down, sent
        (the model's ``finding_cancel``).
        """
        if self.claim.recovery_point is not None:
            return
        self._stop_if_cancelled(where, conn=conn)

    def _stop_if_cancelled(self, where: str, *, conn: Connection | None = None) -> None:
        if self._sent:
            return
        if conn is None and self.cancels is not None:
            state = self.cancels.state(self.claim.key)
        else:
            state = RequestStore(self.services.db).cancel_asked(self.claim.key, conn=conn)
        if state in (CancelState.REQUESTED, CancelState.CANCELLED):
            raise RequestCancelled(self.claim.key, where, done=tuple(self._done))

    def complete(self, result: Any, *, conn: Connection) -> None:
        """Mark the key completed in the same transaction as the final effect (refused once
        the lease was lost or the handler's bound passed: an abandoned handler completes
        nothing)."""
        self.check_lease()
        self.services.store.complete(self.claim, result, conn=conn)
        self.completed = True


class CancelWatch:
    """The cancels asked for a batch's requests, read in one statement and reused for
    ``max_age`` seconds by every cancel point of the batch outside a transaction (two
    statements per request before).

    Reading a cancel up to ``max_age`` late is the same as the cancel arriving that much later,
    which the protocol already allows: the request stops at a later cancel point, or completes
    and the statement that completes it refuses the cancel (``refuse_on_completion``). So a
    request is still either completed with its cancel refused, or made no effect after it. A
    cancel is decided at once only while no live holder holds the key, and the batch builds its
    watch after claiming its keys: a cancel it could miss finds the key held and is only
    requested; a holder paused past its lease re-reads (``max_age`` is monotonic time)."""

    def __init__(self, store: RequestStore, keys: Sequence[str], *, max_age: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.keys = list(keys)
        self.max_age = max_age
        self.clock = clock
        self._read_at: float | None = None
        self._states: dict[str, CancelState] = {}

    def state(self, key: str) -> CancelState | None:
        now = self.clock()
        if self._read_at is None or now - self._read_at > self.max_age:
            self._states = self.store.cancels_asked(self.keys)
            self._read_at = now
        return self._states.get(key)


@contextlib.contextmanager
def batch_slots(
    job_type: JobType, contexts: Sequence[JobContext]
) -> Iterator[dict[int, Exception]]:
    """Hold, around a micro-batch's effects, one of ``job_type``'s concurrency slots for each
    distinct key among its payloads, so a batch honours the limit exactly as the per-request
    handlers do with :meth:`JobContext.concurrency_slot`: across every worker, at most
    ``Concurrency.limit`` holders of one key make its effects at once (the requests of one
    batch that share a key run one after another under the one slot).

    Keys are taken in sorted order, so two batches never wait on each other in a cycle. A key
    whose slot could not be had within the limits' wait (:class:`LimitNotAcquired`, transient)
    or at all (Redis down) fails its requests: yields ``{index: error}`` for them, and the caller
    leaves them out. Each other context gets its slot as ``ctx.slot`` for the block, with the
    wait recorded as ``concurrency_wait``. A no-op (yielding ``{}``) when the type declares no
    key or the services carry no limits.
    """
    limits = contexts[0].services.concurrency if contexts else None
    if job_type.flow.concurrency is None or limits is None:
        yield {}
        return
    by_key: dict[str, list[int]] = {}
    for i, ctx in enumerate(contexts):
        by_key.setdefault(str(job_type.concurrency_key_for(ctx.payload)), []).append(i)
    refused: dict[int, Exception] = {}
    with contextlib.ExitStack() as held:
        for key in sorted(by_key):
            started = time.perf_counter()
            try:
                slot = held.enter_context(
                    limits.hold(job_type.name, key, job_type.flow.concurrency.limit,
                                lease=min(contexts[i].claim.lease_seconds for i in by_key[key]))
                )
            except Exception as exc:  # noqa: BLE001 - this key's requests fail, not the batch
                refused.update(dict.fromkeys(by_key[key], exc))
                continue
            waited = time.perf_counter() - started
            for i in by_key[key]:
                contexts[i].slot = slot
                contexts[i].attempt.add_duration("concurrency_wait", waited)
        try:
            yield refused
        finally:
            for ctx in contexts:
                ctx.slot = None


def in_lanes(
    items: Sequence[tuple[JobContext, T]],
    lanes: int,
    work: Callable[[list[tuple[JobContext, T]]], Sequence[Any]],
) -> list[Any]:
    """``work`` over a batch hook's items split into at most ``lanes`` lanes that run at once,
    each in a thread of its own with the caller's context variables (the request's trace, the
    chaos harness's hooks); one result per item, in the items' order.

    For a batch whose effects wait on a downstream's round trips (a mail is four SMTP
    exchanges): ``lanes`` connections overlap their waits where one would wait for each mail in
    turn. Each item is still its own attempt: its lease confirmed and its send bound granted
    in its own lane, right before its own call.

    Items whose contexts share a concurrency slot (:func:`batch_slots` holds one slot for every
    request of a key in the batch) run in one lane, one after another, so a slot still covers
    one effect at a time; within a lane the items keep the batch's order. One lane runs in the
    calling thread (and any lane no thread could be started for), which returns once every
    lane has, so no lane outlives the hook; an exception that escapes ``work`` in
    any lane is raised here after the others finished (a hook catches its items' failures, so
    this is its own failure, and the batch's). ``work`` must give one result per item."""
    groups: dict[tuple[str, int], list[int]] = {}
    for n, (ctx, _) in enumerate(items):
        groups.setdefault(("slot", id(ctx.slot)) if ctx.slot is not None else ("item", n),
                          []).append(n)
    parts: list[list[int]] = [[] for _ in range(max(1, min(lanes, len(groups))))]
    for members in sorted(groups.values(), key=len, reverse=True):
        min(parts, key=len).extend(members)
    for part in parts:
        part.sort()
    if len(parts) == 1:
        return _lane_results(work, list(items), len(items))
    results: list[Any] = [None] * len(items)
    errors: list[BaseException] = []

    def run(part: list[int]) -> None:
        try:
            got = _lane_results(work, [items[n] for n in part], len(part))
        except BaseException as exc:  # noqa: BLE001 - raised by the caller once all lanes end
            errors.append(exc)
            return
        for n, result in zip(part, got, strict=True):
            results[n] = result

    threads: list[threading.Thread] = []
    here = [parts[0]]
    for i, part in enumerate(parts[1:], start=1):
        thread = threading.Thread(target=contextvars.copy_context().run, args=(run, part),
                                  name=f"lane-{i}", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # no thread to be had: the lane runs in this one, after the first
            here.append(part)
            continue
        threads.append(thread)
    for part in here:
        run(part)
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def _lane_results(
    work: Callable[[list[tuple[JobContext, T]]], Sequence[Any]],
    part: list[tuple[JobContext, T]], expected: int,
) -> list[Any]:
    got = list(work(part))
    if len(got) != expected:
        raise RuntimeError(f"a batch lane returned {len(got)} results for {expected} items")
    return got
