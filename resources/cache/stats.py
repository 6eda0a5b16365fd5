"""Cache counters and hot-key access counts, batched in process and shared through Redis.

Counting on every call would add a round trip to the hit path, so each process adds up locally and
flushes at most once per ``flush_interval`` (and on ``stats()``, ``hot_keys()`` and ``close()``)
with one pipeline: ``HINCRBYFLOAT`` into one hash per namespace (field ``"<pattern>|<name>"``),
``ZINCRBY`` into one sorted set of access counts. Access counts decay by half every
``half_life`` seconds (the first process to flush after a period applies it), so ``hot_keys`` ranks
what is hot now, not what was hot yesterday.

Counts are eventually shared: a process's last ``flush_interval`` of counts is visible to others
only after its next flush; a process killed hard loses at most that much.

Bounded: the stats hash takes at most ``max_fields`` fields (past that, new ones count under the
``~overflow`` pattern: :mod:`resources.telemetry.counters`), the sorted set keeps the
``max_hot_keys`` hottest keys, and all three namespace keys expire ``stats_ttl`` seconds after
the last flush.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable

from resources.cache.scripts import DECAY, namespace_keys
from resources.storage.redis import REDIS_ERRORS, RedisClient
from resources.telemetry import counters
from resources.telemetry.patterns import key_pattern

log = logging.getLogger(__name__)
_FLUSH_ERRORS: tuple[type[Exception], ...] = (*REDIS_ERRORS, OSError, ValueError)  # closed client

FIELDS = (
    "hits",
    "stale_hits",
    "misses",
    "loads",
    "waits",
    "wait_time",
    "early_refreshes",
    "errors",
)


class CacheRecorder:
    """Thread-safe local counters, flushed to Redis at most every ``flush_interval`` seconds on
    a short-lived thread (and on :meth:`flush`), never on the caller's thread."""

    def __init__(
        self,
        client: RedisClient,
        namespace: str,
        *,
        flush_interval: float = 1.0,
        half_life: float = 300.0,
        clock: Callable[[], float] = time.time,
        stats_ttl: float = counters.TTL_SECONDS,
        max_fields: int = counters.MAX_FIELDS,
        max_hot_keys: int = 10_000,
    ) -> None:
        self.client = client
        self.stats_key, self.hot_key, self.decay_key = namespace_keys(namespace)
        self.counters = counters.BoundedCounters(
            client, self.stats_key, ttl_seconds=stats_ttl, max_fields=max_fields
        )
        self.max_hot_keys = max_hot_keys
        self.flush_interval = flush_interval
        self.half_life = half_life
        self.clock = clock
        self._lock = threading.Lock()
        self._flushing = threading.Lock()
        self._counts: dict[tuple[str, str], float] = {}
        self._access: dict[str, int] = {}
        self._hits: dict[str, int] = {}
        self._last_flush = time.monotonic()
        self._flusher: threading.Thread | None = None
        self._decay = client.register_script(DECAY)

    def hit(self, key: str) -> None:
        """``record(key, "hits", access=True)``, kept as cheap as it can be (the hit path)."""
        with self._lock:  # read the dict under the lock: a flush swaps it for a new one
            hits = self._hits
            hits[key] = hits.get(key, 0) + 1
        if time.monotonic() - self._last_flush >= self.flush_interval:
            self._flush_soon()

    def record(self, key: str, field: str, amount: float = 1.0, *, access: bool = False) -> None:
        with self._lock:
            counts, hits = self._counts, self._access
            counts[key, field] = counts.get((key, field), 0.0) + amount
            if access:
                hits[key] = hits.get(key, 0) + 1
        if time.monotonic() - self._last_flush >= self.flush_interval:
            self._flush_soon()

    def _flush_soon(self) -> None:
        """Flush on a short-lived thread: a Redis that does not answer must not make the
        caller that happened to be due wait a second time. One flush at a time."""
        with self._lock:
            if self._flusher is not None and self._flusher.is_alive():
                return
            self._last_flush = time.monotonic()
            self._flusher = threading.Thread(
                target=self.flush, kwargs={"block": False}, name="cache-stats-flush", daemon=True
            )
            self._flusher.start()

    def flush(self, *, block: bool = True) -> None:
        """Send the local counts to Redis. With ``block=False`` skip if another thread flushes."""
        if not self._flushing.acquire(blocking=block):
            return
        try:
            with self._lock:
                counts, self._counts = self._counts, {}
                access, self._access = self._access, {}
                hits, self._hits = self._hits, {}
                self._last_flush = time.monotonic()
            for key, n in hits.items():
                counts[key, "hits"] = counts.get((key, "hits"), 0.0) + n
                access[key] = access.get(key, 0) + n
            if not counts and not access:
                return
            by_pattern: defaultdict[tuple[str, str], float] = defaultdict(float)
            for (key, field), amount in counts.items():
                by_pattern[key_pattern(key), field] += amount
            self.counters.add(
                (f"{pattern}|{field}", f"{counters.OVERFLOW}|{field}", amount)
                for (pattern, field), amount in by_pattern.items()
            )
            if access:
                pipe = self.client.pipeline(transaction=False)
                for key, n in access.items():
                    pipe.zincrby(self.hot_key, n, key)
                pipe.zremrangebyrank(self.hot_key, 0, -self.max_hot_keys - 1)
                pipe.pexpire(self.hot_key, self.counters.ttl_ms)
                pipe.execute()
            self.decay()
        except _FLUSH_ERRORS:  # ValueError: the client was closed
            log.warning("cache stats flush failed; counts of this interval are lost", exc_info=True)
        finally:
            self._flushing.release()

    def close(self) -> None:
        """Wait for a flush under way, then flush what is left (before the client closes)."""
        with self._lock:
            flusher = self._flusher
        if flusher is not None:
            flusher.join()
        self.flush()

    def decay(self) -> int:
        """Halve the access counts once per elapsed half-life; returns the periods applied."""
        periods = self._decay(
            keys=[self.hot_key, self.decay_key],
            args=[repr(self.clock()), repr(self.half_life), "0.01", self.counters.ttl_ms],
        )
        return int(periods)

    def stats(self) -> dict[str, dict[str, float]]:
        self.flush()
        raw: dict[bytes, bytes] = self.client.hgetall(self.stats_key)  # type: ignore[assignment]
        out: dict[str, dict[str, float]] = {}
        for field, value in raw.items():
            pattern, _, name = field.decode().rpartition("|")
            row = out.setdefault(pattern, {f: 0 for f in FIELDS})
            number = float(value)
            row[name] = number if name == "wait_time" else int(round(number))
        return out

    def hot_keys(self, n: int) -> list[tuple[str, float]]:
        self.flush()
        rows: list[tuple[bytes, float]] = self.client.zrevrange(  # type: ignore[assignment]
            self.hot_key, 0, n - 1, withscores=True
        )
        return [(key.decode(), float(score)) for key, score in rows]
