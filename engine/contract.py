"""What a job type declares: the :class:`JobType` (its payload's fields and validation, its
key, queue, budget and side-effect nature, flow-control needs, the downstreams it calls and its
upkeep hooks), and the helpers every job type uses to check input and write fenced.

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
from dataclasses import dataclass, field
from typing import Any, Protocol

from sqlalchemy import text
from sqlalchemy.engine import Connection

from engine import payloads
from engine.downstreams import Downstream
from engine.downstreams import Effect as Effect  # re-exported: the lookup hook's value
from engine.durations import LeaseBounds
from engine.payloads import PayloadField as PayloadField  # re-exported: the contract names it
from engine.tenants import DEFAULT_TENANT, check_tenant
from resources.errors import FencedWriteRejected, ValidationError, shown
from resources.storage.db import Database
from resources.storage.retention import Expiry

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
    in a probe on a loaded machine; 0 in 30 this way)."""
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


Handler = Callable[[Any, Any], Any]
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
    """``key_for=formatted("points:{account_id}")``: a format string over the validated
    payload's fields, as a function (the fields it names are checked against ``payload``)."""
    names = field_names(template)
    if not names:
        raise ValueError(f"{template!r} names no payload field")

    def fill(payload: dict[str, Any]) -> str:
        return template.format_map(payload)

    fill.__qualname__ = fill.__name__ = f"formatted({template!r})"
    fill.names = names  # type: ignore[attr-defined]
    return fill


