"""Lock events and their counters: in process, or shared through one Redis hash."""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable
from typing import Protocol

from resources.storage.redis import REDIS_ERRORS, RedisClient
from resources.telemetry import counters
from resources.telemetry.patterns import key_pattern

log = logging.getLogger(__name__)
_FLUSH_ERRORS: tuple[type[Exception], ...] = (*REDIS_ERRORS, OSError, ValueError)  # closed client
Clock = Callable[[], float]

# -- metrics hooks ---------------------------------------------------------------------------

EVENTS = (
    "acquired",  # count
    "acquire_failed",  # count: the wait ran out
    "wait_seconds",  # sum of time spent waiting for a grant
    "hold_seconds",  # sum of time between grant and release
    "renewed",  # count of successful watchdog extensions
    "renew_failed",  # count of extensions that errored (store unavailable)
    "lost",  # count of LockLost raised by check()
    "fenced_rejected",  # count of fenced writes refused (resources.locks.fencing)
)


class LockObserver(Protocol):
    """Receives lock events. Must be cheap and must never raise: locks call it inline."""

    def record(self, event: str, name: str, value: float = 1.0) -> None: ...


def name_pattern(name: str) -> str:
    """Aggregate per-entity lock names: ``order:123`` -> ``order:*``; ``nightly`` stays."""
    return key_pattern(name)


class NullLockObserver:
    def record(self, event: str, name: str, value: float = 1.0) -> None:
        return None


class MemoryLockStats:
    """In-process counters keyed ``(pattern, event)``. For tests and single-process tools."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counters: dict[tuple[str, str], float] = defaultdict(float)

    def record(self, event: str, name: str, value: float = 1.0) -> None:
        with self._lock:
            self.counters[(name_pattern(name), event)] += value

    def get(self, name_or_pattern: str, event: str) -> float:
        pattern = (
            name_or_pattern if name_or_pattern.endswith("*") else name_pattern(name_or_pattern)
        )
        with self._lock:
            return self.counters.get((pattern, event), 0.0)


STATS_KEY = "sekali:stats:locks"


class RedisLockStats:
    """Counters shared by every process, in one Redis hash (``HINCRBYFLOAT``).

    Fields are ``<pattern>:<event>``. Events are summed in memory and flushed in one script
    at most every ``flush_interval`` seconds (and at exit, and on :meth:`flush`), so metrics
    cost no extra round trip on the lock's hot path: a flush that falls due while recording
    runs on a short-lived thread of its own, so a Redis that does not answer never makes a
    ``check()`` or a renewal wait twice. A failed flush is logged and dropped: metrics never
    break a lock.
    The hash is bounded: at most ``max_fields`` fields (new ones past that count under the
    ``~overflow`` pattern) and it expires ``ttl_seconds`` after the last flush
    (:mod:`resources.telemetry.counters`).
    """

    def __init__(
        self,
        client: RedisClient,
        *,
        key: str = STATS_KEY,
        flush_interval: float = 1.0,
        ttl_seconds: float = counters.TTL_SECONDS,
        max_fields: int = counters.MAX_FIELDS,
    ) -> None:
        self.client = client
        self.key = key
        self.counters = counters.BoundedCounters(
            client, key, ttl_seconds=ttl_seconds, max_fields=max_fields
        )
        self.flush_interval = flush_interval
        self._pending: dict[str, float] = defaultdict(float)
        self._lock = threading.Lock()
        self._last_flush = time.monotonic()
        self._flusher: threading.Thread | None = None
        _live_stats.add(self)

    def record(self, event: str, name: str, value: float = 1.0) -> None:
        with self._lock:
            self._pending[f"{name_pattern(name)}:{event}"] += value
            due = time.monotonic() - self._last_flush >= self.flush_interval
            if due and (self._flusher is None or not self._flusher.is_alive()):
                self._last_flush = time.monotonic()
                self._flusher = threading.Thread(
                    target=self.flush, name="lock-stats-flush", daemon=True
                )
                self._flusher.start()

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, defaultdict(float)
            self._last_flush = time.monotonic()
        if not pending:
            return
        try:
            self.counters.add(
                (field, f"{counters.OVERFLOW}:{field.rpartition(':')[2]}", value)
                for field, value in pending.items()
            )
        except _FLUSH_ERRORS as exc:  # ValueError: client closed
            log.warning("lock stats flush failed: %s", exc, extra={"stats_key": self.key})


_live_stats: weakref.WeakSet[RedisLockStats] = weakref.WeakSet()
_stats_by_client: weakref.WeakKeyDictionary[RedisClient, RedisLockStats] = (
    weakref.WeakKeyDictionary()
)
_stats_guard = threading.Lock()


def _flush_all_stats() -> None:
    for stats in list(_live_stats):
        stats.flush()


atexit.register(_flush_all_stats)


def default_stats(client: RedisClient) -> RedisLockStats:
    with _stats_guard:
        stats = _stats_by_client.get(client)
        if stats is None:
            stats = _stats_by_client[client] = RedisLockStats(client)
        return stats


def lock_stats(client: RedisClient, *, key: str = STATS_KEY) -> dict[str, dict[str, float]]:
    """Read the shared counters: ``{"order:*": {"acquired": 12.0, "wait_seconds": 0.4, ...}}``."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for field, value in client.hgetall(key).items():
        field_s = field.decode() if isinstance(field, bytes) else str(field)
        pattern, _, event = field_s.rpartition(":")
        out[pattern][event] = float(value)
    return dict(out)


