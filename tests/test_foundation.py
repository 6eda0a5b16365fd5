"""The project stands up: definitions load and validate, import opens no socket, the production
instance works on Postgres, and the README's first command starts the platform."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from sandbox.redis_server import free_port
from tests.conftest import IN_CI, PG_URL, _postgres_error, need_server

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable

JOBS = {
    "charge_payment", "send_email", "reserve_inventory", "rebuild_report_cache", "fulfill_order"
}
SENSORS = {"intake_sensor", "dlq_sensor", "dlq_replay_sensor"}
SCHEDULES = {"cache_warming_schedule", "reconciliation_schedule"}


def test_every_job_sensor_and_schedule_exists_by_name() -> None:
    from pipelines.definitions import defs

    repo = defs.get_repository_def()
    assert {job.name for job in repo.get_all_jobs()} >= JOBS
    assert {s.name for s in repo.sensor_defs} >= SENSORS
    assert {s.name for s in repo.schedule_defs} >= SCHEDULES


@pytest.mark.dagster
def test_dagster_definitions_validate_passes(tmp_path: Path) -> None:
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path)}
    result = subprocess.run(
        [PYTHON, "-m", "dagster", "definitions", "validate", "-w", str(ROOT / "workspace.yaml")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_importing_definitions_opens_no_socket() -> None:
    """Servers are unreachable and every connect is recorded: import must not try any."""
    probe = textwrap.dedent(
        """
        import socket
        attempts = []
        def refuse(self, address, *a, **k):
            attempts.append(address)
            raise OSError("no sockets at import")
        socket.socket.connect = refuse
        socket.socket.connect_ex = refuse
        import pipelines.definitions as d
        d.defs.get_repository_def().get_all_jobs()
        assert not attempts, attempts
        print("no-socket-ok")
        """
    )
    env = {
        **os.environ,
        "DATABASE_URL": "postgresql+psycopg://nobody@127.0.0.1:1/none",
        "REDIS_URL": "redis://127.0.0.1:1/0",
        "SEKALI_GATEWAY_URL": "http://127.0.0.1:1",
    }
    result = subprocess.run(
        [PYTHON, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "no-socket-ok" in result.stdout, result.stderr[-3000:]


@pytest.mark.postgres
@pytest.mark.dagster
def test_production_instance_runs_a_job_on_postgres(tmp_path: Path) -> None:
    """The production dagster.yaml, as shipped, on a real Postgres: queues launched from a
    thread pool, monitoring, retries that skip op failures, and a job whose run and events land
    in Postgres."""
    error = _postgres_error()
    if error is not None:
        need_server("PostgreSQL", error)
    from dagster import DagsterInstance, job, op

    from pipelines.instance import prepare_dagster_home

    name = "sekali_dagster_" + uuid.uuid4().hex[:8]
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE DATABASE {name}"))
    base = PG_URL.rsplit("/", 1)[0].replace("postgresql+psycopg://", "postgresql+psycopg2://")
    os.environ["DAGSTER_PG_URL"] = f"{base}/{name}"
    try:
        home = prepare_dagster_home(tmp_path / "home", profile="production")
        instance = DagsterInstance.from_config(str(home))
        try:
            assert type(instance.run_storage).__name__ == "PostgresRunStorage"
            assert type(instance.event_log_storage).__name__ == "PostgresEventLogStorage"
            coordinator = instance.run_coordinator
            assert type(coordinator).__name__ == "QueuedRunCoordinator"
            limits = {(lim["key"], lim["value"]) for lim in coordinator.get_run_queue_config()
                      .tag_concurrency_limits}
            assert {("sekali/queue", "heavy"), ("sekali/queue", "light")} <= limits
            # runs are launched from a thread pool, not one after the other
            assert coordinator.dequeue_use_threads and coordinator.dequeue_num_workers == 4
            assert instance.run_monitoring_enabled
            assert instance.run_retries_enabled
            assert instance.get_settings("run_retries")["retry_on_asset_or_op_failure"] is False

            @op
            def hello() -> int:
                return 41 + 1

            @job(tags={"sekali/queue": "light"})
            def hello_job() -> None:
                hello()

            result = hello_job.execute_in_process(instance=instance)
            assert result.success and result.output_for_node("hello") == 42
            runs = instance.get_runs()
            assert [r.run_id for r in runs] == [result.run_id]
            assert runs[0].tags["sekali/queue"] == "light"
        finally:
            instance.dispose()
    finally:
        os.environ.pop("DAGSTER_PG_URL", None)
        with admin.connect() as conn:
            conn.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        admin.dispose()


@pytest.mark.slow
@pytest.mark.dagster
def test_sekali_dev_starts_the_platform_on_embedded_defaults(tmp_path: Path) -> None:
    """The README's first command: schema, embedded Redis on a socket, sandbox, Dagster UI."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL",
                                                            "DAGSTER_HOME")}
    env.update(
        SEKALI_STATE_DIR=str(tmp_path / "state"),
        SEKALI_GATEWAY_URL=f"http://127.0.0.1:{free_port()}",
        SEKALI_SMTP_PORT=str(free_port()),
        SEKALI_WEBHOOKS_URL=f"http://127.0.0.1:{free_port()}",
    )
    sekali = str(Path(PYTHON).parent / "sekali")
    proc = subprocess.Popen(
        [sekali, "dev", "--port", str(port)], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 150
        answered = False
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=2) as r:
                    answered = r.status == 200
                    break
            except OSError:
                time.sleep(1)
        assert answered, "Dagster UI did not answer on 127.0.0.1"
        state = tmp_path / "state"
        assert (state / "redis" / "redis.sock").exists()
        assert (state / "app.db").exists()
        assert (state / "dagster_home" / "dagster.yaml").exists()
        import redis as redis_py

        assert redis_py.Redis(unix_socket_path=str(state / "redis" / "redis.sock")).ping()
        token_file = state / "gateway-admin-token"
        assert token_file.stat().st_mode & 0o777 == 0o600
        admin = urllib.request.Request(
            env["SEKALI_GATEWAY_URL"] + "/_admin/charges",
            headers={"Authorization": f"Bearer {token_file.read_text().strip()}"})
        with urllib.request.urlopen(admin, timeout=5) as r:
            assert r.status == 200
        with urllib.request.urlopen(env["SEKALI_WEBHOOKS_URL"] + "/healthz", timeout=5) as r:
            assert r.status == 200
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            if IN_CI:
                raise
    import redis as redis_py

    with pytest.raises((redis_py.ConnectionError, OSError)):
        redis_py.Redis(unix_socket_path=str(tmp_path / "state" / "redis" / "redis.sock")).ping()
