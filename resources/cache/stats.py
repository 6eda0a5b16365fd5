"""Cache counters and hot-key access counts, batched in process and shared through Redis.

Counting on every call would add a round trip to the hit path, so each process adds up locally and
flushes at most once per ``flush_interval`` (and on ``stats()``, ``hot_keys()`` and ``close()``)
with one pipeline: ``HINCRBYFLOAT`` into one hash per namespace (field ``"<pattern>|<name>"``),
``ZINCRBY`` into one sorted set of access counts. Access counts decay by half every
``half_life`` seconds (the first process to flush after a period applies it), so ``hot_keys`` ranks
what is hot now, not what was hot yesterday.

Counts are eventually shared: a process's last ``flush_interval`` of counts is visible to others
only after its next flush; a process killed hard loses at most that much.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable

import redis

from resources.cache.scripts import DECAY, namespace_keys
from resources.telemetry.patterns import key_pattern

log = logging.getLogger(__name__)

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
    """Thread-safe local counters with a periodic flush to Redis."""

    def __init__(
        self,
        client: redis.Redis,
        namespace: str,
        *,
        flush_interval: float = 1.0,
        half_life: float = 300.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.stats_key, self.hot_key, self.decay_key = namespace_keys(namespace)
        self.flush_interval = flush_interval
        self.half_life = half_life
        self.clock = clock
        self._lock = threading.Lock()
        self._flushing = threading.Lock()
        self._counts: dict[tuple[str, str], float] = {}
        self._access: dict[str, int] = {}
        self._hits: dict[str, int] = {}
        self._last_flush = time.monotonic()
        self._decay = client.register_script(DECAY)

    def hit(self, key: str) -> None:
        """``record(key, "hits", access=True)``, kept as cheap as it can be (the hit path)."""
        hits = self._hits
        with self._lock:
            hits[key] = hits.get(key, 0) + 1
        if time.monotonic() - self._last_flush >= self.flush_interval:
            self.flush(block=False)

    def record(self, key: str, field: str, amount: float = 1.0, *, access: bool = False) -> None:
        counts, hits = self._counts, self._access
        with self._lock:
            counts[key, field] = counts.get((key, field), 0.0) + amount
            if access:
                hits[key] = hits.get(key, 0) + 1
        if time.monotonic() - self._last_flush >= self.flush_interval:
            self.flush(block=False)

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
            by_pattern: defaultdict[str, float] = defaultdict(float)
            for (key, field), amount in counts.items():
                by_pattern[f"{key_pattern(key)}|{field}"] += amount
            pipe = self.client.pipeline(transaction=False)
            for field, amount in by_pattern.items():
                pipe.hincrbyfloat(self.stats_key, field, amount)
            for key, n in access.items():
                pipe.zincrby(self.hot_key, n, key)
            pipe.execute()
            self.decay()
        except redis.RedisError:
            log.warning("cache stats flush failed; counts of this interval are lost", exc_info=True)
        finally:
            self._flushing.release()

    def decay(self) -> int:
        """Halve the access counts once per elapsed half-life; returns the periods applied."""
        periods = self._decay(
            keys=[self.hot_key, self.decay_key],
            args=[repr(self.clock()), repr(self.half_life), "0.01"],
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
