"""The one place that chooses resources, and the thin Dagster wrappers of the business side.

Every resource reads ``DATABASE_URL`` / ``REDIS_URL`` / the downstream addresses when first used,
never at import. The generic defences' wrappers live in :mod:`resources.dagster_resources`;
the ones here wrap the business clients and the platform's stores in the same way.
"""

from __future__ import annotations

from typing import Any

from pipelines.domain.mail import Mailer, SmtpMailer
from pipelines.domain.payments import HttpPaymentGateway, PaymentGateway
from pipelines.domain.rate_limited import MAIL, PAYMENT_GATEWAY, limit_gateway, limit_mailer
from pipelines.requests import RequestStore
from resources.dagster_resources import (
    CacheResource,
    ConcurrencyResource,
    DatabaseResource,
    DlqResource,
    IdempotencyResource,
    LockResource,
    RateLimitResource,
    RetryResource,
    SettingsResource,
)
from resources.flow import RateLimits


def _rates(resource: SettingsResource, downstream: str, rate: str | None) -> RateLimits:
    """The shared rates of settings, with ``rate`` (if set) for ``downstream``."""
    rates = dict(resource.settings().rates)
    if rate:
        rates[downstream] = rate
    return RateLimits(resource.redis(), rates)


class PaymentGatewayResource(SettingsResource):
    """The HTTP payment client. ``base_url`` defaults to ``SEKALI_GATEWAY_URL``.

    ``timeout`` bounds connecting and each read, ``deadline`` a whole call. ``settle_seconds``
    (default ``SEKALI_GATEWAY_SETTLE_SECONDS``) is how long after a charge whose answer never
    came a lookup by reference is conclusive: longer than the provider's longest processing time
    (and than the longest wait for a rate token). ``rate`` (``50/s,burst=20``) defaults to
    ``SEKALI_RATE_PAYMENT_GATEWAY``: every call then takes a token from the rate shared by all
    workers. Unset: unlimited.
    """

    base_url: str | None = None
    timeout: float = 5.0
    deadline: float = 15.0
    send_idempotency_key: bool = True
    rate: str | None = None
    settle_seconds: float | None = None

    def _build(self) -> PaymentGateway:
        client = HttpPaymentGateway(
            self.base_url or self.settings().gateway_url,
            timeout=self.timeout,
            deadline=self.deadline,
            send_idempotency_key=self.send_idempotency_key,
        )
        return limit_gateway(client, _rates(self, PAYMENT_GATEWAY, self.rate))

    def get_client(self) -> PaymentGateway:
        return self._get()  # type: ignore[no-any-return]

    def get_settle_seconds(self) -> float:
        return self.settle_seconds or self.settings().gateway_settle_seconds


class MailerResource(SettingsResource):
    """The SMTP mailer. ``host``/``port`` default to ``SEKALI_SMTP_HOST`` / ``SEKALI_SMTP_PORT``;
    ``timeout`` bounds each socket operation, ``deadline`` a whole send; ``rate`` (``5/s``)
    defaults to ``SEKALI_RATE_SMTP``: every send then takes a token from the rate shared by all
    workers. Unset: unlimited."""

    host: str | None = None
    port: int | None = None
    sender: str = "sekali@localhost"
    timeout: float = 10.0
    rate: str | None = None
    deadline: float = 30.0

    def _build(self) -> Mailer:
        settings = self.settings()
        mailer = SmtpMailer(
            self.host or settings.smtp_host,
            self.port or settings.smtp_port,
            sender=self.sender,
            timeout=self.timeout,
            deadline=self.deadline,
        )
        return limit_mailer(mailer, _rates(self, MAIL, self.rate))

    def get_client(self) -> Mailer:
        return self._get()  # type: ignore[no-any-return]

    def get_mailer(self) -> Mailer:
        return self.get_client()


class RequestsResource(SettingsResource):
    """The intake table (``job_requests``) on the app database."""

    def _build(self) -> RequestStore:
        return RequestStore(self.database())

    def get_store(self) -> RequestStore:
        return self._get()  # type: ignore[no-any-return]


class ObservabilityResource(SettingsResource):
    """What the checks compare against that no other resource knows.

    ``gateway_ledger_url``: the database where the payment downstream records its charges (the
    sandbox gateway's ``gateway_charges`` table); when set, checks 1 and 10 count real effects
    and follow correlation ids into the downstream. ``window_hours`` bounds the evidence read by
    the checks, ``metrics_window_minutes`` the metrics.
    """

    gateway_ledger_url: str | None = None
    window_hours: float = 24.0
    metrics_window_minutes: float = 60.0


def resource_defs() -> dict[str, Any]:
    return {
        "idempotency": IdempotencyResource(),
        "app_db": DatabaseResource(),
        "locks": LockResource(),
        "concurrency": ConcurrencyResource(),
        "rate_limits": RateLimitResource(),
        "cache": CacheResource(),
        "gateway": PaymentGatewayResource(),
        "mailer": MailerResource(),
        "retry": RetryResource(),
        "observability": ObservabilityResource(),
        "requests": RequestsResource(),
        "dlq": DlqResource(),
    }
