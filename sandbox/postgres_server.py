"""A private PostgreSQL cluster: ``initdb`` into a folder of its own, on a free port.

For tests and the chaos harness, which must freeze (SIGSTOP) or restart a Postgres without
touching a shared server. The cluster belongs to whoever started it: :meth:`PostgresServer.stop`
ends it and removes its folder, and nothing here ever signals or restarts a cluster it did not
start. The binaries come from ``PG_BINDIR``, ``pg_config --bindir`` or the newest
``/usr/lib/postgresql/*/bin``. ``initdb`` refuses to run as root, so under root every command
runs as the ``postgres`` user (``runuser``) in a folder that user owns.

Locked down, because any local user can reach a loopback port and a superuser can run programs
(``COPY ... TO PROGRAM``): every connection, TCP or the Unix socket (in the 0700 folder),
authenticates with SCRAM and a password generated here (:attr:`PostgresServer.password`, carried
by :meth:`PostgresServer.url`). ``initdb`` reads it from a 0600 file removed right after, never
from its command line.
"""

from __future__ import annotations

import base64
import contextlib
import glob
import hashlib
import hmac
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from sandbox.redis_server import free_port


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL binaries here, or the private cluster would not start (the message says
    which and what to install or set)."""


def postgres_bindir() -> Path:
    """Where ``initdb`` and ``pg_ctl`` live (``PG_BINDIR`` wins)."""
    explicit = os.environ.get("PG_BINDIR")
    candidates = [explicit] if explicit else []
    if shutil.which("pg_config"):
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            candidates.append(
                subprocess.run(
                    ["pg_config", "--bindir"], capture_output=True, text=True, timeout=10
                ).stdout.strip()
            )
    candidates += sorted(
        glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]), reverse=True
    )
    for candidate in candidates:
        if candidate and (Path(candidate) / "initdb").exists():
            return Path(candidate)
    raise PostgresUnavailable(
        "no initdb/pg_ctl found: install the PostgreSQL server package or set PG_BINDIR"
    )


class PostgresServer:
    """One private cluster: its data folder, socket folder, port and log.

    ``start()`` runs ``initdb`` once (SCRAM authentication of the user ``postgres``) and
    ``pg_ctl start``; ``restart()``, ``freeze()`` / ``thaw()`` (SIGSTOP / SIGCONT of the
    postmaster and every backend), ``kill()`` and ``stop()`` act on this cluster only.
    ``replica()`` starts a streaming standby of it (asynchronous: nothing names it in
    ``synchronous_standby_names``), ``promote()`` makes a standby the primary.
    """

    def __init__(self, *, port: int | None = None, prefix: str = "sekali-pg-",
                 primary: PostgresServer | None = None, primary_port: int | None = None
                 ) -> None:
        self.port = port or free_port()
        self.bindir = postgres_bindir()
        self.root = Path(tempfile.mkdtemp(prefix=prefix))
        self.data_dir = self.root / "data"
        self.socket_dir = self.root / "run"
        self.log_file = self.root / "postgres.log"
        self._run_as = "postgres" if os.geteuid() == 0 else None
        self._frozen: list[int] = []
        self.primary = primary
        self.primary_port = primary_port or (primary.port if primary is not None else None)
        self.password: str = (primary.password if primary is not None
                              else secrets.token_hex(16))

    def url(self, database: str = "postgres") -> str:
        """The SQLAlchemy URL of ``database`` on this cluster (TCP on loopback), password
        included: a secret (environment or 0600 file, never argv or output)."""
        return f"postgresql+psycopg://postgres:{self.password}@127.0.0.1:{self.port}/{database}"

    def _cmd(self, *args: str, timeout: float = 120,
             password: bool = False) -> subprocess.CompletedProcess[str]:
        argv = list(args)
        if self._run_as is not None:
            argv = ["runuser", "-u", self._run_as, "--", *argv]
        env = {**os.environ, "PGPASSWORD": self.password} if password else None
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
        if result.returncode != 0:
            raise PostgresUnavailable(
                f"{' '.join(args[:2])} failed ({result.returncode}): "
                f"{(result.stderr or result.stdout).strip()[-800:]}"
            )
        return result

    def start(self) -> PostgresServer:
        if not self.data_dir.exists() and self.primary is not None:
            self._base_backup(self.primary)
        if not self.data_dir.exists():
            self.root.chmod(0o700)
            self.socket_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            pwfile = self.root / "pwfile"
            fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as out:
                out.write(self.password + "\n")
            if self._run_as is not None:
                user = pwd.getpwnam(self._run_as)
                for path in (self.root, self.socket_dir, pwfile):
                    os.chown(path, user.pw_uid, user.pw_gid)
            try:
                self._cmd(
                    str(self.bindir / "initdb"), "-D", str(self.data_dir), "-U", "postgres",
                    "--auth=scram-sha-256", f"--pwfile={pwfile}", "-E", "UTF8", "--no-sync",
                    "--no-instructions",
                )
            finally:
                pwfile.unlink(missing_ok=True)
        self._pg_ctl("start")
        return self

    def _base_backup(self, primary: PostgresServer) -> None:
        """The standby's data folder: ``pg_basebackup -R`` from ``primary`` (its replication
        connection, to ``primary_port``, and ``standby.signal`` written), the password in the
        environment only."""
        self.root.chmod(0o700)
        self.socket_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self._run_as is not None:
            user = pwd.getpwnam(self._run_as)
            for path in (self.root, self.socket_dir):
                os.chown(path, user.pw_uid, user.pw_gid)
        self._cmd(
            str(self.bindir / "pg_basebackup"), "-D", str(self.data_dir), "-h", "127.0.0.1",
            "-p", str(self.primary_port), "-U", "postgres", "-R", "-X", "stream", "--no-sync",
            "-c", "fast", password=True,
        )

    def replica(self, prefix: str = "sekali-pg-replica-", *,
                through: int | None = None) -> PostgresServer:
        """A streaming standby of this cluster on a free port, started and caught up with what
        this cluster had when it started (asynchronous: a commit never waits for it). With
        ``through`` (a proxy's port in front of this cluster) its replication connection goes
        there, so cutting the proxy cuts the standby off."""
        return PostgresServer(prefix=prefix, primary=self, primary_port=through).start()

    def lag_bytes(self) -> int | None:
        """How far the first standby's replay is behind this primary's WAL (None: none)."""
        with contextlib.suppress(PostgresUnavailable):
            out = self._psql("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), replay_lsn)"
                             " FROM pg_stat_replication WHERE state = 'streaming' LIMIT 1")
            return int(float(out)) if out else None
        return None

    def _psql(self, sql: str) -> str:
        return self._cmd(
            str(self.bindir / "psql"), "-h", "127.0.0.1", "-p", str(self.port), "-U",
            "postgres", "-d", "postgres", "-At", "-c", sql, password=True, timeout=30,
        ).stdout.strip()

    def promote(self) -> None:
        """End this standby's recovery: it becomes a primary with what it had replayed."""
        self._cmd(str(self.bindir / "pg_ctl"), "promote", "-D", str(self.data_dir), "-w",
                  "-t", "60")

    def kill(self) -> None:
        """SIGKILL the postmaster and every backend at once: the server dies mid-write, with
        whatever it committed and no standby received."""
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            alive = self.postmaster_pid()
            if alive is None or not Path(f"/proc/{alive}").exists():
                break
            time.sleep(0.05)

    def _pg_ctl(self, action: str, *extra: str) -> None:
        options = (
            f"-p {self.port} -k {self.socket_dir} -c listen_addresses=127.0.0.1"
            " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        )
        self._cmd(
            str(self.bindir / "pg_ctl"), action, "-D", str(self.data_dir), "-w", "-t", "60",
            "-l", str(self.log_file), "-o", options, *extra,
        )

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.data_dir / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def processes(self) -> list[int]:
        """The postmaster and its children (backends, checkpointer, walwriter, ...)."""
        pid = self.postmaster_pid()
        if pid is None:
            return []
        children: list[int] = []
        for task in glob.glob(f"/proc/{pid}/task/*/children"):
            with contextlib.suppress(OSError):
                children += [int(c) for c in Path(task).read_text().split()]
        return [pid, *children]

    def freeze(self) -> None:
        """SIGSTOP the whole cluster: the kernel still accepts connections and acknowledges
        packets, but nothing answers (a hung server, a VM paused, a stop-the-world stall)."""
        self._frozen = self.processes()
        for pid in self._frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        for pid in self._frozen or self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self._frozen = []

    def restart(self) -> None:
        self._pg_ctl("restart", "-m", "fast")

    def stop(self) -> None:
        """Stop the cluster (thawed first) and remove its folder."""
        self.thaw()
        if self.postmaster_pid() is not None:
            with contextlib.suppress(PostgresUnavailable, subprocess.SubprocessError):
                self._cmd(
                    str(self.bindir / "pg_ctl"), "stop", "-D", str(self.data_dir), "-w",
                    "-t", "30", "-m", "immediate", timeout=60,
                )
        deadline = time.monotonic() + 10
        while self.postmaster_pid() is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        shutil.rmtree(self.root, ignore_errors=True)


def scram_verifier(password: str, *, iterations: int = 4096, salt: bytes | None = None) -> str:
    """The SCRAM-SHA-256 verifier PostgreSQL stores for ``password`` (RFC 5802/7677, as
    ``libpq``'s ``PQencryptPasswordConn`` makes it). ``CREATE ROLE ... PASSWORD '<verifier>'``
    then sets the password without it ever reaching the server as text, so it is in no
    statement log and no ``pg_stat_statements`` row."""
    salt = salt if salt is not None else os.urandom(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
    stored_key = hashlib.sha256(client_key).digest()
    server_key = hmac.new(salted, b"Server Key", hashlib.sha256).digest()

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(stored_key)}:{b64(server_key)}"
