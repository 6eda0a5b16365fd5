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

import contextlib
import glob
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
    postmaster and every backend) and ``stop()`` act on this cluster only.
    """

    def __init__(self, *, port: int | None = None, prefix: str = "sekali-pg-") -> None:
        self.port = port or free_port()
        self.bindir = postgres_bindir()
        self.root = Path(tempfile.mkdtemp(prefix=prefix))
        self.data_dir = self.root / "data"
        self.socket_dir = self.root / "run"
        self.log_file = self.root / "postgres.log"
        self._run_as = "postgres" if os.geteuid() == 0 else None
        self._frozen: list[int] = []
        self.password = secrets.token_hex(16)

    def url(self, database: str = "postgres") -> str:
        """The SQLAlchemy URL of ``database`` on this cluster (TCP on loopback), password
        included: a secret (environment or 0600 file, never argv or output)."""
        return f"postgresql+psycopg://postgres:{self.password}@127.0.0.1:{self.port}/{database}"

    def _cmd(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        argv = list(args)
        if self._run_as is not None:
            argv = ["runuser", "-u", self._run_as, "--", *argv]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise PostgresUnavailable(
                f"{' '.join(args[:2])} failed ({result.returncode}): "
                f"{(result.stderr or result.stdout).strip()[-800:]}"
            )
        return result

    def start(self) -> PostgresServer:
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
