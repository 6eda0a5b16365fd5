"""End to end: a real ``dagster-webserver`` and ``dagster-daemon`` on a temporary instance.

A job is launched through the GraphQL API the UI uses; a request is enqueued from the CLI and the
intake sensor (default RUNNING) launches it through the QueuedRunCoordinator; both runs finish
and their history is read back through GraphQL. Downstreams are the sandbox gateway and mail
sink; the app database is a temporary SQLite file; Redis is the test Redis.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import dagster as dg
import pytest
from dagster_graphql import DagsterGraphQLClient

from engine.requests import RequestStatus, RequestStore
from pipelines.domain.mail import message_id_for
from pipelines.instance import prepare_dagster_home
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from sandbox.gateway import GatewayServer
from sandbox.mailsink import MailSink
from sandbox.redis_server import free_port

pytestmark = [pytest.mark.slow, pytest.mark.dagster, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
T = TypeVar("T")

RUNS_QUERY = """
query IntakeRuns($filter: RunsFilter) {
  runsOrError(filter: $filter) {
    __typename
    ... on Runs { results { runId jobName status tags { key value } } }
  }
}
"""


def wait_for(what: str, probe: Callable[[], T | None], timeout: float, logs: Path) -> T:
    """Poll ``probe`` until it returns something truthy; on timeout show the servers' logs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(1.0)
    tails = "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(logs.glob("*.log"))
    )
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{tails}")


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGINT by pid (works when started with Popen), then SIGKILL if it lingers."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


class Stack:
    def __init__(self, tmp: Path, redis_url: str) -> None:
        self.tmp = tmp
        self.logs = tmp / "logs"
        self.logs.mkdir()
        self.app_url = f"sqlite:///{tmp / 'app.db'}"
        self.gateway = GatewayServer(f"sqlite:///{tmp / 'gateway.db'}").start()
        self.sink = MailSink(f"sqlite:///{tmp / 'sink.db'}").start()
        self.port = free_port()
        self.home = prepare_dagster_home(tmp / "dagster_home", profile="embedded")
        self.env = {
            **os.environ,
            "DAGSTER_HOME": str(self.home),
            "DATABASE_URL": self.app_url,
            "REDIS_URL": redis_url,
            "SEKALI_GATEWAY_URL": self.gateway.url,
            "SEKALI_SMTP_PORT": str(self.sink.port),
            "SEKALI_INTAKE_MODE": "per_request",
            "SEKALI_STATE_DIR": str(tmp / "state"),
        }
        self.processes: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, *args: str) -> None:
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        self.processes.append(
            subprocess.Popen(
                [str(BIN / name), *args],
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )

    def client(self) -> DagsterGraphQLClient:
        return DagsterGraphQLClient("127.0.0.1", port_number=self.port, timeout=30)

    def graphql(self, query: str, variables: dict[str, Any]) -> Any:
        return self.client()._execute(query, variables)  # the UI's own API

    def close(self) -> None:
        for process in reversed(self.processes):
            stop(process)
        self.gateway.stop()
        self.sink.stop()


@pytest.fixture
def stack(tmp_path: Path, redis_url: str) -> Iterator[Stack]:
    s = Stack(tmp_path, redis_url)
    try:
        database = Database.from_url(s.app_url)
        upgrade(database)
        database.dispose()
        s.start("dagster-webserver", "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(s.port))
        s.start("dagster-daemon", "run", "-w", "workspace.yaml")
        yield s
    finally:
        s.close()


def _location_loaded(stack: Stack) -> bool:
    try:
        data = stack.graphql(
            "{ workspaceOrError { ... on Workspace { locationEntries { name "
            "locationOrLoadError { __typename } } } } }",
            {},
        )
    except Exception:  # noqa: BLE001 - not up yet
        return False
    entries = data["workspaceOrError"]["locationEntries"]
    return any(e["locationOrLoadError"]["__typename"] == "RepositoryLocation" for e in entries)


def _status(stack: Stack, run_id: str) -> dg.DagsterRunStatus | None:
    status = stack.client().get_run_status(run_id)
    if status in (dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED):
        raise AssertionError(f"run {run_id} ended {status}")
    return status if status == dg.DagsterRunStatus.SUCCESS else None


def test_ui_launch_and_cli_enqueue_run_through_the_daemon(stack: Stack) -> None:
    """Catches: a job the UI cannot launch, an intake sensor that is not running by default or
    emits runs the daemon cannot start, a request that never reaches ``completed``."""
    wait_for("the webserver and code location", lambda: _location_loaded(stack), 180, stack.logs)

    # 1. Launch from the UI's API: submit_job_execution goes through the run queue.
    ui_payload = {
        "template": "welcome",
        "user_id": "ui-1",
        "date": "2026-11-29",
        "to": "ui1@example.com",
    }
    run_id = stack.client().submit_job_execution(
        "send_email",
        run_config={"ops": {"send_email_op": {"config": {"payload": ui_payload}}}},
        tags={"sekali/correlation_id": "e2e-ui"},
    )

    # 2. Enqueue from the CLI; the sensor turns it into a run.
    payload = {
        "template": "receipt",
        "user_id": "cli-1",
        "date": "2026-11-29",
        "to": "cli1@example.com",
        "context": {"order_id": "o-42"},
    }
    cli = subprocess.run(
        [
            str(BIN / "sekali"),
            "enqueue",
            "send_email",
            "--payload",
            json.dumps(payload),
            "--correlation-id",
            "e2e-cli",
        ],
        env=stack.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    assert "key=email:receipt:cli-1:2026-11-29" in cli.stdout

    wait_for("the UI-launched run to succeed", lambda: _status(stack, run_id), 150, stack.logs)

    database = Database.from_url(stack.app_url)
    try:
        store = RequestStore(database)
        key = "email:receipt:cli-1:2026-11-29"
        wait_for(
            "the intake request to complete",
            lambda: (
                (r := store.get_by_key(key)) is not None and r.status is RequestStatus.COMPLETED
            ),
            180,
            stack.logs,
        )
        request = store.get_by_key(key)
        assert request is not None and request.run_key == f"intake:{key}"
    finally:
        database.dispose()

    # 3. Effects: one mail per intent, each with the Message-ID derived from its key.
    mails = [m["message_id"] for m in stack.sink.messages()]
    assert sorted(mails) == sorted(
        [message_id_for("email:welcome:ui-1:2026-11-29"), message_id_for(key)]
    )

    # 4. Run history, read back through GraphQL as the UI does. The op marks its request
    # completed inside the step, so the run itself may still be finishing: wait for it.
    def intake_runs_done() -> list[dict[str, object]] | None:
        data = stack.graphql(RUNS_QUERY, {"filter": {"pipelineName": "send_email"}})
        found = data["runsOrError"]["results"]
        mine = [r for r in found if {"key": "sekali/key", "value": key} in r["tags"]]
        return found if mine and all(r["status"] == "SUCCESS" for r in mine) else None

    runs = wait_for("the intake run to succeed", intake_runs_done, 120, stack.logs)
    by_id = {r["runId"]: r for r in runs}
    assert by_id[run_id]["status"] == "SUCCESS"
    intake_runs = [r for r in runs if {"key": "sekali/key", "value": key} in r["tags"]]
    assert len(intake_runs) == 1 and intake_runs[0]["status"] == "SUCCESS"
    tags = {t["key"]: t["value"] for t in intake_runs[0]["tags"]}
    assert tags["dagster/run_key"] == f"intake:{key}"
    assert tags["sekali/queue"] == "light" and tags["sekali/correlation_id"] == "e2e-cli"
    assert tags["dagster/sensor_name"] == "intake_sensor"
