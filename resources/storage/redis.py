"""One way to build a Redis client: always with explicit timeouts.

redis-py's default ``socket_timeout`` is None before redis-py 8: a frozen server or a dropped
connection would block a worker for as long as it lasts. Every client sekali builds comes from
here, so the bounds are stated once.
"""

from __future__ import annotations

import redis

SOCKET_TIMEOUT = 10.0
"""Seconds a command may wait for its reply (blocking waits use shorter server-side timeouts)."""
CONNECT_TIMEOUT = 5.0
HEALTH_CHECK_INTERVAL = 30


def redis_client(
    url: str,
    *,
    socket_timeout: float = SOCKET_TIMEOUT,
    connect_timeout: float = CONNECT_TIMEOUT,
) -> redis.Redis:
    """A client for ``url`` that never waits without a bound. Connects on first use."""
    return redis.Redis.from_url(
        url,
        socket_timeout=socket_timeout,
        socket_connect_timeout=connect_timeout,
        health_check_interval=HEALTH_CHECK_INTERVAL,
    )
