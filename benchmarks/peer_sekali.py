"""The sekali side of ``sekali bench --only peers``: sekali as it is deployed, through Dagster's
real launcher, with resident workers as the path of every request.

Two deployments, each started the way a user starts it and left alone while it is measured:

- :class:`DevDeployment` (system ``sekali``): ``sekali dev --no-sandbox`` on its embedded
  defaults (SQLite app store and Dagster storage, the embedded Redis on a socket), the README's
  first command; ``--no-sandbox`` only because the run's one mail sink plays the mail provider
  for every system (``SEKALI_SMTP_HOST``/``PORT``, its record as ``SEKALI_SMTP_LOG_URL``).
- :class:`ProductionDeployment` (system ``sekali_postgres``): the production profile
  (``deploy/production/dagster.yaml``: dagster-postgres, the queued run coordinator with
  threads, run monitoring and retries) on a PostgreSQL cluster of the run's own, a gRPC code
  server (``dagster api grpc``) and ``dagster-daemon run``, as a process supervisor would run
  them; sekali's app store in another database of that cluster, Redis the run's own server.

In both, the workers' supervisor sensor keeps ``SEKALI_WORKERS`` resident worker runs alive
(``light=WORKERS,heavy=0``: the same number of worker processes as each peer has); every run
is a process the code server launches (``dagster api execute_run``), exactly as deployed.
Nothing of sekali runs in the benchmark's process but :func:`engine.intake.enqueue`, which a
producer calls (with its wake-up to the workers).

What a deployment offers the benchmark: its app database, its worker runs' processes (to
SIGKILL), its daemon (SIGKILL, then started again as a supervisor would: production only; a
killed daemon ends ``sekali dev`` as a whole, by ``dagster dev``'s design), the CPU of its whole
process tree, and the rows (and on Postgres the statements) written to Dagster's storage.
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
from sqlalchemy import create_engine, text

from engine.intake import enqueue
from resources.storage.db import Database
from resources.storage.migrations import upgrade

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
START_TIMEOUT = 900.0
"""A deployment's start on this loaded 2-core machine: the UI (dev), the code server, the
daemon and every worker run importing Dagster and the definitions."""
CLEARED_ENV = ("REDIS_URL", "DATABASE_URL", "DAGSTER_PG_URL", "DAGSTER_HOME",
               "SEKALI_STATE_DIR", "SEKALI_INTAKE_MODE", "SEKALI_INTAKE_MODES", "SEKALI_WORKERS",
               "SEKALI_WAKEUP", "SEKALI_WAKEUP_NAMESPACE")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(predicate: Callable[[], bool], timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(step)
    return True


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _stop(proc: subprocess.Popen[Any], timeout: float = 30.0) -> None:
    """SIGTERM to the process group, SIGKILL to it after ``timeout``."""
    if proc.poll() is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


class Deployment:
    """A running sekali deployment (see the module docstring)."""

    name = ""
    dialect = ""

    def __init__(self, root: Path, smtp_port: int, sink_url: str, workers: int,
                 extra_env: dict[str, str] | None = None) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        base = {k: v for k, v in os.environ.items() if k not in CLEARED_ENV}
        self.env: dict[str, str] = {
            **base, "SEKALI_SMTP_HOST": "127.0.0.1", "SEKALI_SMTP_PORT": str(smtp_port),
            "SEKALI_SMTP_LOG_URL": sink_url, "SEKALI_WORKERS": f"light={workers},heavy=0",
            **(extra_env or {}),
        }
        self.workers = workers
        self.procs: list[subprocess.Popen[Any]] = []
        self.daemon: subprocess.Popen[Any] | None = None
        self._db: Database | None = None
        self.daemon_restarts = 0

    # -- what a subclass provides -------------------------------------------------------------

    def client_env(self) -> dict[str, str]:
        """What a producer of this deployment has in its environment (the enqueue reads the
        app database and the wake-ups' Redis from it)."""
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    def daemon_pid(self) -> int | None:
        return None

    def kill_daemon(self) -> int | None:
        """SIGKILL the Dagster daemon and start it again; the pid killed (None: not offered)."""
        return None

    def dagster_rows(self) -> dict[str, int]:
        raise NotImplementedError

    def run_status(self, run_id: str) -> str | None:
        """The Dagster run's status as its storage has it (``STARTED``, ``FAILURE``, ...)."""
        raise NotImplementedError

    # -- shared --------------------------------------------------------------------------------

    @property
    def db(self) -> Database:
        if self._db is None:
            with self.active():
                self._db = Database.from_url(self.database_url())
        return self._db

    def database_url(self) -> str:
        return self.client_env()["DATABASE_URL"]

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """This process's environment as a producer of this deployment's, then restored."""
        saved = {k: os.environ.get(k) for k in (*CLEARED_ENV, *self.client_env())}
        for k in CLEARED_ENV:
            os.environ.pop(k, None)
        os.environ.update(self.client_env())
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def enqueue_many(self, job_type: str, items: list[dict[str, Any]]) -> list[int]:
        """Enqueue ``items`` in one transaction (visible to the workers at once, one wake-up at
        the commit); their request ids."""
        with self.active(), self.db.transaction() as conn:
            return [enqueue(job_type, item, conn=conn).id for item in items]

    def enqueue_one(self, job_type: str, item: dict[str, Any]) -> int:
        with self.active():
            return enqueue(job_type, item, db=self.db).id

    def tree(self) -> list[psutil.Process]:
        out: list[psutil.Process] = []
        for proc in self.procs:
            with contextlib.suppress(psutil.Error):
                top = psutil.Process(proc.pid)
                out += [top, *top.children(recursive=True)]
        return out

    def worker_pids(self) -> list[int]:
        """The run workers' processes: the code server starts each run as a process of its own
        (``multiprocessing`` spawn); with every job type resident, those are the worker runs."""
        return [p.pid for p in self.tree()
                if "spawn_main" in (cmd := _cmdline(p.pid)) and "resource_tracker" not in cmd]

    def cpu_seconds(self) -> float:
        """CPU used by the deployment's processes so far: each live process's own time plus
        that of its ended children (a run's process, once reaped), so nothing is counted twice
        and an ended run worker's CPU stays counted (its parent reaped it)."""
        total = 0.0
        for proc in self.tree():
            with contextlib.suppress(psutil.Error):
                t = proc.cpu_times()
                total += t.user + t.system + t.children_user + t.children_system
        return total

    def statements(self) -> dict[str, int] | None:
        """Statements executed on the app and Dagster databases (Postgres only)."""
        return None

    def backlog(self) -> int:
        """Requests not yet in a final state."""
        with self.db.statement() as conn:
            return int(conn.execute(text(
                "SELECT count(*) FROM job_requests WHERE status NOT IN "
                "('completed', 'failed', 'cancelled', 'coalesced')")).scalar_one())

    def ready(self) -> bool:
        return len(self.worker_pids()) >= self.workers

    def stop(self) -> None:
        """Stop every process it started (once: a second call finds none)."""
        for proc in reversed(self.procs):
            _stop(proc)
        self.procs = []
        self.daemon = None
        if self._db is not None:
            self._db.dispose()
            self._db = None

    def _spawn(self, argv: list[str], log: str, env: dict[str, str] | None = None
               ) -> subprocess.Popen[Any]:
        with (self.root / log).open("ab") as out:
            proc = subprocess.Popen(argv, env=env or self.env, cwd=ROOT, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    def _wait_ready(self, what: str, predicate: Callable[[], bool]) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while not predicate():
            dead = [p for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "; ".join(f"{p.name}: {p.read_text()[-1500:]}"
                                 for p in sorted(self.root.glob("*.log")))
                raise RuntimeError(f"{self.name}: {what} did not come up ({logs})")
            time.sleep(1.0)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:  # nosec B310: our own UI on loopback
            return int(r.status) == 200
    except OSError:
        return False


class DevDeployment(Deployment):
    """``sekali dev --no-sandbox`` on SQLite (module docstring)."""

    name = "sekali"
    dialect = "sqlite"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.state = self.root / "state"
        self.port = free_port()
        self.env.update(SEKALI_STATE_DIR=str(self.state),
                        DAGSTER_HOME=str(self.state / "dagster_home"))

    def client_env(self) -> dict[str, str]:
        return {"SEKALI_STATE_DIR": str(self.state),
                "DAGSTER_HOME": str(self.state / "dagster_home"),
                "DATABASE_URL": f"sqlite:///{self.state / 'app.db'}",
                "REDIS_URL": f"unix://{self.state / 'redis' / 'redis.sock'}"}

    def start(self) -> None:
        self._spawn([str(BIN / "sekali"), "dev", "--no-sandbox", "--port", str(self.port)],
                    "dev.log")
        self._wait_ready("the Dagster UI",
                         lambda: _answers(f"http://127.0.0.1:{self.port}/server_info"))
        self._wait_ready(f"{self.workers} resident worker runs", self.ready)

    def dagster_rows(self) -> dict[str, int]:
        """Rows in the SQLite Dagster storage: every run's event log (``history/runs/<run>.db``)
        and the index beside them (``index.db``, which repeats some events), and the runs."""
        history = self.state / "dagster_home" / "history"
        events = sum(_sqlite_count(path, "event_logs")
                     for path in glob.glob(str(history / "runs" / "*.db")))
        return {"event_rows": events, "runs": _sqlite_count(str(history / "runs.db"), "runs")}

    def run_status(self, run_id: str) -> str | None:
        path = self.state / "dagster_home" / "history" / "runs.db"
        status = _sqlite_one(str(path), "SELECT status FROM runs WHERE run_id = ?", run_id)
        return None if status is None else str(status)


def _sqlite_one(path: str, sql: str, *params: Any) -> Any:
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
    except sqlite3.Error:
        return None
    try:
        row = conn.execute(sql, params).fetchone()
        return None if row is None else row[0]
    except sqlite3.Error:
        return None
    finally:
        conn.close()


def _sqlite_count(path: str, table: str) -> int:
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
    except sqlite3.Error:
        return 0
    try:
        return int(conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0])  # nosec B608: a constant table name
    except sqlite3.Error:
        return 0
    finally:
        conn.close()


class ProductionDeployment(Deployment):
    """The production profile on Postgres (module docstring). ``admin_url``: a superuser URL
    of the cluster (SQLAlchemy, psycopg 3) on which the databases ``app`` and ``dagster``
    were made for the run; ``redis_url`` the run's Redis."""

    name = "sekali_postgres"
    dialect = "postgresql"

    def __init__(self, root: Path, smtp_port: int, sink_url: str, workers: int, *,
                 app_url: str, dagster_url: str, admin_url: str, redis_url: str,
                 extra_env: dict[str, str] | None = None) -> None:
        super().__init__(root, smtp_port, sink_url, workers, extra_env)
        self.app_url, self.dagster_url, self.admin_url = app_url, dagster_url, admin_url
        self.redis_url = redis_url
        self.home = self.root / "dagster_home"
        self.grpc_port = free_port()
        self.env.update(
            DAGSTER_HOME=str(self.home), DATABASE_URL=app_url, REDIS_URL=redis_url,
            DAGSTER_PG_URL=dagster_url.replace("postgresql+psycopg://", "postgresql+psycopg2://"),
        )
        self._admin = create_engine(admin_url, isolation_level="AUTOCOMMIT", pool_size=1)
        self._dagster = create_engine(dagster_url, pool_size=1)

    def client_env(self) -> dict[str, str]:
        return {"DATABASE_URL": self.app_url, "REDIS_URL": self.redis_url,
                "DAGSTER_HOME": str(self.home)}

    def start(self) -> None:
        db = Database.from_url(self.app_url)
        try:
            upgrade(db)
        finally:
            db.dispose()
        subprocess.run([sys.executable, "-m", "pipelines.instance", str(self.home),
                        "--profile", "production"], env=self.env, cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL, timeout=600)
        workspace = self.root / "workspace.yaml"
        workspace.write_text(
            "load_from:\n  - grpc_server:\n      host: 127.0.0.1\n"
            f"      port: {self.grpc_port}\n      location_name: sekali\n")
        self._spawn([str(BIN / "dagster"), "api", "grpc", "-m", "pipelines.definitions",
                     "-h", "127.0.0.1", "-p", str(self.grpc_port), "--location-name", "sekali",
                     "--use-python-environment-entry-point"], "code_server.log")
        self._wait_ready("the code server", self._grpc_open)
        self.daemon = self._start_daemon()
        self._wait_ready(f"{self.workers} resident worker runs", self.ready)

    def _grpc_open(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.grpc_port), timeout=1).close()
            return True
        except OSError:
            return False

    def _start_daemon(self) -> subprocess.Popen[Any]:
        return self._spawn([str(BIN / "dagster-daemon"), "run", "-w",
                            str(self.root / "workspace.yaml")], "daemon.log")

    def daemon_pid(self) -> int | None:
        return None if self.daemon is None or self.daemon.poll() is not None else self.daemon.pid

    def kill_daemon(self) -> int | None:
        """SIGKILL the daemon's process (its in-flight sensor ticks die with it; the worker
        runs live under the code server and go on) and start a new one at once, as systemd's
        ``Restart=always`` would."""
        pid = self.daemon_pid()
        if pid is None or self.daemon is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        self.daemon.wait(10)
        self.procs.remove(self.daemon)
        self.daemon = self._start_daemon()
        self.daemon_restarts += 1
        return pid

    def _dagster_one(self, sql: str, **params: Any) -> Any:
        with self._dagster.connect() as conn:
            return conn.execute(text(sql), params).scalar()

    def dagster_rows(self) -> dict[str, int]:
        return {"event_rows": int(self._dagster_one("SELECT count(*) FROM event_logs")),
                "runs": int(self._dagster_one("SELECT count(*) FROM runs"))}

    def run_status(self, run_id: str) -> str | None:
        status = self._dagster_one("SELECT status FROM runs WHERE run_id = :id", id=run_id)
        return None if status is None else str(status)

    def statements(self) -> dict[str, int] | None:
        """``pg_stat_statements`` calls and ``pg_stat_database`` commits of the app and Dagster
        databases (the benchmark's own enqueues and polls of the app database are counted in:
        a producer's statements are part of a job's cost; its reads of Dagster's are a few
        per snapshot)."""
        app = self.app_url.rsplit("/", 1)[1]
        dag = self.dagster_url.rsplit("/", 1)[1]
        out: dict[str, int] = {}
        with self._admin.connect() as conn:
            with contextlib.suppress(Exception):
                for datname, calls in conn.execute(text(
                        "SELECT d.datname, sum(s.calls) FROM pg_stat_statements s JOIN pg_database"
                        " d ON d.oid = s.dbid WHERE d.datname IN (:a, :d) GROUP BY d.datname"),
                        {"a": app, "d": dag}).all():
                    out[f"{'app' if datname == app else 'dagster'}_statements"] = int(calls)
            for datname, commits in conn.execute(text(
                    "SELECT datname, xact_commit FROM pg_stat_database WHERE datname IN (:a, :d)"),
                    {"a": app, "d": dag}).all():
                out[f"{'app' if datname == app else 'dagster'}_commits"] = int(commits)
        return out

    def stop(self) -> None:
        super().stop()
        self._admin.dispose()
        self._dagster.dispose()
