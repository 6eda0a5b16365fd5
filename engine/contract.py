"""What a job type declares: the :class:`JobType` (its payload's fields and validation, its
key, queue, budget and side-effect nature, flow-control needs, the downstreams it calls and its
upkeep hooks), and the helpers every job type uses to check input and write fenced (with the
one fence of its context, ``ctx.write_fence``: :mod:`resources.locks.fencing`).

A job type is one module that defines a module-level ``JOB_TYPE`` (or several in a ``JOB_TYPES``
list); the registry (:mod:`engine.registry`) finds it, and everything else is derived from the
declaration. The handler works through :class:`engine.context.JobContext`.

Crash points: ``ctx.crash_point("after_charge")`` kills the process with SIGKILL when the
environment variable ``SEKALI_CRASH_AT`` names that point (comma-separated for several), and
stops it with SIGSTOP (a stand-in for a long GC pause or a frozen VM) when ``SEKALI_STOP_AT``
names it. Test hooks for "the worker died / stalled after the side effect"; no-ops otherwise.
"""

from __future__ import annotations

import functools
import os
import signal
import string
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from sqlalchemy.engine import Connection

from engine import payloads
from engine.chaos import ChaosProof
from engine.downstreams import Downstream
from engine.downstreams import Effect as Effect  # re-exported: the lookup hook's value
from engine.durations import LeaseBounds
from engine.payloads import PayloadField as PayloadField  # re-exported: the contract names it
from engine.tenants import DEFAULT_TENANT, check_tenant
from resources.errors import ValidationError, shown
from resources.locks.fencing import fenced as fenced  # re-exported: job types
from resources.locks.fencing import fenced_update as fenced_update  # re-exported: job types
from resources.send_bound import WRITES
from resources.storage.db import Database
from resources.storage.retention import Expiry

if TYPE_CHECKING:
    from engine.context import JobContext

DELIVERIES = ("resident", "per_request", "fan_out", "micro_batch")
"""The ways a job type's requests may reach its handler (:class:`engine.delivery.Delivery`)."""
CRASH_ENV = "SEKALI_CRASH_AT"
STOP_ENV = "SEKALI_STOP_AT"
LOOKUP_FIRST_ENV = "SEKALI_LOOKUP_FIRST"


def crash_point(name: str) -> None:
    """Die at once (SIGKILL, no cleanup) if ``SEKALI_CRASH_AT`` names this point, or freeze
    (SIGSTOP, until someone sends SIGCONT) if ``SEKALI_STOP_AT`` does. Test hook."""
    if name in os.environ.get(CRASH_ENV, "").split(","):
        os.kill(os.getpid(), signal.SIGKILL)
    if name in os.environ.get(STOP_ENV, "").split(","):
        freeze_here()


def freeze_here() -> None:
    """Stop this process (SIGSTOP) before the calling thread runs one more instruction. The
    signal is sent to the calling thread (``pthread_kill``): sent to the process from any
    thread but the main one (handlers run in threads of their own,
    :func:`engine.runtime.run_bounded`), the process stops only once the thread the kernel
    picked handles it, and the caller runs on meanwhile, past the point meant (13 times in 30
    in a probe on a loaded machine; 0 in 30 this way). The other threads' bounded writes
    under way end first (:data:`resources.send_bound.WRITES`): a batch's other lanes are
    frozen wherever they are, but never between a send bound's check and its write."""
    with WRITES.quiesced():
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


P = TypeVar("P")
"""A job type's payload: its ``payload`` model, or the validated dict when it declares none."""
Handler = Callable[["JobContext", P], Any]
"""``handler(ctx, payload) -> result``: ``ctx`` is the :class:`engine.context.JobContext` of
the claimed attempt, ``payload`` the validated payload: an instance of the job type's
``payload`` model when it declares one, else the validated dict."""
BatchHandler = Callable[[Sequence[tuple[Any, Any]]], list[Any]]
"""Runs the handler for several claimed requests at once (``(ctx, payload)`` pairs); returns,
in order, each one's result or the exception it failed with (returned, not raised: one failure
never stops the others)."""


