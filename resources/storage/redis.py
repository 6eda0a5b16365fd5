"""One way to build a Redis client (a server or a Redis Cluster), always with explicit timeouts,
and one way to run sekali's Lua scripts on it.

redis-py's default ``socket_timeout`` is None before redis-py 8: a frozen server or a dropped
connection would block a worker for as long as it lasts. Every client sekali builds comes from
here, so the bounds are stated once (:class:`RedisTimeouts`): a command returns or raises within
``connect + socket`` seconds (7 s by default), well inside a lock TTL or a lease, so a worker cut
off from Redis gives up, and its locks expire for the next holder.

``REDIS_URL`` names a server (``redis://host:6379/0``, ``rediss://``, ``unix://``) or a Redis
Cluster: ``redis+cluster://host1:7000,host2:7001`` (``rediss+cluster://`` for TLS; any reachable
master or replica serves as a seed, the client reads the slot map from it). The cluster client
gets the same timeouts on every node it connects to, and it retries nothing: a redirection
(``MOVED``/``ASK``) is followed, anything else is the caller's to retry. sekali's keys carry
``{hash tags}`` (:func:`hash_tag`), so the keys of every script land in one slot.

Scripts (:class:`Script`): a Lua script whose keys hold what must not vanish (locks, fences,
concurrency slots, rate buckets, the retry budget) checks at its client's first use that Redis
cannot evict them (:func:`require_no_eviction`, docs/locks.md), and a reply that says the store
cannot take the write now becomes sekali's error (:func:`store_error`): ``OOM`` is
:class:`StoreFull`, ``READONLY`` is :class:`StoreReadOnly`, ``MASTERDOWN``, ``LOADING``,
``BUSY``, ``CLUSTERDOWN`` and ``TRYAGAIN`` are :class:`StoreUnavailable`, each saying what to
do.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias
from urllib.parse import parse_qs, unquote

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from resources.errors import EvictingRedis, StoreFull, StoreReadOnly, StoreUnavailable
from resources.storage.settings import RedisTimeouts

log = logging.getLogger(__name__)

RedisClient: TypeAlias = redis.Redis | RedisCluster
"""What sekali's Redis-backed defences take: a client of one server, or of a Redis Cluster."""

REDIS_ERRORS: tuple[type[Exception], ...] = (redis.RedisError, RedisClusterException)
"""What a client of a server or of a cluster raises about Redis (a cluster client that reaches
none of its nodes raises ``RedisClusterException``, which is not a ``RedisError``)."""
UNREACHABLE: tuple[type[Exception], ...] = (
    redis.ConnectionError, redis.TimeoutError, RedisClusterException,
)
"""Redis did not answer (or no node of the cluster did)."""

CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}  # scheme -> TLS


def redis_client(url: str, *, timeouts: RedisTimeouts | None = None) -> RedisClient:
    """A client for ``url`` (a server, or a cluster: module docstring) that never waits without
    a bound. Connects on first use.

    ``timeouts`` default to :meth:`RedisTimeouts.from_env` (read now). The client does not retry
    a command (``Retry(NoBackoff(), 0)``, the same on redis-py 5 to 8): a pooled connection the
    server closed is reconnected when it is taken from the pool, and anything else is the
    caller's to retry.
    """
    t = timeouts or RedisTimeouts.from_env()
    bounds: dict[str, Any] = {
        "socket_timeout": t.socket,
        "socket_connect_timeout": t.connect,
        "health_check_interval": t.health_check_interval,
        "retry": Retry(NoBackoff(), 0),
    }
    scheme = url.split("://", 1)[0].lower()
    if scheme in CLUSTER_SCHEMES:
        return _cluster_client(url, tls=CLUSTER_SCHEMES[scheme], bounds=bounds)
    return redis.Redis.from_url(url, **bounds)


def _cluster_client(url: str, *, tls: bool, bounds: dict[str, Any]) -> RedisCluster:
    """``redis+cluster://[user:password@]host:port[,host:port...][/][?option=value]``."""
    rest = url.split("://", 1)[1]
    rest, _, query = rest.partition("?")
    rest = rest.split("/", 1)[0]
    credentials, _, hosts = rest.rpartition("@")
    username, _, password = credentials.partition(":")
    nodes = []
    for item in hosts.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(
                f"REDIS_URL: {item!r} is not host:port; a cluster URL lists its seed nodes as "
                "redis+cluster://host1:7000,host2:7001"
            )
        nodes.append(ClusterNode(host.strip("[]"), int(port)))  # type: ignore[no-untyped-call]
    options = {name: values[-1] for name, values in parse_qs(query).items()}
    return RedisCluster(
        startup_nodes=nodes,
        username=unquote(username) or None,
        password=unquote(password) or None,
        ssl=tls,
        require_full_coverage=options.get("require_full_coverage", "true") != "false",
        **bounds,
    )


