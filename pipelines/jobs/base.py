"""What every job type is made of: a :class:`JobType` (validation, key, budget, handler) and the
:class:`JobContext` its handler works through (claim, lease keeper, attempt record, timings,
concurrency slot).

A handler is a plain function ``handler(ctx, payload) -> result`` that needs no Dagster context,
so the per-request op, the intake's batch ops and the chaos harness all run the same code
through :func:`pipelines.runtime.execute_request`.

Crash points: ``ctx.crash_point("after_charge")`` kills the process with SIGKILL when the
environment variable ``SEKALI_CRASH_AT`` names that point (comma-separated for several), and
stops it with SIGSTOP (a stand-in for a long GC pause or a frozen VM) when ``SEKALI_STOP_AT``
names it. Test hooks for "the worker died / stalled after the side effect"; no-ops otherwise.
"""

from __future__ import annotations

import contextlib
import os
import signal
import string
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import text
from sqlalchemy.engine import Connection, Row

from pipelines.attempts import Attempt
from pipelines.services import Services
from resources.errors import FencedWriteRejected, ValidationError, shown
from resources.flow import Slot
from resources.idempotency import Claim, Keeper
from resources.telemetry.tracing import span

CRASH_ENV = "SEKALI_CRASH_AT"
STOP_ENV = "SEKALI_STOP_AT"


def crash_point(name: str) -> None:
    """Die at once (SIGKILL, no cleanup) if ``SEKALI_CRASH_AT`` names this point, or freeze
    (SIGSTOP, until someone sends SIGCONT) if ``SEKALI_STOP_AT`` does. Test hook."""
    if name in os.environ.get(CRASH_ENV, "").split(","):
        os.kill(os.getpid(), signal.SIGKILL)
    if name in os.environ.get(STOP_ENV, "").split(","):
        os.kill(os.getpid(), signal.SIGSTOP)


Handler = Callable[["JobContext", dict[str, Any]], Any]
BatchHandler = Callable[[Sequence[tuple["JobContext", dict[str, Any]]]], list[Any]]
"""Runs the handler for several claimed requests at once; returns, in order, each one's result
or the exception it failed with (returned, not raised: one failure never stops the others)."""


@dataclass(frozen=True)
class PayloadField:
    """One field of a job type's payload, as a person launching it by hand should see it.

    The declaration is the shape and the words (the Dagster layer turns a job type's fields into
    the typed config of its launch form, so a wrong type or a missing field is refused before a
    run starts, with the field named); the job type's ``validate`` stays the check of values.
    ``type`` is ``str``, ``int``, ``dict`` (a map of strings) or ``list`` (of objects with the
    ``items`` fields); ``choices`` are the only values a ``str`` may take; a field with
    ``required=False`` takes ``default`` (``None`` for a map means empty).
    """

    name: str
    type: type
    description: str
    required: bool = True
    default: Any = None
    choices: tuple[str, ...] = ()
    items: tuple[PayloadField, ...] = ()


ITEMS = PayloadField(
    "items",
    list,
    "What to take from stock: a non-empty list of {sku, quantity}.",
    items=(
        PayloadField("sku", str, "The stock keeping unit (no spaces or ':')."),
        PayloadField("quantity", int, "How many, 1 to 100000."),
    ),
)


@dataclass(frozen=True)
class Debounce:
    """Coalesce a job type's requests of one key: the intake waits until ``wait`` seconds pass
    without a new request for the key, but never longer than ``max_wait`` after the first one
    waiting, then runs one of them (the newest; ``merge`` may fold the payloads, oldest first,
    into the one that runs). The others are kept as ``coalesced`` with a link to it.

    ``key`` is a format string over the validated payload (``"{report}"``).
    """

    wait: float
    max_wait: float
    key: str
    merge: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if not 0 < self.wait <= self.max_wait:
            raise ValueError(f"debounce needs 0 < wait <= max_wait, got {self.wait}, "
                             f"{self.max_wait}")
        if not [f for _, f, _, _ in string.Formatter().parse(self.key) if f]:
            raise ValueError(f"debounce key {self.key!r} names no payload field")


