"""The chaos worker runs what ships: each delivery goes through the step entry the per-request
Dagster op calls, and takes no lock (nor any other Redis key family) that the op does not.

One payment through the real Dagster job (in process, the job's own resources) and one through
a real ``proof.chaos_worker`` process, against one private Redis watched with MONITOR: the key
families the worker touches must be among the op's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proof.chaos_worker import CONFIG_ENV, WorkerConfig
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from resources.storage.redis import redis_client
from resources.storage.settings import RedisTimeouts
from sandbox.gateway import GatewayServer
from sandbox.mailsink import MailSink
from sandbox.redis_server import RedisServer, free_port
from tests.job_workers import dagster_resources, run_job

KEYED = re.compile(r"^(EVALSHA|EVAL)$", re.I)


class Monitor:
    """Every key a Redis client names in a command, while it runs (MONITOR)."""

    def __init__(self, server: RedisServer) -> None:
        # the monitor waits for the next command: a Dagster run may not send one for a while
        self.client = redis_client(server.url, timeouts=RedisTimeouts(socket=120.0, connect=2.0))
        self.keys: list[str] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Monitor:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.client.ping()  # one more command, so the monitor loop wakes and sees the stop
        self._thread.join(10)

    def _run(self) -> None:
        with self.client.monitor() as m:
            self._ready.set()
            for event in m.listen():
                if self._stop.is_set():
                    return
                self.keys.extend(_keys_of(str(event.get("command", ""))))

    def families(self) -> set[str]:
        return {_family(k) for k in self.keys}


def _keys_of(command: str) -> list[str]:
    parts = command.split(" ")
    if not parts or not parts[0]:
        return []
    name = parts[0].upper()
    if KEYED.match(name) and len(parts) > 2:  # EVALSHA sha numkeys key...
        try:
            n = int(parts[2])
        except ValueError:
            return []
        return parts[3:3 + n]
    if name in {"PING", "INFO", "CLIENT", "SCRIPT", "HELLO", "SELECT", "CONFIG", "MONITOR",
                "TIME", "FUNCTION"}:
        return []
    return parts[1:2]


def _family(key: str) -> str:
    """A key without what names one request: ``sekali:lock:{chaos:charge_payment:o-1}`` ->
    ``sekali:lock``; ``sekali:budget:payment_gateway`` stays as it is."""
    parts = []
    for part in key.split(":"):
        if "{" in part or any(ch.isdigit() for ch in part):
            break
        parts.append(part)
    return ":".join(parts)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[dict[str, Any]]:
    redis = RedisServer(tmp_path / "redis", port=free_port()).start()
    gateway = GatewayServer(f"sqlite:///{tmp_path / 'gateway.db'}").start()
    sink = MailSink(f"sqlite:///{tmp_path / 'mail.db'}").start()
    url = f"sqlite:///{tmp_path / 'app.db'}"
    db = Database.from_url(url)
    upgrade(db)
    try:
        yield {"redis": redis, "gateway": gateway, "sink": sink, "db_url": url}
    finally:
        db.dispose()
        for part in (sink, gateway, redis):
            part.stop()


def _worker_delivers(world: dict[str, Any], payload: dict[str, Any]) -> dict[str, Any]:
    config = WorkerConfig(
        worker_id=0, database_url=world["db_url"], redis_url=world["redis"].url,
        gateway_url=world["gateway"].url, smtp_host=world["sink"].host,
        smtp_port=world["sink"].port, lease_seconds=30.0, naive=False,
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "proof.chaos_worker"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, CONFIG_ENV: config.to_json()},
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        assert json.loads(proc.stdout.readline())["t"] == "ready"
        msg = {"tok": "1.1", "req": 7, "request_id": 8, "job_type": "charge_payment",
               "payload": payload, "attempt": 0}
        proc.stdin.write(json.dumps(msg) + "\n")
        proc.stdin.flush()
        while True:
            line = json.loads(proc.stdout.readline())
            if line["t"] in ("done", "fail"):
                break
        proc.stdin.write(json.dumps({"t": "exit"}) + "\n")
        proc.stdin.flush()
        proc.wait(30)
        return dict(line)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(120)
def test_the_chaos_worker_takes_no_lock_the_op_does_not_take(world: dict[str, Any]) -> None:
    resources = dagster_resources(
        db_url=world["db_url"], redis_url=world["redis"].url, namespace="sekali",
        gateway_url=world["gateway"].url, smtp_port=world["sink"].port,
    )
    config = {"ops": {"charge_payment_op": {"config": {
        "payload": {"order_id": "op-1", "amount_cents": 1250, "currency": "EUR"}}}}}
    with Monitor(world["redis"]) as op_side:
        assert run_job("charge_payment", config, resources)
    with Monitor(world["redis"]) as worker_side:
        report = _worker_delivers(
            world, {"order_id": "worker-1", "amount_cents": 1250, "currency": "EUR"})
    assert report["t"] == "done" and report["status"] == "completed", report
    assert op_side.families(), "the op touched no Redis key: the monitor saw nothing"
    extra = worker_side.families() - op_side.families()
    assert not extra, (
        f"the chaos worker touched Redis key families the op does not: {sorted(extra)} "
        f"(op: {sorted(op_side.families())})"
    )
    assert not any(":lock" in f for f in worker_side.families())
    assert len(world["gateway"].charges()) == 2

