"""A private Redis Cluster: three masters (no replicas) on free loopback ports, in a folder of its
own, built with ``redis-cli --cluster create``. For the tests and benchmarks that must show
sekali's scripts on a real cluster (every script's keys in one slot, timeouts on every node).
:meth:`LocalRedisCluster.stop` ends every server it started, and nothing else. Every node requires
the cluster's one generated password (``redis-cli`` gets it from its environment, not argv)."""

from __future__ import annotations

import os
import random
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from sandbox.redis_server import RedisServer, redis_server_binary


def redis_cli_binary() -> str:
    """``redis-cli`` beside the ``redis-server`` in use, else the one on ``PATH``."""
    beside = Path(redis_server_binary()).with_name("redis-cli")
    if beside.exists():
        return str(beside)
    found = shutil.which("redis-cli")
    if not found:
        raise RuntimeError("no redis-cli to create a cluster with: install redis-tools")
    return found


def free_cluster_port() -> int:
    """A free loopback port whose cluster bus port (+10000) is free too: Redis 6 derives the
    bus port that way, so the port must be 55535 or less."""
    for _ in range(200):
        port = random.randint(20000, 55535)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free pair of ports (port, port + 10000) for a cluster node")


class LocalRedisCluster:
    """``masters`` redis-servers with ``--cluster-enabled yes``, joined into one cluster that
    covers every slot. ``url`` is sekali's ``redis+cluster://`` URL of it."""

    def __init__(self, directory: Path, *, masters: int = 3, node_timeout_ms: int = 2000) -> None:
        self.directory = directory
        self.node_timeout_ms = node_timeout_ms
        self.password = secrets.token_hex(16)
        self.servers = [
            RedisServer(
                directory / f"node{i}",
                port=free_cluster_port(),
                password=self.password,
                options=[
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", str(node_timeout_ms),
                ],
            )
            for i in range(masters)
        ]

    @property
    def ports(self) -> list[int]:
        return [int(s.port) for s in self.servers if s.port is not None]

    @property
    def url(self) -> str:
        """The client URL, password included: a secret (environment or 0600 file only)."""
        nodes = ",".join(f"127.0.0.1:{p}" for p in self.ports)
        return f"redis+cluster://:{self.password}@{nodes}"

    def node(self, index: int) -> redis.Redis:
        """A plain client of one node (it answers MOVED for slots it does not serve)."""
        return redis.Redis(host="127.0.0.1", port=self.ports[index], password=self.password,
                           socket_timeout=5, socket_connect_timeout=2)

    def start(self, timeout: float = 60.0) -> LocalRedisCluster:
        for server in self.servers:
            server.start()
        subprocess.run(
            [redis_cli_binary(), "--cluster", "create",
             *(f"127.0.0.1:{p}" for p in self.ports),
             "--cluster-replicas", "0", "--cluster-yes"],
            check=True, capture_output=True, timeout=timeout,
            env={**os.environ, "REDISCLI_AUTH": self.password},
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = []
            for i in range(len(self.servers)):
                client = self.node(i)
                try:
                    states.append(client.cluster("INFO").get("cluster_state"))
                except redis.RedisError:
                    states.append(None)
                finally:
                    client.close()
            if all(state == "ok" for state in states):
                return self
            time.sleep(0.1)
        raise RuntimeError(f"the cluster on {self.ports} did not reach cluster_state:ok")

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
