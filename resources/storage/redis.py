"""One way to build a Redis client: always with explicit timeouts.

redis-py's default ``socket_timeout`` is None before redis-py 8: a frozen server or a dropped
connection would block a worker for as long as it lasts. Every client sekali builds comes from
here, so the bounds are stated once (:class:`RedisTimeouts`): a command returns or raises within
``connect + socket`` seconds (7 s by default), well inside a lock TTL or a lease, so a worker cut
off from Redis gives up, and its locks expire for the next holder.
"""

from __future__ import annotations

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from resources.storage.settings import RedisTimeouts


def redis_client(url: str, *, timeouts: RedisTimeouts | None = None) -> redis.Redis:
    """A client for ``url`` that never waits without a bound. Connects on first use.

    ``timeouts`` default to :meth:`RedisTimeouts.from_env` (read now). The client does not retry
    a command (``Retry(NoBackoff(), 0)``, the same on redis-py 5 to 8): a pooled connection the
    server closed is reconnected when it is taken from the pool, and anything else is the
    caller's to retry.
    """
    t = timeouts or RedisTimeouts.from_env()
    return redis.Redis.from_url(
        url,
        socket_timeout=t.socket,
        socket_connect_timeout=t.connect,
        health_check_interval=t.health_check_interval,
        retry=Retry(NoBackoff(), 0),
    )


def client_timeouts(client: redis.Redis) -> RedisTimeouts:
    """The timeouts a client was built with (defaults for what it does not say), so blocking
    waits can stay shorter than its socket timeout."""
    kwargs = client.connection_pool.connection_kwargs
    defaults = RedisTimeouts()
    socket = kwargs.get("socket_timeout")
    connect = kwargs.get("socket_connect_timeout")
    return RedisTimeouts(
        socket=float(socket) if socket else float("inf"),
        connect=float(connect) if connect else defaults.connect,
        health_check_interval=int(kwargs.get("health_check_interval") or 0),
    )
