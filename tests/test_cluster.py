"""sekali on several hosts: ``sekali cluster up --workers 2``, runs on the worker hosts, ``down``.

One test walks the whole life of a cluster (building one costs tens of seconds, so the steps share
it): the CLI builds it, the UI answers from the machine, a run launched through the UI's GraphQL
API executes on the worker host of its location, requests enqueued on the store host's database
are launched by the intake sensors and run on both worker hosts, a partition drops packets
between two hosts and heals, and ``down`` leaves no namespace, link or process behind.

Needs root (namespaces, veth pairs, a bridge). Skips without it on a laptop, fails in CI.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import dagster as dg
import pytest
import redis

from engine.attempts import AttemptRecorder
from engine.intake import enqueue
from engine.requests import RequestStatus, RequestStore
from resources.storage.db import Database
from sandbox.hosts import Cluster
from sandbox.hosts.processes import start_time_of
from sandbox.hosts.services import PORTS, tcp_open
from tests.conftest import IN_CI

pytestmark = [pytest.mark.slow, pytest.mark.dagster, pytest.mark.timeout(330)]

BIN = Path(sys.executable).parent
T = TypeVar("T")
GRPC_INFO_TAG = ".dagster/grpc_info"  # set by DefaultRunLauncher: the code server it launched on


def wait_for(what: str, probe: Callable[[], T | None], timeout: float, cluster: Cluster) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(1.0)
    logs = sorted((cluster.state_dir / "logs").glob("*.log"))
    tails = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in logs)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{tails}")


def sekali(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "sekali"), *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


@pytest.fixture
def state_dir() -> Iterator[Path]:
    if os.geteuid() != 0:
        if IN_CI:
            pytest.fail("the cluster test needs root and CI runs as root")
        pytest.skip("sekali cluster needs root (network namespaces, veth pairs, a bridge)")
    # under /tmp, world-searchable: the private PostgreSQL runs as user postgres
    folder = Path(tempfile.mkdtemp(prefix="sekali-cluster-", dir="/tmp"))
    folder.chmod(0o755)
    try:
        yield folder / "cluster"
    finally:
        sekali("cluster", "down", "--state", str(folder / "cluster"), timeout=120)
        shutil.rmtree(folder, ignore_errors=True)


def email(user: str) -> dict[str, str]:
    return {"template": "welcome", "user_id": user, "date": "2026-11-30",
            "to": f"{user}@example.com"}


def run_status(cluster: Cluster, run_ids: list[str]) -> dict[str, dict[str, Any]] | None:
    runs = {r["runId"]: r for r in cluster.graphql().runs(run_ids)}
    failed = [r for r in runs.values() if r["status"] in ("FAILURE", "CANCELED")]
    assert not failed, f"runs ended badly: {failed}"
    if len(runs) == len(run_ids) and all(r["status"] == "SUCCESS" for r in runs.values()):
        return runs
    return None


def worker_hosts(cluster: Cluster) -> set[str]:
    """The addresses of the code servers that launched the resident worker runs in flight."""
    env = {"DAGSTER_HOME": str(cluster.dagster_home), "DAGSTER_PG_URL": cluster.dagster_pg_url}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with dg.DagsterInstance.get() as instance:
            records = instance.get_run_records(dg.RunsFilter(
                job_name="sekali_worker", statuses=[dg.DagsterRunStatus.STARTED]))
            return {json.loads(r.dagster_run.tags[GRPC_INFO_TAG])["host"] for r in records}
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def launcher_hosts(cluster: Cluster, run_ids: list[str]) -> dict[str, str]:
    """Run id -> the address of the code server that launched it (Dagster's own hidden tag)."""
    env = {"DAGSTER_HOME": str(cluster.dagster_home), "DAGSTER_PG_URL": cluster.dagster_pg_url}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with dg.DagsterInstance.get() as instance:
            records = instance.get_run_records(dg.RunsFilter(run_ids=run_ids))
            return {r.dagster_run.run_id: json.loads(r.dagster_run.tags[GRPC_INFO_TAG])["host"]
                    for r in records}
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def uids_of(pid: int) -> list[int] | None:
    """The real, effective, saved and filesystem uids of ``pid`` (None once it has ended)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    line = next(x for x in status.splitlines() if x.startswith("Uid:"))
    return [int(uid) for uid in line.split()[1:]]


def tcp_from(cluster: Cluster, host: str, address: str, port: int) -> str:
    """Connect from inside ``host``: 'open', or the error's name ('TimeoutError' when dropped)."""
    code = ("import socket\ns = socket.socket(); s.settimeout(2)\n"
            f"try:\n    s.connect(('{address}', {port})); print('open')\n"
            "except OSError as e:\n    print(type(e).__name__)\n")
    return cluster.exec_in(host, [sys.executable, "-c", code], timeout=20).stdout.strip()


def test_cluster_runs_jobs_on_worker_hosts_and_down_leaves_nothing(state_dir: Path) -> None:
    """Catches: a deployment whose runs execute on the control host (or nowhere), a worker
    location the UI cannot load, intake that does not spread over the worker hosts, a partition
    that refuses instead of dropping or does not heal, and a ``down`` that leaves a namespace,
    link or process behind."""
    started = time.monotonic()
    # --- up, through the CLI as a user would run it (at most two requests per intake tick so
    # both worker locations' intake sensors get some)
    up = sekali("cluster", "up", "--workers", "2", "--state", str(state_dir), "--json",
                "--env", "SEKALI_INTAKE_MAX_PER_TICK=2", "--timeout", "200", timeout=260)
    assert up.returncode == 0, up.stderr[-4000:]
    status = json.loads(up.stdout)
    assert status["healthy"], status
    cluster = Cluster(state_dir)
    workers = {w.name: w for w in cluster.workers}
    assert sorted(workers) == ["w1", "w2"]
    for host in status["hosts"]:
        assert all(p["alive"] for p in host["processes"]), host
        assert all(v == "ok" for v in host["health"].values()), host

    # --- every service runs as an unprivileged user and owns its folders, 0700; root only
    # built the namespaces (run workers and anything else in the hosts included)
    uids: dict[str, int] = {}
    for record in cluster.processes:
        seen = uids_of(record.pid)
        assert seen and min(seen) > 0, (record.host, record.name, seen)
        uids[f"{record.host}/{record.name}"] = seen[0]
    assert len(uids) == 10, uids  # postgres, redis, gateway, mailsink, 2 code servers, daemon,
    # the writable UI, the proxy in front of it, the read-only UI
    for h in cluster.hosts:
        for pid in cluster.pids(h.name):
            seen = uids_of(pid)
            assert seen is None or min(seen) > 0, (h.name, pid, seen)
    service_uid = uids["control/webserver"]
    assert {uid for name, uid in uids.items() if name != "store/postgres"} == {service_uid}
    owned = [state_dir / "control" / "dagster_home", state_dir / "store" / "redis",
             state_dir / "provider", *(state_dir / "hosts" / h.name for h in cluster.hosts)]
    for folder in owned:
        info = folder.stat()
        assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (service_uid, 0o700), folder
    pgdata = (state_dir / "store" / "pgdata").stat()
    assert (pgdata.st_uid, stat.S_IMODE(pgdata.st_mode)) == (uids["store/postgres"], 0o700)

    # --- the store Redis: CONFIG and DEBUG renamed for its clients, MODULE disabled
    store_redis = redis.Redis.from_url(cluster.redis_url, socket_timeout=5,
                                       socket_connect_timeout=2)
    try:
        for command in (("CONFIG", "SET", "dir", "/tmp"), ("CONFIG", "GET", "dir"),
                        ("MODULE", "LIST"), ("DEBUG", "SLEEP", "0")):
            with pytest.raises(redis.ResponseError, match="unknown command"):
                store_redis.execute_command(*command)
    finally:
        store_redis.close()
    assert cluster.redis_admin("CONFIG", "GET", "maxmemory-policy") == {
        b"maxmemory-policy": b"noeviction"}

    # --- no password in what up printed; services bind their host's address, not 0.0.0.0
    assert not [name for name, secret in cluster.state["secrets"].items() if secret in up.stdout]
    report = state_dir.parent / "status.json"
    assert sekali("cluster", "status", "--state", str(state_dir), "--out", str(report),
                  timeout=60).returncode == 0
    assert report.stat().st_mode & 0o777 == 0o600
    for host, port in (("w1", PORTS["code_server"]), ("control", PORTS["webserver"])):
        assert tcp_from(cluster, host, "127.0.0.1", port) != "open", host

    # --- the UI answers from the machine (root namespace -> bridge -> control host); its
    # writable API only with the login (the webserver itself listens on the host's loopback),
    # the read-only UI to anyone
    with urllib.request.urlopen(f"{cluster.ui_url}/server_info", timeout=10) as response:
        assert response.status == 200
    anonymous = urllib.request.Request(f"{cluster.ui_url}/graphql", data=b'{"query": "{ a }"}',
                                       headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(anonymous, timeout=10)  # nosec B310: the cluster's own UI
    assert refused.value.code == 401
    assert not tcp_open(cluster.host("control").address, PORTS["webserver_inner"])
    with urllib.request.urlopen(f"{cluster.ui_readonly_url}/server_info", timeout=10) as ok:
        assert ok.status == 200

    # --- a run launched from the UI's API runs on the worker host of its location
    db = Database.from_url(cluster.database_url)
    try:
        ui_run = cluster.graphql().launch_run(
            "sekali_w2", "send_email",
            {"ops": {"send_email_op": {"config": {"payload": email("ui-1")}}}},
            tags={"sekali/correlation_id": "cluster-ui"},
        )
        runs = wait_for("the UI-launched run", lambda: run_status(cluster, [ui_run]), 120,
                        cluster)
        assert runs[ui_run]["location"] == "sekali_w2"
        assert launcher_hosts(cluster, [ui_run]) == {ui_run: workers["w2"].address}
        attempts = AttemptRecorder(db).for_key("email:welcome:ui-1:2026-11-30")
        assert [a["host"] for a in attempts] == ["sekali-w2"], attempts  # from inside the op

        # --- each location's supervisor keeps resident workers on its own host
        wait_for("resident workers on every worker host",
                 lambda: worker_hosts(cluster) == {w.address for w in workers.values()} or None,
                 180, cluster)

        # --- requests enqueued on the store host's database: the workers claim them
        store = RequestStore(db)
        ids = [enqueue("send_email", email(f"intake-{i}"), db=db).id for i in range(6)]

        def all_completed() -> bool:
            return all(r.status == RequestStatus.COMPLETED for r in store.get_many(ids))

        wait_for("the enqueued requests to complete", all_completed, 150, cluster)
        requests = store.get_many(ids)
        hosts = {}
        for request in requests:
            (attempt,) = AttemptRecorder(db).for_key(request.key)  # one effect, one attempt
            hosts[request.id] = attempt["host"]
            assert attempt["outcome"] == "completed", attempt
        assert set(hosts.values()) <= {"sekali-w1", "sekali-w2"}, hosts
        recorder = AttemptRecorder(db)
        run_ids = sorted({a["run_id"] for r in requests for a in recorder.for_key(r.key)})
        placed = launcher_hosts(cluster, run_ids)  # the worker runs that served them
        assert set(placed.values()) <= {w.address for w in workers.values()}, placed
        assert {r.run_id for r in requests} == set(run_ids)  # each request names its worker
    finally:
        db.dispose()

    # --- a partition drops packets (a connect times out, it is not refused) and heals
    store_host = cluster.host("store")
    assert tcp_from(cluster, "w1", store_host.address, 5432) == "open"
    cluster.partition("w1", "store")
    assert tcp_from(cluster, "w1", store_host.address, 5432) == "TimeoutError"
    assert tcp_from(cluster, "w2", store_host.address, 5432) == "open"
    assert cluster.heal() == 1
    assert tcp_from(cluster, "w1", store_host.address, 5432) == "open"
    assert not any(cluster.partition_rules().values())

    # --- down leaves nothing: no namespace, no link, no process of the cluster
    pids = {pid: start_time_of(pid) for h in cluster.hosts for pid in cluster.pids(h.name)}
    assert pids, "the hosts should have processes before down"
    down = sekali("cluster", "down", "--state", str(state_dir), "--json", timeout=120)
    assert down.returncode == 0, down.stderr
    report = json.loads(down.stdout)
    assert set(report["leftovers"]) >= {"namespaces", "links", "processes", "cgroups"}, report
    assert not any(report["leftovers"].values()), report
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f"sekali-{cluster.cluster_id}-" not in netns
    assert f"sk{cluster.cluster_id}-" not in links
    survivors = [p for p, t in pids.items() if t is not None and start_time_of(p) == t]
    assert not survivors, "processes survived down (zombies waiting for init count as gone)"
    again = sekali("cluster", "down", "--state", str(state_dir), timeout=60)
    assert again.returncode == 0, again.stderr  # idempotent
    assert time.monotonic() - started < 300
