"""The anti-stampede cache and its Dagster resource.

The work is done by :class:`StampedeCache` (``resources.cache_core``, no Dagster needed); the
algorithm, its guarantees and the race it stops are described there and in ``docs/cache.md``.
:class:`CacheResource` only holds configuration and builds the cache on first use, so importing
this module or the definitions opens no socket.
"""

from __future__ import annotations

from typing import Any

from dagster import ConfigurableResource
from pydantic import PrivateAttr

from resources.cache_core import NO_VALUE, Envelope, SingleFlight, StampedeCache
from resources.cache_stats import FIELDS as STAT_FIELDS
from resources.errors import CacheLoaderFailed, CacheLoadTimeout
from resources.patterns import key_pattern

__all__ = [
    "NO_VALUE",
    "STAT_FIELDS",
    "CacheLoadTimeout",
    "CacheLoaderFailed",
    "CacheResource",
    "Envelope",
    "SingleFlight",
    "StampedeCache",
    "key_pattern",
]


class CacheResource(ConfigurableResource):
    """Dagster resource: a :class:`StampedeCache` on ``redis_url`` (``REDIS_URL`` if unset)."""

    redis_url: str | None = None
    namespace: str = "sekali"
    ttl: float = 60.0
    stale_ttl: float = 0.0
    jitter: float = 0.1
    beta: float = 0.0
    lock_ttl: float = 15.0
    wait_timeout: float = 20.0
    negative_ttl: float = 0.0

    _cache: StampedeCache | None = PrivateAttr(default=None)

    def _build(self) -> StampedeCache:
        from resources.settings import Settings  # noqa: PLC0415 - read env only when used

        url = self.redis_url or Settings.from_env().redis_url
        return StampedeCache.from_url(
            url,
            namespace=self.namespace,
            ttl=self.ttl,
            stale_ttl=self.stale_ttl,
            jitter=self.jitter,
            beta=self.beta,
            lock_ttl=self.lock_ttl,
            wait_timeout=self.wait_timeout,
            negative_ttl=self.negative_ttl,
        )

    def get_cache(self) -> StampedeCache:
        if self._cache is None:
            self._cache = self._build()
        return self._cache

    def teardown_after_execution(self, context: Any) -> None:
        if self._cache is not None:
            self._cache.close()
            self._cache = None