Lookup = Callable[[Callable[[str], Any], str, Any], Sequence[Effect]]
"""``lookup(client, key, payload) -> effects``: the effects the downstream holds for this
intent (idempotency key ``key``, validated ``payload``); ``client(name)`` returns a declared
downstream's client. Empty: it never happened; one: it happened; more: duplicates. Raises when
the downstream cannot answer (then nothing is concluded)."""


@dataclass(frozen=True)
class Debounce:
    """Coalesce a job type's requests of one key: the intake waits until ``wait`` seconds pass
    without a new request for the key, but never longer than ``max_wait`` after the first one
    waiting, then runs one of them (the newest; ``merge`` may fold the payloads, oldest first,
    into the one that runs). The others are kept as ``coalesced`` with a link to it.

    ``key`` is a format string over the validated payload (``"{account_id}"``).
    """

    wait: float
    max_wait: float
    key: str
    merge: Callable[[list[dict[str, Any]]], dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if not 0 < self.wait <= self.max_wait:
            raise ValueError(f"debounce needs 0 < wait <= max_wait, got {self.wait}, "
                             f"{self.max_wait}")
        if not field_names(self.key):
            raise ValueError(f"debounce key {self.key!r} names no payload field")


class Reconciling(Protocol):
    """What a job type's reconciliation hook may use: the running
    :class:`engine.upkeep.reconciliation.Reconciler` gives it."""

    db: Database
    grace: float
    lookback: float
    settle: float
    clock: Callable[[], float]

    def client(self, name: str) -> Any:
        """The downstream's client, or None when this run has none (its checks are skipped)."""
        ...

    def done(self, action_key: str) -> bool: ...

    def act(
        self, report: Any, action_key: str, kind: str, subject: str,
        fix: Callable[[Connection], Any],
    ) -> bool: ...


class Tally(Protocol):
    """A reconciliation report's counts per check: what was found, what was fixed."""

    found: dict[str, int]
    fixed: dict[str, int]


ReconcileHook = Callable[[Reconciling, Tally], None]
CacheLoader = Callable[[], Any]


@dataclass(frozen=True)
class Retained:
    """A table a job type owns that grows: the upkeep purges it after ``setting`` (a field of
    :class:`resources.storage.settings.RetentionSettings`). ``expired(older_than, now)`` says
    which rows may go."""

    table: str
    setting: str
    expired: Callable[[float, float], Expiry]


PLATFORM_NEEDS = frozenset({"cache"})


def op_name_of(job_type: str) -> str:
    """The name of a job type's per-request op (its run config is keyed by it)."""
    return f"{job_type}_op"


def _not_declared(payload: dict[str, Any]) -> dict[str, Any]:
    raise AssertionError("replaced in JobType.__post_init__")


def field_names(template: str) -> tuple[str, ...]:
    """The payload fields a format string (a key, a concurrency or fairness key) names."""
    return tuple(f for _, f, _, _ in string.Formatter().parse(template) if f)


def formatted(template: str) -> Callable[[dict[str, Any]], str]:
    """``Keying(key_for=formatted("points:{account_id}"), ...)``: a format string over the validated
    payload's fields, as a function (the fields it names are checked against ``payload``)."""
    names = field_names(template)
    if not names:
        raise ValueError(f"{template!r} names no payload field")

    def fill(payload: dict[str, Any]) -> str:
        return template.format_map(payload)

    fill.__qualname__ = fill.__name__ = f"formatted({template!r})"
    fill.names = names  # type: ignore[attr-defined]
    return fill


class Queue(StrEnum):
    """The run queue a job type's requests wait in (tag ``sekali/queue``): a sick heavy
    downstream holds the heavy workers, never the light ones."""

    HEAVY = "heavy"
    LIGHT = "light"


KeyHook = Callable[[dict[str, Any]], str]
"""``validated payload -> text``: an idempotency key or a resource id (see :func:`formatted`)."""


@dataclass(frozen=True, kw_only=True)
class Keying:
    """How a payload names its intent: ``key_for`` its idempotency key (the business intent,
    never a message id), ``resource_id`` what it acts on (for traces and attempts).

    ``prefix`` is what every key of the type starts with (``points:``), so a key alone names
    its type; by default the example's key up to its first ``:``. ``dedupe_window`` is how
    long a key means the same intent: None is "until finished" (a key done once is done while
    its records are kept); seconds (86400 for a daily digest) make the stored key
    ``<key>@<window start, UTC>``, so the same key in a later window is a new intent.
    """

    key_for: KeyHook
    resource_id: KeyHook
    prefix: str | None = None
    dedupe_window: float | None = None


@dataclass(frozen=True)
class Exclusive:
    """Handlers of this job type on one resource never overlap, across every worker: ``on``
    names the resource from the validated payload (``formatted("report:{report}")``; job types
    naming the same resource serialise with each other).

    The engine holds the lock of that name (the ``locks`` service, Redis or the database)
    around the handler, waiting at most ``wait`` seconds (then :class:`LockNotAcquired`,
    transient), renewing it until the handler returns or its ``max_runtime_seconds`` pass, and
    gives the handler the lock's fence as ``ctx.write_fence``: a handler whose lock expired
    (a pause past the TTL) has its fenced write rejected by the database
    (:mod:`resources.locks.fencing`). The claim still keeps one effect per key; the lock
    serialises different keys on one resource."""

    on: Callable[[dict[str, Any]], str]
    wait: float = 30.0

    def __post_init__(self) -> None:
        if self.wait < 0:
            raise ValueError(f"exclusive wait must be >= 0, got {self.wait}")


@dataclass(frozen=True, kw_only=True)
class Running:
    """How a request runs: its budget, how it reaches the handler, its lease.

    ``delivery`` (:mod:`engine.delivery`): None for the platform's default (resident workers:
    a job starts within milliseconds); ``per_request`` when each request must be a Dagster run
    of its own, a person's to watch; ``micro_batch`` or ``fan_out`` for a run per batch.
    ``lease``: declared until durations are observed, then p99.9 x a factor between a floor
    and a ceiling (:mod:`engine.durations`); None: the platform's defaults. ``needs``: platform
    services beyond the ledger the handler uses (``cache``; no lock: the claim and its fence
    are the mutual exclusion of one key). ``exclusive``: the resource whose handlers must not
    overlap across keys (:class:`Exclusive`); None: the claim alone. ``handler_many``: the
    effects of a micro-batch in as few transactions or connections as the type allows; without
    it a batch runs the handler once per request.
    """

    max_runtime_seconds: float
    delivery: str | None = None
    lease: LeaseBounds | None = None
    needs: frozenset[str] = frozenset()
    exclusive: Exclusive | None = None
    handler_many: BatchHandler | None = None


@dataclass(frozen=True, kw_only=True)
class Calls:
    """The downstreams the handler calls (``ctx.client(name)``; their clients, resources,
    rates and sandboxes follow from these declarations) and how to ask them what happened.

    ``budget`` is the retry-budget bucket: by default the first client's name; None when it
    has none. ``lookup`` asks the downstream what it holds for one intent (see :data:`Lookup`):
    how reconciliation, the chaos checker and a person tell "it happened" from "it never did"
    when the outcome of a send is unknown; a type with a side effect at a downstream should
    declare it (:attr:`JobType.missing_lookup`). ``lookup_first``: whether the handler looks
    its effect up before its first send too, the guard against a completed key rolled back (a
    failover to an asynchronous standby, a restore from backup) and its effect made again;
    None: on when a client does not dedupe by idempotency key (``Downstream.dedupes``);
    ``SEKALI_LOOKUP_FIRST`` overrides it (:meth:`JobType.looks_up_first`).
    """

    clients: tuple[Downstream, ...] = ()
    budget: str | None = None
    lookup: Lookup | None = None
    lookup_first: bool | None = None

    def __post_init__(self) -> None:
        if self.budget is None and self.clients:
            object.__setattr__(self, "budget", self.clients[0].name)


@dataclass(frozen=True)
class Concurrency:
    """At most ``limit`` side effects at once per ``key``, across every worker: a format string
    over the validated payload (``"account:{account_id}"``), or a function of it (a key the
    payload does not spell, such as the host a URL names). The handler holds the slot around
    its side effect with ``ctx.concurrency_slot(JOB_TYPE)``."""

    key: str | KeyHook
    limit: int = 1


@dataclass(frozen=True, kw_only=True)
class FlowControl:
    """What the intake and the workers hold back: a :class:`Concurrency` limit (None: none),
    the ``fairness_key`` naming a request's tenant for fair share (a format string over the
    validated payload, ``"{customer_id}"``; None: every request is the default tenant's,
    :mod:`engine.tenants`), and a :class:`Debounce` of bursts (None: every request runs)."""

    concurrency: Concurrency | None = None
    fairness_key: str | None = None
    debounce: Debounce | None = None


@dataclass(frozen=True, kw_only=True)
class Upkeep:
    """What the job type adds to reconciliation, retention, warming, the doctor and the chaos
    proof.

    ``reconcile`` finds what the happy path left inconsistent and fixes it once (``act``), run
    by every reconciliation pass before the platform's own checks; ``checks`` names what it
    counts, in order. ``watches``: SQL conditions on ``reconciliation_actions`` under which a
    recorded action must stay (``:watched_since`` is the lookback's start). ``retained``: its
    own tables that retention purges. ``cache_loader``: the loader of a cache key it fills
    (None for a key not its own), so warming refreshes hot keys. ``unique``: ``(table,
    columns)`` that must be unique for its effect to happen once; the doctor checks the live
    schema has them. ``chaos``: what ``sekali chaos`` needs of it beyond this declaration
    (:class:`engine.chaos.ChaosProof`; None: judged by the declaration alone).
    """

    checks: tuple[str, ...] = ()
    reconcile: ReconcileHook | None = None
    watches: tuple[str, ...] = ()
    retained: tuple[Retained, ...] = ()
    cache_loader: Callable[[Database, str], CacheLoader | None] | None = None
    unique: tuple[tuple[str, tuple[str, ...]], ...] = ()
    chaos: ChaosProof | None = None


@dataclass(frozen=True, kw_only=True)
class Presentation:
    """How people see the job type: its ``description``; the launch form's ``fields``, in the
    order a form shows them, and its ``example`` (both follow from the payload model when not
    given); the ``result_fields`` that name the effect (the downstream's id of it), shown on the
    run; the ``personal`` payload fields masked in logs, errors and views."""

    description: str = ""
    fields: tuple[PayloadField, ...] = ()
    example: dict[str, Any] = field(default_factory=dict, hash=False)
    result_fields: tuple[str, ...] = ()
    personal: frozenset[str] = frozenset()


@dataclass(frozen=True, kw_only=True)
class JobType(Generic[P]):
    """One kind of job: how to check its input, name its intent, and do its effect, and what it
    adds to the platform's upkeep. Nothing outside the job type's module names it: the
    registry, the Dagster jobs and resources, reconciliation and retention read these fields.

    The payload is declared once, as ``payload=<pydantic model or dataclass>``: the launch
    form's ``fields`` and ``example``, ``validate`` and the object the handler gets follow from
    it (:mod:`engine.payloads`), and the type checker holds the handler's annotation to it. A
    type may instead give ``validate`` (and ``presentation.fields``) by hand; then its handler
    gets the validated dict. The options come in groups: :class:`Keying`, :class:`Running`,
    :class:`Calls`, :class:`FlowControl`, :class:`Upkeep`, :class:`Presentation`.
    """

    name: str
    queue: Queue
    payload: type[P] | None = None
    validate: Callable[[dict[str, Any]], dict[str, Any]] = _not_declared
    """``payload -> validated dict`` (refusals name the field); derived from ``payload``."""
    handler: Handler[P]
    side_effect: bool
    keying: Keying
    running: Running
    calls: Calls = Calls()
    flow: FlowControl = FlowControl()
    upkeep: Upkeep = Upkeep()
    presentation: Presentation = Presentation()

    def looks_up_first(self) -> bool:
        """This type's ``calls.lookup_first``, after ``SEKALI_LOOKUP_FIRST`` (read at each call,
        so an operator's change reaches the next request)."""
        for item in os.environ.get(LOOKUP_FIRST_ENV, "").split(","):
            name, _, value = item.strip().partition("=")
            if name == self.name and value.strip() in ("0", "1"):
                return value.strip() == "1"
        if self.calls.lookup_first is not None:
            return self.calls.lookup_first
        return self.side_effect and any(not d.dedupes for d in self.calls.clients)

    def __post_init__(self) -> None:
        object.__setattr__(self, "queue", Queue(self.queue))
        self._derive_from_payload()
        window = self.keying.dedupe_window
        if window is not None and window < 1:
            raise ValueError(f"{self.name}: keying.dedupe_window must be at least 1 second")
        delivery = self.running.delivery
        if delivery is not None and delivery not in DELIVERIES:
            raise ValueError(f"{self.name}: running.delivery {delivery!r} unknown (known: "
                             f"{', '.join(DELIVERIES)})")
        concurrency = self.flow.concurrency
        if concurrency is not None and concurrency.limit < 1:
            raise ValueError(f"{self.name}: flow.concurrency.limit must be >= 1")
        if concurrency is not None and isinstance(concurrency.key, str) \
                and not field_names(concurrency.key):
            raise ValueError(
                f"{self.name}: flow.concurrency.key {concurrency.key!r} names no payload "
                "field, so every request would share one key"
            )
        fairness = self.flow.fairness_key
        if fairness is not None and not field_names(fairness):
            raise ValueError(
                f"{self.name}: flow.fairness_key {fairness!r} names no payload field, so "
                "every request would be one tenant"
            )
        unknown = self.running.needs - PLATFORM_NEEDS
        if unknown:
            raise ValueError(
                f"{self.name}: running.needs {sorted(unknown)} unknown (known: "
                f"{sorted(PLATFORM_NEEDS)})"
            )
        if self.running.exclusive is not None and self.running.handler_many is not None:
            raise ValueError(f"{self.name}: running.exclusive holds one resource per handler; "
                             "it cannot be declared with handler_many")
        if self.upkeep.checks and self.upkeep.reconcile is None:
            raise ValueError(
                f"{self.name}: upkeep.checks {self.upkeep.checks} declared without reconcile")

    def _derive_from_payload(self) -> None:
        if self.payload is None:
            if self.validate is _not_declared:
                raise ValueError(f"{self.name}: declare payload=<model> (or validate=)")
            return
        shown = self.presentation
        if self.validate is _not_declared:
            validate = payloads.validator_of(self.payload, personal=shown.personal)
            object.__setattr__(self, "validate", validate)
        fields = shown.fields or payloads.fields_of(self.payload)
        example = shown.example or payloads.example_of(self.payload)
        if fields is not shown.fields or example is not shown.example:
            object.__setattr__(self, "presentation",
                               replace(shown, fields=fields, example=example))
        known = {f.name for f in fields}
        exclusive = self.running.exclusive
        hooks = (self.keying.key_for, self.keying.resource_id,
                 *((exclusive.on,) if exclusive is not None else ()))
        for hook in hooks:
            unknown = [n for n in getattr(hook, "names", ()) if n not in known]
            if unknown:
                raise ValueError(f"{self.name}: {hook.__name__} names no field {unknown[0]!r}")

    def typed(self, clean: dict[str, Any]) -> Any:
        """What the handler receives for a validated payload: the ``payload`` model built from
        it, or the dict itself when the type declares no model."""
        if self.payload is None:
            return clean
        return self._typed(clean)

    @functools.cached_property
    def _typed(self) -> Callable[[dict[str, Any]], Any]:
        assert self.payload is not None
        return payloads.typed_of(self.payload)

    @functools.cached_property
    def prefix(self) -> str | None:
        """``keying.prefix``, or the example's key up to its first ``:`` (None if it has
        none)."""
        if self.keying.prefix is not None:
            return self.keying.prefix
        example = self.presentation.example
        if not example:
            return None
        key = self.keying.key_for(self.validate(dict(example)))
        head, colon, _ = key.partition(":")
        return head + colon if colon else None

    @property
    def resource_keys(self) -> frozenset[str]:
        """The platform resources and downstream clients its op needs besides the ledger."""
        keys = set(self.running.needs) | {d.name for d in self.calls.clients}
        if self.flow.concurrency is not None:
            keys.add("concurrency")
        if self.running.exclusive is not None:
            keys.add("locks")
        return frozenset(keys)

    def exclusive_on(self, payload: dict[str, Any]) -> str | None:
        """The resource a validated payload's handler holds exclusively, or None."""
        exclusive = self.running.exclusive
        return None if exclusive is None else exclusive.on(payload)

    @property
    def missing_lookup(self) -> bool:
        """True when the type sends effects to a downstream but cannot ask it what happened."""
        return self.side_effect and bool(self.calls.clients) and self.calls.lookup is None

    def effects(self, client: Callable[[str], Any], key: str, payload: Any) -> list[Effect]:
        """What the downstream holds for intent ``key`` (its ``calls.lookup``); raises
        ``ValueError`` when the type declares none (nothing can be concluded)."""
        if self.calls.lookup is None:
            raise ValueError(f"{self.name}: declares no lookup, so its effects cannot be asked")
        return list(self.calls.lookup(client, key, payload))

    @property
    def op_name(self) -> str:
        return op_name_of(self.name)

    @property
    def intake_summary(self) -> str:
        """How the intake treats this type's requests, in words (shown on the Dagster job)."""
        window = self.keying.dedupe_window
        words = f"A key means one intent {'until finished' if window is None else f'{window:g} s'}."
        if self.flow.debounce is not None:
            d = self.flow.debounce
            words += (
                f" Debounced per {d.key}: runs {d.wait:g} s after the last request, at least "
                f"every {d.max_wait:g} s; the others are recorded as coalesced."
            )
        return words

    def debounce_key_for(self, payload: dict[str, Any]) -> str | None:
        """The debounce group of a validated payload (job type included), or None."""
        if self.flow.debounce is None:
            return None
        return f"{self.name}:{self.flow.debounce.key.format_map(payload)}"

    def tenant_for(self, payload: dict[str, Any]) -> str:
        """The tenant of a validated payload: its fairness key, or the default tenant.
        :class:`ValidationError` naming ``fairness_key`` when the key makes no tenant name."""
        fairness = self.flow.fairness_key
        if fairness is None:
            return DEFAULT_TENANT
        try:
            name = fairness.format_map(payload)
        except (KeyError, IndexError, ValueError, AttributeError) as exc:
            raise ValidationError(
                "fairness_key", f"{fairness!r} cannot be formed from the payload "
                f"({type(exc).__name__}: {exc})"
            ) from None
        return check_tenant(name, "fairness_key")

    def concurrency_key_for(self, payload: dict[str, Any]) -> str | None:
        """The concurrency key of a validated payload, or None when the type has no limit."""
        concurrency = self.flow.concurrency
        if concurrency is None:
            return None
        if callable(concurrency.key):
            return concurrency.key(payload)
        return concurrency.key.format_map(payload)


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


def reject_unknown(payload: dict[str, Any], allowed: set[str]) -> None:
    extra = sorted(set(payload) - allowed)
    if extra:
        raise ValidationError(extra[0], f"unknown field (allowed: {', '.join(sorted(allowed))})")
