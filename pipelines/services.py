"""The collaborators a job needs, gathered once: built from settings (no Dagster) or from an
op's resources. The same :class:`Services` serves the per-request ops, the intake's batch ops
and the chaos harness, so every way a job runs takes one code path."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipelines.attempts import AttemptRecorder
from pipelines.domain.mail import Mailer, SmtpMailer
from pipelines.domain.payments import HttpPaymentGateway, PaymentGateway
from pipelines.domain.rate_limited import limit_gateway, limit_mailer
from resources.cache import StampedeCache
from resources.flow import ConcurrencyLimits, RateLimits
from resources.idempotency import IdempotencyStore
from resources.retry import RetryBudget, RetryPolicy
from resources.storage.db import Database, shared_database
from resources.storage.redis import redis_client
from resources.storage.settings import DEFAULT_GATEWAY_SETTLE_SECONDS, Settings
from resources.telemetry.tracing import configure_tracing


@dataclass
class Services:
    """Everything :func:`pipelines.runtime.execute_request` may use.

    ``store.db`` and ``db`` must be the same database: handlers complete the key in the same
    transaction as the business change. ``gateway``, ``mailer``, ``cache`` and ``locks`` may be
    None for job types that do not use them. Without ``concurrency`` the job types' concurrency
    keys are not enforced. ``gateway_settle_seconds``: how long after a charge
    whose answer never came a lookup by reference is conclusive (longer than the provider's
    longest processing time).
    """

    db: Database
    store: IdempotencyStore
    attempts: AttemptRecorder
    gateway: PaymentGateway | None = None
    mailer: Mailer | None = None
    cache: StampedeCache | None = None
    locks: Callable[[str], Any] | None = None
    retry_policy: RetryPolicy = field(default_factory=RetryPolicy)
    retry_budget: RetryBudget | None = None
    concurrency: ConcurrencyLimits | None = None
    gateway_settle_seconds: float = DEFAULT_GATEWAY_SETTLE_SECONDS

    def __post_init__(self) -> None:
        if str(self.store.db.engine.url) != str(self.db.engine.url):
            raise ValueError(
                "the idempotency store and the app database must be the same database "
                f"(store {self.store.db.engine.url!r}, app {self.db.engine.url!r}): set one "
                "DATABASE_URL for both, so a key completes in the business transaction"
            )

    @classmethod
    def from_settings(
        cls,
        settings: Settings | None = None,
        *,
        lease_seconds: float = 60.0,
        retry_policy: RetryPolicy | None = None,
        budget_namespace: str = "sekali",
        cache_namespace: str = "sekali",
        send_idempotency_key: bool = True,
    ) -> Services:
        """Build every collaborator from ``settings`` (``Settings.from_env()`` by default).
        Opens no connection: pools and clients connect on first use. The downstream clients
        take their shared rate from ``settings.rates``; a concurrency slot's lease is at most
        the idempotency lease, so a dead holder's slot is free by the time its work is taken
        over."""
        configure_tracing()
        settings = settings or Settings.from_env()
        db = shared_database(settings.database_url)
        client = redis_client(settings.redis_url)
        rates = RateLimits(client, settings.rates)
        return cls(
            db=db,
            store=IdempotencyStore(db, lease_seconds=lease_seconds),
            attempts=AttemptRecorder(db),
            gateway=limit_gateway(
                HttpPaymentGateway(settings.gateway_url, send_idempotency_key=send_idempotency_key),
                rates,
            ),
            mailer=limit_mailer(SmtpMailer(settings.smtp_host, settings.smtp_port), rates),
            cache=StampedeCache(client, namespace=cache_namespace),
            retry_policy=retry_policy or RetryPolicy(),
            retry_budget=RetryBudget(client, namespace=budget_namespace),
            concurrency=ConcurrencyLimits(client, lease=min(30.0, lease_seconds)),
            gateway_settle_seconds=settings.gateway_settle_seconds,
        )

    @classmethod
    def from_context(cls, context: Any) -> Services:
        """From an op's resources: ``idempotency``, ``app_db`` (optional: the store's database),
        ``gateway``, ``mailer``, ``cache``, ``locks``, ``retry``, ``concurrency`` (each optional
        but the first)."""
        configure_tracing()
        res = context.resources
        store: IdempotencyStore = res.idempotency.get_store()
        app_db = _optional(res, "app_db")
        db = app_db.get_database() if app_db is not None else store.db
        retry = _optional(res, "retry")
        gateway = _optional(res, "gateway")
        mailer = _optional(res, "mailer")
        cache = _optional(res, "cache")
        locks = _optional(res, "locks")
        concurrency = _optional(res, "concurrency")
        return cls(
            db=db,
            store=store,
            attempts=AttemptRecorder(db),
            gateway=gateway.get_client() if gateway is not None else None,
            mailer=mailer.get_mailer() if mailer is not None else None,
            cache=cache.get_cache() if cache is not None else None,
            locks=locks.lock if locks is not None else None,
            retry_policy=retry.get_policy() if retry is not None else RetryPolicy(),
            retry_budget=retry.get_budget() if retry is not None else None,
            concurrency=concurrency.get_limits() if concurrency is not None else None,
            gateway_settle_seconds=(
                gateway.get_settle_seconds()
                if gateway is not None
                else DEFAULT_GATEWAY_SETTLE_SECONDS
            ),
        )


def _optional(resources: Any, name: str) -> Any:
    """A resource the op may not require (Dagster raises on unknown keys)."""
    try:
        return getattr(resources, name)
    except Exception:  # noqa: BLE001 - DagsterUnknownResourceError or AttributeError
        return None
