"""The anti-stampede cache: one rebuild per expiry across all processes.

The work is done by :class:`StampedeCache` (``resources.cache.core``, no Dagster needed); the
algorithm, its guarantees and the race it stops are described there and in ``docs/cache.md``.
Its Dagster resource (``resources.dagster_resources.CacheResource``) only holds configuration
and builds the cache on first use, so importing this package or the definitions opens no socket.
"""

from resources.cache.core import NO_VALUE, CachePolicy, Envelope, SingleFlight, StampedeCache
from resources.cache.stats import FIELDS as STAT_FIELDS
from resources.errors import CacheLoaderFailed, CacheLoadTimeout
from resources.telemetry.patterns import key_pattern

__all__ = [
    "NO_VALUE",
    "STAT_FIELDS",
    "CacheLoadTimeout",
    "CachePolicy",
    "CacheLoaderFailed",
    "Envelope",
    "SingleFlight",
    "StampedeCache",
    "key_pattern",
]
