"""The one place that chooses resources, and the thin Dagster wrappers of the platform's side.

Every resource reads ``DATABASE_URL`` / ``REDIS_URL`` / the downstream addresses when first used,
never at import. The generic defences' wrappers live in :mod:`resources.dagster_resources`; the
ones here wrap the platform's stores (the intake's ``RequestsResource`` is the intake sensor's
own), and one :class:`DownstreamResource` per downstream the job
types declare, under its name: nothing here names a downstream.
"""

from __future__ import annotations

from typing import Any

from engine.downstreams import ClientOptions
from engine.registry import downstream, downstreams
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
from sensors.intake import RequestsResource


class DownstreamResource(SettingsResource):
    """The client of the declared downstream ``downstream`` (its name; the resource key is the
    same name): built by the declaration's ``build`` from the settings,
    with these overrides when set.

    ``address`` (a URL or ``host:port``), ``timeout`` (connecting and each read) and
    ``deadline`` (a whole call) override the downstream's defaults; ``extra`` holds what only
    this downstream's client takes (``send_idempotency_key``, ``sender``). ``rate``
    (``50/s,burst=20``) defaults to ``SEKALI_RATE_<NAME>``: every call then takes a token from
    the rate shared by all workers; unset, unlimited. ``settle_seconds`` (default
    ``SEKALI_GATEWAY_SETTLE_SECONDS``) is how long after a send whose answer never came a lookup
    at the downstream is conclusive: longer than 0.4 of a lease plus its longest processing
    time (and than the longest wait for a rate token).
    """

    downstream: str
    address: str | None = None
    timeout: float | None = None
    deadline: float | None = None
    rate: str | None = None
    settle_seconds: float | None = None
    extra: dict[str, Any] = {}

    def _build(self) -> Any:
        declared = downstream(self.downstream)
        rates = dict(self.settings().rates)
        if self.rate:
            rates[self.downstream] = self.rate
        options = ClientOptions(
            address=self.address, timeout=self.timeout, deadline=self.deadline, extra=self.extra
        )
        return declared.client(self.settings(), RateLimits(self.redis(), rates), options)

    def get_client(self) -> Any:
        return self._get()

    def get_settle_seconds(self) -> float:
        return self.settle_seconds or self.settings().gateway_settle_seconds


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
        "retry": RetryResource(),
        "observability": ObservabilityResource(),
        "requests": RequestsResource(),
        "dlq": DlqResource(),
        **{name: DownstreamResource(downstream=name) for name in downstreams()},
    }