@dataclass(frozen=True, kw_only=True)
class JobType:
    """One kind of job: how to check its input, name its intent, and do its effect, and what it
    adds to the platform's upkeep. Nothing outside the job type's module names it: the
    registry, the Dagster jobs and resources, reconciliation and retention read these fields.

    The payload is declared once, as ``payload=<pydantic model or dataclass>``: its launch form
    ``fields``, ``validate``, ``example`` and the object the handler gets follow from it
    (:mod:`engine.payloads`). A type may instead give ``validate`` and ``fields`` by hand (then
    its handler gets the validated dict).
    """

    name: str
    queue: str  # "heavy" | "light" (tag "sekali/queue")
    payload: type | None = None
    """The payload's model (pydantic ``BaseModel`` or dataclass): see the class."""
    validate: Callable[[dict[str, Any]], dict[str, Any]] = _not_declared
    """``payload -> validated dict`` (refusals name the field); derived from ``payload``."""
    key_for: Callable[[dict[str, Any]], str]
    max_runtime_seconds: float
    side_effect: bool
    handler: Handler
    resource_id: Callable[[dict[str, Any]], str]
    clients: tuple[Downstream, ...] = ()
    """The downstreams the handler calls (``ctx.client(name)``): their clients, resources,
    rates and sandboxes follow from these declarations."""
    downstream: str | None = None
    """The retry-budget bucket: by default the first client's name; None when it has none."""
    needs: frozenset[str] = frozenset()
    """Platform services beyond the ledger the handler uses: ``cache``. (No lock: the claim and
    its fence are the mutual exclusion; a concurrency limit is ``concurrency_key``.)"""
    description: str = ""
    delivery: str | None = None
    """How its requests reach the handler (:mod:`engine.delivery`): None for the platform's
    default (resident workers: a job starts within milliseconds); ``per_request`` when each of
    its requests must be a Dagster run of its own, a person's to watch; ``micro_batch`` or
    ``fan_out`` for a run per batch."""
    # At most ``concurrency_limit`` side effects at once per key, across every worker: a format
    # string over the validated payload (``"account:{account_id}"``), or a function of it (a
    # key the payload does not spell, such as the host a URL names); None for no limit. The
    # handler holds the slot around its side effect with ``ctx.concurrency_slot(JOB_TYPE)``.
    concurrency_key: str | Callable[[dict[str, Any]], str] | None = None
    concurrency_limit: int = 1
    fairness_key: str | None = None
    """The tenant a request belongs to, for fair share at intake (:mod:`engine.tenants`): a
    format string over the validated payload (``"{customer_id}"``); None: every request of
    this type is the default tenant's."""
    debounce: Debounce | None = None
    """Coalesce bursts of requests at intake (see :class:`Debounce`); None: every request runs."""
    dedupe_window: float | None = None
    """How long a key means the same intent: None is "until finished" (a key done once is done
    while its records are kept); seconds (86400 for a daily digest) make the stored key
    ``<key>@<window start, UTC>``, so the same key in a later window is a new intent."""
    key_prefix: str | None = None
    """What every key of this type starts with (``points:``), so a key alone names its type;
    by default the example's key up to its first ``:``."""
    checks: tuple[str, ...] = ()
    """The names of the reconciliation checks ``reconcile`` runs, in the order it counts them."""
    reconcile: ReconcileHook | None = None
    """Finds what the happy path left inconsistent and fixes it once (``act``); run by every
    reconciliation pass, after which the platform's own checks run."""
    watches: tuple[str, ...] = ()
    """SQL conditions on ``reconciliation_actions`` under which a recorded action must stay
    (a check may still look at its subject); ``:watched_since`` is the lookback's start."""
    retained: tuple[Retained, ...] = ()
    """The job type's own tables that retention purges."""
    cache_loader: Callable[[Database, str], CacheLoader | None] | None = None
    """The loader of a cache key this job type fills (None for a key not its own): cache
    warming refreshes hot keys through it."""
    unique: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """``(table, columns)`` that must be unique for its effect to happen once: the doctor
    checks the live schema has them."""
    lookup: Lookup | None = None
    """Asks the downstream what it holds for one intent (see :data:`Lookup`): how
    reconciliation, the chaos checker and a person tell "it happened" from "it never did" when
    the outcome of a send is unknown. A job type with a side effect at a downstream should
    declare it (:meth:`missing_lookup` says when one does not)."""

    lease: LeaseBounds | None = None
    """The lease of a claim: declared until durations are observed, then p99.9 x a factor
    between a floor and a ceiling (:mod:`engine.durations`); None: the platform's defaults."""

    lookup_first: bool | None = None
    """Whether the handler looks its effect up before its first send too, not only on a retry
    or a takeover: the guard against a completed key rolled back (a database failover to an
    asynchronous standby, a restore from backup) and its effect made again. None: on when the
    type has a side effect at a downstream that does not dedupe by idempotency key
    (``Downstream.dedupes``). ``SEKALI_LOOKUP_FIRST`` overrides it per job type
    (``charge_payment=1,send_email=0``). Costs one lookup per first send (docs/job-types.md);
    read it with :meth:`looks_up_first`."""

    def looks_up_first(self) -> bool:
        """This type's :attr:`lookup_first`, after ``SEKALI_LOOKUP_FIRST`` (read at each call,
        so an operator's change reaches the next request)."""
        for item in os.environ.get(LOOKUP_FIRST_ENV, "").split(","):
            name, _, value = item.strip().partition("=")
            if name == self.name and value.strip() in ("0", "1"):
                return value.strip() == "1"
        if self.lookup_first is not None:
            return self.lookup_first
        return self.side_effect and any(not d.dedupes for d in self.clients)

    def __post_init__(self) -> None:
        self._derive_from_payload()
        if self.dedupe_window is not None and self.dedupe_window < 1:
            raise ValueError(f"{self.name}: dedupe_window must be at least 1 second")
        if self.delivery is not None and self.delivery not in DELIVERIES:
            raise ValueError(f"{self.name}: delivery {self.delivery!r} unknown (known: "
                             f"{', '.join(DELIVERIES)})")
        if self.concurrency_limit < 1:
            raise ValueError(f"{self.name}: concurrency_limit must be >= 1")
        if isinstance(self.concurrency_key, str) and not field_names(self.concurrency_key):
            raise ValueError(
                f"{self.name}: concurrency_key {self.concurrency_key!r} names no payload "
                "field, so every request would share one key"
            )
        if self.fairness_key is not None and not field_names(self.fairness_key):
            raise ValueError(
                f"{self.name}: fairness_key {self.fairness_key!r} names no payload field, so "
                "every request would be one tenant"
            )
        unknown = self.needs - PLATFORM_NEEDS
        if unknown:
            raise ValueError(
                f"{self.name}: needs {sorted(unknown)} unknown (known: {sorted(PLATFORM_NEEDS)})"
            )
        if self.checks and self.reconcile is None:
            raise ValueError(f"{self.name}: checks {self.checks} declared without reconcile")
        if self.downstream is None and self.clients:
            object.__setattr__(self, "downstream", self.clients[0].name)

    fields: tuple[PayloadField, ...] = ()
    """The payload's fields, in the order a form shows them (``validate`` accepts exactly these).
    """
    example: dict[str, Any] = field(default_factory=dict, hash=False)
    """A valid payload: what the launch form opens with."""
    result_fields: tuple[str, ...] = ()
    """The result's fields that name the effect (the downstream's id of it), shown on the run."""
    personal: frozenset[str] = frozenset()  # payload fields masked in logs, errors and views
    handler_many: BatchHandler | None = None
    """Optional: the effects of a micro-batch in as few transactions or connections as the job
    type allows. Without it a batch runs ``handler`` once per request."""

    def _derive_from_payload(self) -> None:
        if self.payload is None:
            if self.validate is _not_declared:
                raise ValueError(f"{self.name}: declare payload=<model> (or validate=)")
            return
        if self.validate is _not_declared:
            validate = payloads.validator_of(self.payload, personal=self.personal)
            object.__setattr__(self, "validate", validate)
        if not self.fields:
            object.__setattr__(self, "fields", payloads.fields_of(self.payload))
        if not self.example:
            object.__setattr__(self, "example", payloads.example_of(self.payload))
        known = {f.name for f in self.fields}
        for hook in (self.key_for, self.resource_id):
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
        """``key_prefix``, or the example's key up to its first ``:`` (None if it has none)."""
        if self.key_prefix is not None:
            return self.key_prefix
        if not self.example:
            return None
        key = self.key_for(self.validate(dict(self.example)))
        head, colon, _ = key.partition(":")
        return head + colon if colon else None

    @property
    def resource_keys(self) -> frozenset[str]:
        """The platform resources and downstream clients its op needs besides the ledger."""
        keys = set(self.needs) | {d.name for d in self.clients}
        if self.concurrency_key is not None:
            keys.add("concurrency")
        return frozenset(keys)

    @property
    def missing_lookup(self) -> bool:
        """True when the type sends effects to a downstream but cannot ask it what happened."""
        return self.side_effect and bool(self.clients) and self.lookup is None

    def effects(self, client: Callable[[str], Any], key: str, payload: Any) -> list[Effect]:
        """What the downstream holds for intent ``key`` (its :attr:`lookup`); raises
        ``ValueError`` when the type declares none (nothing can be concluded)."""
        if self.lookup is None:
            raise ValueError(f"{self.name}: declares no lookup, so its effects cannot be asked")
        return list(self.lookup(client, key, payload))

    @property
    def op_name(self) -> str:
        return op_name_of(self.name)

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

    def tenant_for(self, payload: dict[str, Any]) -> str:
        """The tenant of a validated payload: its fairness key, or the default tenant.
        :class:`ValidationError` naming ``fairness_key`` when the key makes no tenant name."""
        if self.fairness_key is None:
            return DEFAULT_TENANT
        try:
            name = self.fairness_key.format_map(payload)
        except (KeyError, IndexError, ValueError, AttributeError) as exc:
            raise ValidationError(
                "fairness_key", f"{self.fairness_key!r} cannot be formed from the payload "
                f"({type(exc).__name__}: {exc})"
            ) from None
        return check_tenant(name, "fairness_key")

    def concurrency_key_for(self, payload: dict[str, Any]) -> str | None:
        """The concurrency key of a validated payload, or None when the type has no limit."""
        if self.concurrency_key is None:
            return None
        if callable(self.concurrency_key):
            return self.concurrency_key(payload)
        return self.concurrency_key.format_map(payload)


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
        f" WHERE {column} = :v AND {fence_column} <= :fence"  # nosec B608: SQL from code constants, values bound
    )
    rowcount = conn.execute(text(sql), {**(params or {}), "v": value, "fence": fence}).rowcount
    if rowcount != 1:
        highest = conn.execute(
            text(f"SELECT {fence_column} FROM {table} WHERE {column} = :v"), {"v": value}  # nosec B608: SQL from code constants, values bound
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


def reject_unknown(payload: dict[str, Any], allowed: set[str]) -> None:
    extra = sorted(set(payload) - allowed)
    if extra:
        raise ValidationError(extra[0], f"unknown field (allowed: {', '.join(sorted(allowed))})")