def is_cluster(client: RedisClient) -> bool:
    return isinstance(client, RedisCluster)


def client_timeouts(client: RedisClient) -> RedisTimeouts:
    """The timeouts a client was built with (defaults for what it does not say), so blocking
    waits can stay shorter than its socket timeout. Works for a cluster client too (the
    keyword arguments every node's connections get)."""
    if isinstance(client, RedisCluster):
        kwargs = client.get_connection_kwargs()  # type: ignore[no-untyped-call]
    else:
        kwargs = client.connection_pool.connection_kwargs
    defaults = RedisTimeouts()
    socket = kwargs.get("socket_timeout")
    connect = kwargs.get("socket_connect_timeout")
    return RedisTimeouts(
        socket=float(socket) if socket else float("inf"),
        connect=float(connect) if connect else defaults.connect,
        health_check_interval=int(kwargs.get("health_check_interval") or 0),
    )


def hash_tag(text: str) -> str:
    """``text`` as the inside of a ``{hash tag}``. Redis hashes only what lies between the first
    ``{`` and the next ``}``; behind a prefix without braces, every key that starts with
    ``prefix{text`` shares that tag, whatever braces ``text`` holds, unless ``text`` starts with
    ``}`` (or is empty): the tag is then empty, Redis hashes each whole key, and one script's
    keys land in different slots (``CROSSSLOT`` on a cluster). Such a text (and, to keep
    distinct texts distinct, one that starts with ``%``) gets a ``%`` in front; every other text
    is unchanged."""
    if not text or text[0] in "}%":
        return "%" + text
    return text


# -- what the server says -------------------------------------------------------------------------

# Reply codes (the first word of an error reply) that mean "not now"; a script that met one
# reports it inside its own error text.
NOT_NOW_CODES = ("OOM", "READONLY", "MASTERDOWN", "LOADING", "BUSY", "CLUSTERDOWN", "TRYAGAIN",
                 "MOVED", "ASK", "NOSCRIPT")


def reply_code(exc: BaseException) -> str | None:
    """The reply code of a Redis error that means "not now" (:data:`NOT_NOW_CODES`), also when a
    script met it: redis-py strips the code of a plain reply and keeps it in ``status_code``; a
    script's error carries it inside its text (``... -OOM command not allowed ...``)."""
    code = getattr(exc, "status_code", None)
    if isinstance(code, str) and code in NOT_NOW_CODES:
        return code
    message = str(exc)[:2000]  # the code sits near the start: never scan a huge text
    for name in NOT_NOW_CODES:
        if message.startswith(name + " ") or f"-{name} " in message or f": {name} " in message:
            return name
    return None


_STORE_REPLIES: dict[str, tuple[type[StoreUnavailable], str]] = {
    "OOM": (StoreFull, "Redis is full (used memory > maxmemory under maxmemory-policy "
            "noeviction), so it refused the write and nothing was written; free memory (delete "
            "or expire keys) or raise maxmemory, and the retries succeed"),
    "READONLY": (StoreReadOnly, "Redis answered READONLY: the node is a replica (a failover under "
                 "way, or REDIS_URL names a replica); nothing was written; retry once the "
                 "primary is back, or point REDIS_URL at the primary"),
    "MASTERDOWN": (StoreUnavailable, "the Redis replica lost its primary and serves no stale "
                   "data (MASTERDOWN); retry later"),
    "LOADING": (StoreUnavailable, "Redis is loading its dataset after a restart (LOADING); "
                "retry in a moment"),
    "BUSY": (StoreUnavailable, "Redis is busy running a long script (BUSY); retry later"),
    "CLUSTERDOWN": (StoreUnavailable, "the Redis Cluster is down or does not serve this slot "
                    "(CLUSTERDOWN); retry once it has recovered"),
    "TRYAGAIN": (StoreUnavailable, "the Redis Cluster is moving this slot (TRYAGAIN); retry "
                 "in a moment"),
    "MOVED": (StoreUnavailable, "a Redis Cluster node sent the command to another node (MOVED): "
              "REDIS_URL names one node of a cluster; write it redis+cluster://host:port,... "
              "so the client follows the slots"),
    "ASK": (StoreUnavailable, "a Redis Cluster node sent the command to another node (ASK: a "
            "slot being moved) and this client does not follow redirections; use a "
            "redis+cluster:// REDIS_URL"),
}


