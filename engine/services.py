"""The collaborators a job needs, gathered once: built from settings (no Dagster) or from an
op's resources. The same :class:`Services` serves the per-request ops, the intake's batch ops
and the chaos harness, so every way a job runs takes one code path."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.attempts import AttemptRecorder
from engine.durations import DurationModel, LeaseChoice, LeasedType
from engine.recovery import RecoveryWatch
from engine.registry import downstreams
from resources.cache import StampedeCache
from resources.errors import SekaliError
from resources.flow import ConcurrencyLimits, RateLimits
from resources.idempotency import IdempotencyStore
from resources.locks import DEFAULT_TTL_SECONDS, LockFactory, RedisLock
from resources.retry import RetryBudget, RetryPolicy
from resources.storage.db import Database, shared_database
from resources.storage.redis import redis_client
from resources.storage.settings import (
    DEFAULT_GATEWAY_SETTLE_SECONDS,
    Settings,
    crash_loop_limit,
)
from resources.telemetry.tracing import configure_tracing


class MissingClient(SekaliError):
    """A handler asked for a downstream client the services do not carry: declare the
    downstream in the job type's ``clients`` (so its op gets the resource), or pass the client
    in ``Services(clients={name: ...})``."""

    permanent = True

    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(
            f"no client for the downstream {name!r} (this run has: {', '.join(known) or 'none'})"
            f": declare it in the job type's clients, or give Services(clients={{{name!r}: ...}})"
        )
        self.name = name


class MissingLocks(SekaliError):
    """A job type declares ``Running.exclusive`` but the services carry no lock factory: wire
    the ``locks`` resource (backend ``redis`` or ``db``), or give ``Services(locks=...)``."""

    permanent = True

    def __init__(self, job_type: str) -> None:
        super().__init__(
            f"{job_type} declares running.exclusive but this run has no locks: wire the 'locks' "
            "resource (backend redis or db) or give Services(locks=...)"
        )
        self.job_type = job_type



@dataclass
class Services:
    """Everything :func:`engine.runtime.execute_request` may use.

    ``store.db`` and ``db`` must be the same database: handlers complete the key in the same
    transaction as the business change. ``clients`` holds the downstream clients by name
    (:meth:`client`); ``cache`` may be None for job types that do not use it.
    Without ``concurrency`` the job types' concurrency keys are not enforced.
    ``settle_seconds``: how long after a send whose answer never came a lookup at the
    downstream is conclusive (longer than 0.4 of a lease, the latest a send written down may
    leave after its ``sent_at``, plus the downstream's longest processing time).
    ``crash_loop_limit``: the deaths mid-run a key may cause before it is dead-lettered as
    ``crash_loop`` (``SEKALI_CRASH_LOOP_LIMIT``, 3). ``locks`` makes the lock a job type that
    declares ``Running.exclusive`` holds around its handler; without it such a type fails
    (:class:`MissingLocks`).
    """

    db: Database
    store: IdempotencyStore
    attempts: AttemptRecorder
    clients: dict[str, Any] = field(default_factory=dict)
    cache: StampedeCache | None = None
    retry_policy: RetryPolicy = field(default_factory=RetryPolicy)
    retry_budget: RetryBudget | None = None
    concurrency: ConcurrencyLimits | None = None
    locks: LockFactory | None = None
    settle_seconds: float = DEFAULT_GATEWAY_SETTLE_SECONDS
    crash_loop_limit: int = field(default_factory=crash_loop_limit)
    durations: DurationModel | None = None
    """The observed durations the leases follow (:mod:`engine.durations`); None: one over
    ``attempts`` with the policy of the environment."""

    recovery: RecoveryWatch | None = None
    """The downstreams' observed failure bursts the retry delays follow
    (:mod:`engine.recovery`); None: one over ``retry_budget``."""

    def __post_init__(self) -> None:
        if self.durations is None:
            self.durations = DurationModel(self.attempts)
        if self.recovery is None:
            self.recovery = RecoveryWatch(self.retry_budget)
        if str(self.store.db.engine.url) != str(self.db.engine.url):
            raise ValueError(
                "the idempotency store and the app database must be the same database "
                f"(store {self.store.db.engine.url!r}, app {self.db.engine.url!r}): set one "
                "DATABASE_URL for both, so a key completes in the business transaction"
            )

    def lease_for(self, job_type: LeasedType) -> LeaseChoice:
        """The lease a claim of ``job_type`` takes now: observed, or the store's declared."""
        assert self.durations is not None
        return self.durations.lease_for(job_type, self.store.lease_seconds)

    def retry_policy_for(
        self, downstream: str | None, declared: RetryPolicy | None = None
    ) -> RetryPolicy:
        """The retry policy for a failure at ``downstream``: the declared one (default the
        services') with its base and cap following the downstream's observed failure bursts,
        never below the declared ones."""
        assert self.recovery is not None
        return self.recovery.policy(declared or self.retry_policy, downstream)[0]

    def client(self, name: str) -> Any:
        """The client of the downstream ``name``; :class:`MissingClient` when there is none."""
        found = self.clients.get(name)
        if found is None:
            raise MissingClient(name, sorted(self.clients))
        return found

    @classmethod
    def from_settings(
        cls,
        settings: Settings | None = None,
        *,
        lease_seconds: float = 60.0,
        retry_policy: RetryPolicy | None = None,
        budget_namespace: str = "sekali",
        cache_namespace: str = "sekali",
        options: Mapping[str, Any] | None = None,
    ) -> Services:
        """Build every collaborator from ``settings`` (``Settings.from_env()`` by default),
        with a client for every downstream a job type declares (``options`` overrides a
        client's defaults by downstream name, :class:`engine.downstreams.ClientOptions`).
        Opens no connection: pools and clients connect on first use. The clients take their
        shared rate from ``settings.rates``; a concurrency slot's lease is at most the
        idempotency lease, so a dead holder's slot is free by the time its work is taken
        over."""
        configure_tracing()
        settings = settings or Settings.from_env()
        db = shared_database(settings.database_url)
        client = redis_client(settings.redis_url)
        rates = RateLimits(client, settings.rates)
        options = options or {}
        return cls(
            db=db,
            store=IdempotencyStore(db, lease_seconds=lease_seconds),
            attempts=AttemptRecorder(db),
            clients={
                name: downstream.client(settings, rates, options.get(name))
                for name, downstream in downstreams().items()
            },
            cache=StampedeCache(client, namespace=cache_namespace),
            retry_policy=retry_policy or RetryPolicy(),
            retry_budget=RetryBudget(client, namespace=budget_namespace),
            concurrency=ConcurrencyLimits(client, lease=min(30.0, lease_seconds)),
            locks=functools.partial(RedisLock, client, ttl=DEFAULT_TTL_SECONDS),
            settle_seconds=settings.gateway_settle_seconds,
        )

    @classmethod
    def from_context(cls, context: Any) -> Services:
        """From an op's resources: ``idempotency``, ``app_db`` (optional: the store's database),
        one per downstream (by its name), ``cache``, ``retry``, ``concurrency``, ``locks``
        (each optional but the first)."""
        configure_tracing()
        res = context.resources
        store: IdempotencyStore = res.idempotency.get_store()
        app_db = _optional(res, "app_db")
        db = app_db.get_database() if app_db is not None else store.db
        retry = _optional(res, "retry")
        cache = _optional(res, "cache")
        concurrency = _optional(res, "concurrency")
        locks = _optional(res, "locks")
        wired = {name: _optional(res, name) for name in downstreams()}
        wired = {name: resource for name, resource in wired.items() if resource is not None}
        return cls(
            db=db,
            store=store,
            attempts=AttemptRecorder(db),
            clients={name: resource.get_client() for name, resource in wired.items()},
            cache=cache.get_cache() if cache is not None else None,
            retry_policy=retry.get_policy() if retry is not None else RetryPolicy(),
            retry_budget=retry.get_budget() if retry is not None else None,
            concurrency=concurrency.get_limits() if concurrency is not None else None,
            locks=locks.get_factory() if locks is not None else None,
            settle_seconds=settle_seconds_of(wired.values()),
        )


def settle_seconds_of(clients: Iterable[Any]) -> float:
    """The settle window of a run: the longest among its downstream resources' (each one's
    ``get_settle_seconds``), or the default when it has none."""
    return max(
        (resource.get_settle_seconds() for resource in clients),
        default=DEFAULT_GATEWAY_SETTLE_SECONDS,
    )


def _optional(resources: Any, name: str) -> Any:
    """A resource the op may not require (Dagster raises on unknown keys)."""
    try:
        return getattr(resources, name)
    except Exception:  # noqa: BLE001 - DagsterUnknownResourceError or AttributeError
        return None
