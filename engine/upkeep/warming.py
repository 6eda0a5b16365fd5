"""Cache warming: refresh the hottest keys before they expire, so their readers never miss.

:class:`Warmer` (plain, no Dagster) takes the cache's hot keys (decayed access counts shared by
every process), and refreshes each one whose fresh lifetime ends within ``refresh_within``
seconds (or that is already gone) through :meth:`StampedeCache.refresh`: the same single flight
as a miss, so a warming run and a reader that misses at the same moment still make one loader
call. Keys with no known loader are skipped and counted. The loaders come from the job types
that fill the cache (their ``cache_loader``): :func:`declared_loaders`.

The ``cache_warming`` asset (:mod:`pipelines.assets.warming`) runs it on
``cache_warming_schedule`` (every 5 minutes, so
``refresh_within`` defaults to two intervals) and records keys refreshed, time taken and misses
avoided (hot keys that would have expired, or had, before the next run) as metadata.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.registry import JOB_TYPES
from resources.storage.db import Database

log = logging.getLogger(__name__)

Loader = Callable[[], Any]
LoaderFactory = Callable[[str], Loader | None]


def declared_loaders(db: Database) -> LoaderFactory:
    """The loader of a key from the first job type whose ``cache_loader`` knows it."""
    hooks = [jt.upkeep.cache_loader for jt in JOB_TYPES.values()
             if jt.upkeep.cache_loader is not None]

    def loader_for(key: str) -> Loader | None:
        for hook in hooks:
            loader = hook(db, key)
            if loader is not None:
                return loader
        return None

    return loader_for


@dataclass
class WarmingResult:
    considered: int = 0
    refreshed: list[str] = field(default_factory=list)
    fresh: int = 0
    no_loader: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    misses_avoided: int = 0
    seconds: float = 0.0

    def metadata(self) -> dict[str, Any]:
        return {
            "keys_considered": self.considered,
            "keys_refreshed": len(self.refreshed),
            "keys_fresh": self.fresh,
            "keys_without_loader": len(self.no_loader),
            "keys_failed": len(self.failed),
            "misses_avoided": self.misses_avoided,
            "seconds": round(self.seconds, 4),
            "refreshed": ", ".join(self.refreshed[:50]),
        }


class Warmer:
    """Refreshes hot keys close to expiry. ``ttl`` overrides the TTL stored with each key."""

    def __init__(
        self,
        cache: Any,
        loader_for: LoaderFactory,
        *,
        top_n: int = 50,
        refresh_within: float = 600.0,
        ttl: float | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.cache = cache
        self.loader_for = loader_for
        self.top_n = top_n
        self.refresh_within = refresh_within
        self.ttl = ttl
        self.clock: Callable[[], float] = (
            clock if clock is not None else getattr(cache, "clock", time.time)
        )

    def run(self, keys: Sequence[str] | None = None) -> WarmingResult:
        started = time.monotonic()
        report = WarmingResult()
        hot = list(keys) if keys is not None else [k for k, _ in self.cache.hot_keys(self.top_n)]
        report.considered = len(hot)
        for key in hot:
            envelope = self.cache.envelope(key)
            now = self.clock()
            if envelope is not None and envelope.soft - now > self.refresh_within:
                report.fresh += 1
                continue
            loader = self.loader_for(key)
            if loader is None:
                report.no_loader.append(key)
                continue
            try:
                self.cache.refresh(key, loader, ttl=self.ttl)
            except Exception as exc:  # noqa: BLE001 - one bad key must not stop the others
                report.failed[key] = f"{type(exc).__name__}: {exc}"
                log.warning("warming %s failed: %s", key, exc)
                continue
            report.refreshed.append(key)
            report.misses_avoided += 1
        report.seconds = time.monotonic() - started
        return report