@dataclass(frozen=True)
class JobType:
    """One kind of job: how to check its input, name its intent, and do its effect."""

    name: str
    queue: str  # "heavy" | "light" (tag "sekali/queue")
    validate: Callable[[dict[str, Any]], dict[str, Any]]
    key_for: Callable[[dict[str, Any]], str]
    max_runtime_seconds: float
    side_effect: bool
    handler: Handler
    resource_id: Callable[[dict[str, Any]], str]
    lock: str  # how the resource is protected: "db-row", "db-transaction", "none"
    downstream: str | None = None  # the retry-budget bucket, when an outside service is called
    description: str = ""
    # At most ``concurrency_limit`` side effects at once per key, across every worker: a format
    # string over the validated payload (``"order:{order_id}"``); None for no limit. The
    # handler holds the slot around its side effect with ``ctx.concurrency_slot(JOB_TYPE)``.
    concurrency_key: str | None = None
    concurrency_limit: int = 1
    debounce: Debounce | None = None
    """Coalesce bursts of requests at intake (see :class:`Debounce`); None: every request runs."""
    dedupe_window: float | None = None
    """How long a key means the same intent: None is "until finished" (a key done once is done
    while its records are kept); seconds (86400 for a daily digest) make the stored key
    ``<key>@<window start, UTC>``, so the same key in a later window is a new intent."""

    def __post_init__(self) -> None:
        if self.dedupe_window is not None and self.dedupe_window < 1:
            raise ValueError(f"{self.name}: dedupe_window must be at least 1 second")
        if self.concurrency_limit < 1:
            raise ValueError(f"{self.name}: concurrency_limit must be >= 1")
        if self.concurrency_key is not None:
            fields = [f for _, f, _, _ in string.Formatter().parse(self.concurrency_key) if f]
            if not fields:
                raise ValueError(
                    f"{self.name}: concurrency_key {self.concurrency_key!r} names no payload "
                    "field, so every request would share one key"
                )
    fields: tuple[PayloadField, ...] = ()
    """The payload's fields, in the order a form shows them (``validate`` accepts exactly these).
    """
    example: dict[str, Any] = field(default_factory=dict, hash=False)
    """A valid payload: what the launch form opens with."""
    result_fields: tuple[str, ...] = ()
    """The result's fields that name the effect (charge id, message id), shown on the run."""
    personal: frozenset[str] = frozenset()  # payload fields masked in logs, errors and views
    handler_many: BatchHandler | None = None
    """Optional: the effects of a micro-batch in as few transactions or connections as the job
    type allows. Without it a batch runs ``handler`` once per request."""

    @property
    def op_name(self) -> str:
        return f"{self.name}_op"

    @property
    def intake_summary(self) -> str:
        """How the intake treats this type's requests, in words (shown on the Dagster job)."""
        window = "until finished" if self.dedupe_window is None else f"{self.dedupe_window:g} s"
        words = f"A key means one intent {window}."
        if self.debounce is not None:
            d = self.debounce
            words += (
                f" Debounced per {d.key}: runs {d.wait:g} s after the last request, at least "
                f"every {d.max_wait:g} s; the others are recorded as coalesced."
            )
        return words

    def debounce_key_for(self, payload: dict[str, Any]) -> str | None:
        """The debounce group of a validated payload (job type included), or None."""
        if self.debounce is None:
            return None
        return f"{self.name}:{self.debounce.key.format_map(payload)}"

    def concurrency_key_for(self, payload: dict[str, Any]) -> str | None:
        """The concurrency key of a validated payload, or None when the type has no limit."""
        if self.concurrency_key is None:
            return None
        return self.concurrency_key.format_map(payload)


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
    _lock_wait: float = field(default=0.0, repr=False)

    @property
    def key(self) -> str:
        return self.claim.key

    @property
    def fence(self) -> int:
        return self.claim.fence

    def crash_point(self, name: str) -> None:
        crash_point(name)

    def check_lease(self) -> None:
        """Raise :class:`LeaseLost` if a heartbeat found the lease taken over: stop now."""
        if self.keeper is not None:
            self.keeper.check()

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
        round trip. The lease was last confirmed at or after ``asked - lease / 10`` (the
        freshness shortcut), so the bound is at most half a lease after the store extended the
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
        ``docs/design.md``.
        """
        self.check_lease()
        asked = time.monotonic()
        if self.keeper is not None:
            self.keeper.confirm()
        else:
            self.services.store.heartbeat(self.claim)
        lease = self.services.store.lease_seconds
        return asked + lease / 2 - lease / 10

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
        """A transaction holding the row lock on ``table.column = value`` (``FOR UPDATE`` on
        Postgres; SQLite's ``BEGIN IMMEDIATE`` already excludes every other writer)."""
        lock = " FOR UPDATE" if self.services.db.is_postgres else ""
        self.check_lease()
        started = time.perf_counter()
        with self.timed(name), self.services.db.transaction() as conn:
            with span("lock.row", lock=f"{table}:{value}", fence=self.fence):
                row = conn.execute(
                    text(f"SELECT * FROM {table} WHERE {column} = :v{lock}"), {"v": value}
                ).first()
            self._add_lock_wait(time.perf_counter() - started)
            yield conn, row

    @contextlib.contextmanager
    def concurrency_slot(self, job_type: JobType) -> Iterator[Slot | None]:
        """Hold one of ``job_type``'s concurrency slots for this payload's key around a side
        effect: at most ``concurrency_limit`` such blocks run at once per key, across workers.

        Waits in line (up to the limits' ``wait``), then :class:`LimitNotAcquired`: transient,
        contention, so it spends no retry budget. The wait is recorded as the duration
        ``concurrency_wait``; the lease is checked again after the wait, before the effect. A no-op
        (yielding None) when the type declares no key or the services carry no limits.
        """
        key = job_type.concurrency_key_for(self.payload)
        limits = self.services.concurrency
        if key is None or limits is None:
            yield None
            return
        if self.slot is not None:  # held by the batch around every request of this key
            self.check_lease()
            yield self.slot
            return
        self.check_lease()
        started = time.perf_counter()
        with limits.hold(job_type.name, key, job_type.concurrency_limit) as slot:
            self.attempt.add_duration("concurrency_wait", time.perf_counter() - started)
            self.check_lease()
            yield slot

    def _add_lock_wait(self, seconds: float) -> None:
        self._lock_wait += seconds
        self.attempt.lock_wait_seconds = round(self._lock_wait, 6)

    def checkpoint(self, point: str, data: Any = None, *, conn: Connection) -> None:
        """Record a recovery point in the transaction that made this phase's effect."""
        self.services.store.checkpoint(self.claim, point, data, conn=conn)

    def complete(self, result: Any, *, conn: Connection) -> None:
        """Mark the key completed in the same transaction as the final effect."""
        self.services.store.complete(self.claim, result, conn=conn)
        self.completed = True


@contextlib.contextmanager
def batch_slots(
    job_type: JobType, contexts: Sequence[JobContext]
) -> Iterator[dict[int, Exception]]:
    """Hold, around a micro-batch's effects, one of ``job_type``'s concurrency slots for each
    distinct key among its payloads, so a batch honours the limit exactly as the per-request
    handlers do with :meth:`JobContext.concurrency_slot`: across every worker, at most
    ``concurrency_limit`` holders of one key make its effects at once (the requests of one
    batch that share a key run one after another under the one slot).

    Keys are taken in sorted order, so two batches never wait on each other in a cycle. A key
    whose slot could not be had within the limits' wait (:class:`LimitNotAcquired`, transient)
    or at all (Redis down) fails its requests: yields ``{index: error}`` for them, and the caller
    leaves them out. Each other context gets its slot as ``ctx.slot`` for the block, with the
    wait recorded as ``concurrency_wait``. A no-op (yielding ``{}``) when the type declares no
    key or the services carry no limits.
    """
    limits = contexts[0].services.concurrency if contexts else None
    if job_type.concurrency_key is None or limits is None:
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
                    limits.hold(job_type.name, key, job_type.concurrency_limit)
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


def fenced_update(
    conn: Connection,
    table: str,
    column: str,
    value: str,
    *,
    fence_column: str,
    fence: int,
    assignments: str,
    params: dict[str, Any] | None = None,
) -> None:
    """``UPDATE`` that applies only if no newer holder has written (``fence_column <= fence``);
    it records ``fence``. A stale holder gets :class:`FencedWriteRejected` and changes nothing."""
    sql = (
        f"UPDATE {table} SET {assignments}, {fence_column} = :fence"
        f" WHERE {column} = :v AND {fence_column} <= :fence"
    )
    rowcount = conn.execute(text(sql), {**(params or {}), "v": value, "fence": fence}).rowcount
    if rowcount != 1:
        highest = conn.execute(
            text(f"SELECT {fence_column} FROM {table} WHERE {column} = :v"), {"v": value}
        ).scalar()
        raise FencedWriteRejected(f"{table}:{value}", fence, highest)


# -- validation helpers: each names the field it rejects --------------------------------------


def require_str(payload: dict[str, Any], field_name: str, *, max_len: int = 200) -> str:
    value = payload.get(field_name)
    if value is None:
        raise ValidationError(field_name, "required: a non-empty string")
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise ValidationError(
            field_name, f"must be a non-empty string, got {shown(value)}", value
        )
    value = value.strip()
    if len(value) > max_len or any(ch.isspace() or ch == ":" for ch in value):
        raise ValidationError(
            field_name, f"must be at most {max_len} characters with no spaces or ':', "
            f"got {shown(value)}", value
        )
    return value


def require_int(
    payload: dict[str, Any], field_name: str, *, minimum: int = 1, maximum: int = 10**12
) -> int:
    value = payload.get(field_name)
    if value is None:
        raise ValidationError(field_name, "required: an integer")
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(field_name, f"must be an integer, got {shown(value)}", value)
    if not minimum <= value <= maximum:
        raise ValidationError(
            field_name, f"must be between {minimum} and {maximum}, got {value}", value
        )
    return value


def require_items(payload: dict[str, Any], field_name: str = "items") -> list[dict[str, Any]]:
    """A non-empty list of ``{sku, quantity}``; errors name the item, e.g. ``items[2].quantity``."""
    items = payload.get(field_name)
    if items is None:
        raise ValidationError(field_name, "required: a non-empty list of {sku, quantity}")
    if not isinstance(items, list) or not items:
        raise ValidationError(
            field_name, f"must be a non-empty list of {{sku, quantity}}, got {shown(items)}",
            items,
        )
    clean = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValidationError(
                f"{field_name}[{i}]", f"must be an object {{sku, quantity}}, got {shown(item)}",
                item,
            )
        try:
            reject_unknown(item, {"sku", "quantity"})
            clean.append(
                {
                    "sku": require_str(item, "sku"),
                    "quantity": require_int(item, "quantity", maximum=100_000),
                }
            )
        except ValidationError as exc:
            field = f"{field_name}[{i}].{exc.field}"
            raise ValidationError(field, exc.problem, exc.value) from None
    return sorted(clean, key=lambda it: it["sku"])


def reject_unknown(payload: dict[str, Any], allowed: set[str]) -> None:
    extra = sorted(set(payload) - allowed)
    if extra:
        raise ValidationError(extra[0], f"unknown field (allowed: {', '.join(sorted(allowed))})")
