"""Wake-ups: tell an idle consumer that work arrived, so it need not poll for it.

A wake-up is a hint, never the record: the work itself is in the database, and a consumer that
misses a wake-up (Redis away, a token consumed by another consumer first) finds the work at its
next poll. So a wake-up may be lost, duplicated or early (sent before the producer's
transaction commits) without harm; it only shortens the wait.

- :class:`RedisWakeup` (the default): a bounded Redis list per channel. ``notify`` pushes a
  token (``LPUSH`` and ``LTRIM`` in one round trip); ``wait`` blocks on ``BLPOP`` for at most
  the timeout, so an idle consumer wakes within milliseconds of a ``notify`` and costs one
  blocked connection, and then empties the list: one wake-up answers every token pushed before
  it (see :meth:`RedisWakeup.wait`). Works on SQLite and Postgres alike, and on Redis Cluster
  (one hash tag).
  While Redis is away, ``notify`` gives up at once for a few seconds (``down_for``) instead of
  paying a connect timeout per call, and ``wait`` sleeps its timeout: a short poll.
- :class:`PollWakeup`: no wake-up at all; ``wait`` sleeps its timeout.

Redis list key: ``{namespace}:{wake}:{channel}`` (one ``{hash tag}`` for every channel).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from resources.storage.redis import REDIS_ERRORS, RedisClient, redis_client
from resources.storage.settings import RedisTimeouts

log = logging.getLogger(__name__)


class Wakeup(Protocol):
    def notify(self, channel: str) -> None:
        """Tell whoever waits on ``channel`` that work arrived (best effort, never raises)."""

    def wait(self, channel: str, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for a wake-up on ``channel``; True if one came."""


class PollWakeup:
    """No wake-ups: a consumer polls every ``timeout``. ``stop`` ends a wait early."""

    def __init__(self, stop: threading.Event | None = None) -> None:
        self.stop = stop or threading.Event()

    def notify(self, channel: str) -> None:
        return None

    def wait(self, channel: str, timeout: float) -> bool:
        self.stop.wait(timeout)
        return False


class RedisWakeup:
    """Wake-ups through a bounded Redis list per channel (see the module docstring).

    ``depth``: tokens kept per channel at most (more producers than consumers must not grow
    the list without bound). ``client`` is built on first use from ``url`` with the timeouts of
    :class:`RedisTimeouts`, its socket timeout above the longest ``BLPOP`` it asks for.
    """

    def __init__(
        self,
        url: str,
        *,
        namespace: str = "sekali",
        depth: int = 64,
        down_for: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.url = url
        self.namespace = namespace
        self.depth = depth
        self.down_for = down_for
        self.clock = clock
        self.sleep = sleep
        self._client: RedisClient | None = None
        self._down_until = 0.0
        self._lock = threading.Lock()

    def key(self, channel: str) -> str:
        return f"{self.namespace}:{{wake}}:{channel}"

    def notify(self, channel: str) -> None:
        if self.clock() < self._down_until:
            return
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.lpush(self.key(channel), 1)
            pipe.ltrim(self.key(channel), 0, self.depth - 1)
            pipe.execute()
        except REDIS_ERRORS as exc:  # a hint lost: the consumer's poll finds the work
            self._down(exc)

    def wait(self, channel: str, timeout: float) -> bool:
        """Block for a token, then drop the tokens left in the list: they were pushed before
        the drop, so after a commit that the consumer's next look at the work (which starts
        after the drop) sees. Without that, a consumer busy while work arrived pays a look
        that finds nothing per token it did not consume (for sekali's workers an empty claim,
        which takes the scheduler's lock and commits). A token pushed after the drop is kept
        for the next wait::

            C   a producer commits work W, then pushes its token T
            P   the consumer's BLPOP returns (T, or a token before it); the rest are dropped
            P+  the consumer looks: W committed before, so it sees W (a consumer that then
                leaves work behind, a full page, pushes a token for another)
        """
        if self.clock() < self._down_until:
            self.sleep(timeout)
            return False
        try:
            blocking = RedisTimeouts.from_env().blocking_wait(timeout)
            if self.client.blpop([self.key(channel)], timeout=blocking) is None:
                return False
            self.client.ltrim(self.key(channel), 1, 0)  # an empty range: the list is removed
            return True
        except REDIS_ERRORS as exc:
            self._down(exc)
            self.sleep(timeout)
            return False

    def _down(self, exc: BaseException) -> None:
        if self.clock() >= self._down_until:
            log.warning("wake-ups through Redis unavailable for %.0f s (%s): consumers poll",
                        self.down_for, type(exc).__name__)
        self._down_until = self.clock() + self.down_for

    @property
    def client(self) -> RedisClient:
        with self._lock:
            if self._client is None:
                self._client = redis_client(self.url)
            return self._client

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None