def store_error(exc: BaseException, what: str = "") -> StoreUnavailable | None:
    """The :class:`StoreUnavailable` a Redis error reply means when it is about the store's
    state (module docstring), or None."""
    known = _STORE_REPLIES.get(reply_code(exc) or "")
    if known is None:
        return None
    error, message = known
    where = f" ({what})" if what else ""
    return error(f"{message}{where}: {str(exc).strip()[:300]}")


# -- eviction ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryPolicy:
    """One node's ``maxmemory`` and ``maxmemory-policy`` (from ``INFO memory``)."""

    node: str
    policy: str
    maxmemory: int

    @property
    def evicts(self) -> bool:
        """Whether Redis may delete keys on its own under memory pressure: any policy but
        ``noeviction`` (``volatile-*`` policies evict keys with a TTL, which every lock, slot
        and bucket key has)."""
        return self.policy != "noeviction"


def memory_policies(client: RedisClient) -> list[MemoryPolicy]:
    """Every node's memory policy: the server's, or each primary's of a cluster."""
    if isinstance(client, RedisCluster):
        replies = client.info("memory", target_nodes=RedisCluster.PRIMARIES)
        if replies and all(isinstance(v, dict) for v in replies.values()):
            return [_policy(str(node), info) for node, info in sorted(replies.items())]
        return [_policy("cluster", replies)]
    kwargs = client.connection_pool.connection_kwargs
    node = kwargs.get("path") or f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"
    return [_policy(str(node), client.info("memory"))]


def _policy(node: str, info: Any) -> MemoryPolicy:
    return MemoryPolicy(
        node, str(info.get("maxmemory_policy", "unknown")), int(info.get("maxmemory", 0) or 0)
    )


_checked: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
_checked_guard = threading.Lock()


def require_no_eviction(client: RedisClient, keeps: str) -> None:
    """Refuse (:class:`EvictingRedis`, permanent) to keep ``keeps`` on a Redis that may evict
    keys; checked once per client (``INFO memory``, one round trip, on the first script call).
    A Redis that does not let us read ``INFO`` is used with a warning: nothing can be checked.
    A policy changed later is caught by ``sekali doctor`` (``redis_eviction``)."""
    with _checked_guard:
        if _checked.get(client):
            return
    try:
        policies = memory_policies(client)
    except redis.ResponseError as exc:  # INFO renamed or denied (a managed Redis)
        log.warning("cannot read Redis's maxmemory-policy (%s): eviction not checked", exc)
        policies = []
    for node in policies:
        if node.evicts:
            raise EvictingRedis(node.node, node.policy, node.maxmemory, keeps)
    with _checked_guard:
        _checked[client] = True


class Script:
    """A Lua script of sekali's on ``client``, called like redis-py's (``keys=``, ``args=``).

    ``keeps`` says what its keys hold when they must not vanish (``"locks"``, ``"concurrency
    slots"``...): its first call on a client checks that Redis cannot evict them
    (:func:`require_no_eviction`). A reply about the store's state becomes sekali's error
    (:func:`store_error`); anything else (a connection error, the script's own error) is
    re-raised as it is, for the caller's own handling and :func:`resources.retry.classify`.
    """

    __slots__ = ("_checked", "_client", "_keeps", "_script")

    def __init__(self, client: RedisClient, source: str, *, keeps: str | None) -> None:
        self._client = client
        self._script = client.register_script(source)
        self._keeps = keeps
        self._checked = keeps is None

    def __call__(self, keys: Sequence[Any] = (), args: Sequence[Any] = ()) -> Any:
        if not self._checked:
            require_no_eviction(self._client, self._keeps or "its keys")
            self._checked = True
        try:
            return self._script(keys=keys, args=args)
        except redis.ResponseError as exc:
            ours = store_error(exc, self._keeps or "")
            if ours is None:
                raise
            raise ours from exc


__all__ = [
    "CLUSTER_SCHEMES",
    "NOT_NOW_CODES",
    "MemoryPolicy",
    "REDIS_ERRORS",
    "UNREACHABLE",
    "RedisClient",
    "Script",
    "client_timeouts",
    "hash_tag",
    "is_cluster",
    "memory_policies",
    "redis_client",
    "reply_code",
    "require_no_eviction",
    "store_error",
]
