"""What runs on the hosts: configuration files rendered from ``deploy/cluster/``, the workspace
of the control host, and the probes ``status`` and ``up`` use (each bounded by a short timeout).

The probes run in the caller's namespace (the machine's root namespace reaches every host
through the bridge), so a partition between two hosts does not blind them.
"""

from __future__ import annotations

import base64
import glob
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import psycopg

from resources.storage.redis import redis_client
from resources.storage.settings import RedisTimeouts
from sandbox.hosts.network import ClusterError

ROOT = Path(__file__).resolve().parents[2]
DEPLOY_DIR = ROOT / "deploy" / "cluster"
PRODUCTION_INSTANCE = ROOT / "deploy" / "production" / "dagster.yaml"

PORTS = {
    "postgres": 5432,
    "redis": 6379,
    "webserver": 3000,  # the authenticating proxy (sekali ui-proxy) in front of the UI
    "webserver_inner": 3001,  # the writable webserver, on the control host's loopback only
    "webserver_readonly": 3002,  # dagster-webserver --read-only, for viewers
    "code_server": 4000,
    "gateway": 8765,
    "smtp": 8025,
}

REPOSITORY = "__repository__"
"""The one repository a ``Definitions`` object makes."""

SECONDARY_STOPPED_SENSORS = ("dlq_sweep_sensor", "dlq_replay_sensor", "outbox_publisher")
SECONDARY_STOPPED_SCHEDULES = (
    "cache_warming_schedule",
    "reconciliation_schedule",
    "metrics_schedule",
)
"""Instigators that must run once per deployment, not once per code location: they are stopped
on every worker location but the first. ``intake_sensor`` (competing consumers over
``job_requests``: each tick claims with ``FOR UPDATE SKIP LOCKED``) and ``dlq_sensor`` (a
run-failure sensor sees only the runs of its own location) keep running everywhere."""


def render(template: str, **values: object) -> str:
    """A file of ``deploy/cluster/`` with its ``{placeholders}`` filled in."""
    text = (DEPLOY_DIR / template).read_text()
    for key, value in values.items():
        text = text.replace("{" + key + "}", str(value))
    return text


def postgres_bin() -> Path:
    """The newest ``/usr/lib/postgresql/*/bin`` that has ``initdb`` and ``postgres``."""
    candidates = sorted(
        (Path(p) for p in glob.glob("/usr/lib/postgresql/*/bin") if Path(p, "initdb").exists()),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
    )
    if not candidates:
        raise ClusterError("no PostgreSQL server binaries in /usr/lib/postgresql/*/bin "
                           "(apt-get install postgresql)")
    return candidates[-1]


def workspace_yaml(locations: Sequence[tuple[str, str, int]]) -> str:
    """The control host's workspace: one ``grpc_server`` entry per worker host."""
    lines = ["# Written by `sekali cluster up`: one code location per worker host.", "load_from:"]
    for name, host, port in locations:
        lines += [
            "  - grpc_server:",
            f"      host: {host}",
            f"      port: {port}",
            f"      location_name: {name}",
        ]
    return "\n".join(lines) + "\n"


# -- probes ------------------------------------------------------------------------------------


def tcp_open(address: str, port: int, timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection((address, port), timeout=timeout):
            return True
    except OSError:
        return False


def postgres_ok(conninfo: str, timeout: float = 3.0) -> bool:
    try:
        with psycopg.connect(conninfo, connect_timeout=max(1, int(timeout))) as conn:
            conn.execute("SELECT 1")
        return True
    except psycopg.Error:
        return False


def redis_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        client = redis_client(url, timeouts=RedisTimeouts(socket=timeout, connect=timeout))
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # noqa: BLE001 - any failure means "not healthy"
        return False


def http_ok(url: str, timeout: float = 3.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # nosec B310: http URL of our own service
            return 200 <= int(response.status) < 300
    except (OSError, urllib.error.URLError, ValueError):
        return False


def smtp_ok(address: str, port: int, timeout: float = 3.0) -> bool:
    try:
        with socket.create_connection((address, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            return sock.recv(64).startswith(b"220")
    except OSError:
        return False


class GraphQL:
    """The Dagster webserver's GraphQL API (the one the UI uses), over plain HTTP."""

    def __init__(self, base_url: str, timeout: float = 15.0,
                 auth: tuple[str, str] | None = None) -> None:
        self.url = base_url.rstrip("/") + "/graphql"
        self.timeout = timeout
        self._auth = auth

    def __call__(self, query: str, variables: Mapping[str, Any] | None = None) -> Any:
        body = json.dumps({"query": query, "variables": dict(variables or {})}).encode()
        headers = {"Content-Type": "application/json"}
        if self._auth is not None:
            token = base64.b64encode(":".join(self._auth).encode()).decode()
            headers["Authorization"] = f"Basic {token}"
        request = urllib.request.Request(self.url, data=body, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:  # nosec B310: http URL of our own service
                payload = json.loads(response.read())
        except (OSError, urllib.error.URLError, ValueError) as exc:
            raise ClusterError(f"GraphQL at {self.url}: {exc}") from exc
        if payload.get("errors"):
            raise ClusterError(f"GraphQL at {self.url}: {payload['errors']}")
        return payload["data"]

    def locations(self) -> dict[str, str]:
        """Location name -> ``RepositoryLocation`` (loaded) or the error's type and message."""
        data = self(
            "{ workspaceOrError { __typename ... on Workspace { locationEntries { name "
            "locationOrLoadError { __typename ... on PythonError { message } } } } } }"
        )
        entries = data["workspaceOrError"].get("locationEntries") or []
        out = {}
        for entry in entries:
            loaded = entry["locationOrLoadError"] or {"__typename": "Loading"}
            out[entry["name"]] = loaded["__typename"] + (
                f": {loaded['message'][:200]}" if loaded.get("message") else ""
            )
        return out

    def daemons(self) -> dict[str, bool]:
        """Required daemon type -> healthy."""
        data = self(
            "{ instance { daemonHealth { allDaemonStatuses { daemonType required healthy } } } }"
        )
        statuses = data["instance"]["daemonHealth"]["allDaemonStatuses"]
        return {s["daemonType"]: bool(s["healthy"]) for s in statuses if s["required"]}

    def instigators(self, location: str) -> dict[str, tuple[str, str]]:
        """``sensor:NAME`` / ``schedule:NAME`` -> (state id, RUNNING | STOPPED) in ``location``."""
        data = self(
            """
            query Instigators($sel: RepositorySelector!) {
              sensorsOrError(repositorySelector: $sel) {
                ... on Sensors { results { name sensorState { id status } } }
              }
              schedulesOrError(repositorySelector: $sel) {
                ... on Schedules { results { name scheduleState { id status } } }
              }
            }
            """,
            {"sel": {"repositoryLocationName": location, "repositoryName": REPOSITORY}},
        )
        out: dict[str, tuple[str, str]] = {}
        for s in data["sensorsOrError"].get("results") or []:
            out[f"sensor:{s['name']}"] = (s["sensorState"]["id"], s["sensorState"]["status"])
        for s in data["schedulesOrError"].get("results") or []:
            out[f"schedule:{s['name']}"] = (s["scheduleState"]["id"], s["scheduleState"]["status"])
        return out

    def stop_instigator(self, kind: str, state_id: str) -> None:
        field = "stopSensor" if kind == "sensor" else "stopRunningSchedule"
        data = self(
            f"mutation Stop($id: String!) {{ {field}(id: $id) {{ __typename "
            "... on PythonError { message } } }",
            {"id": state_id},
        )
        result = data[field]
        if result.get("__typename") == "PythonError":
            raise ClusterError(f"{field}: {result.get('message')}")

    def launch_run(
        self,
        location: str,
        job: str,
        run_config: Mapping[str, Any],
        tags: Mapping[str, str] | None = None,
    ) -> str:
        """Launch ``job`` of ``location`` as the UI's Launchpad does (through the run queue);
        returns the run id."""
        data = self(
            """
            mutation Launch($params: ExecutionParams!) {
              launchRun(executionParams: $params) {
                __typename
                ... on LaunchRunSuccess { run { runId } }
                ... on PythonError { message }
                ... on RunConfigValidationInvalid { errors { message } }
                ... on InvalidSubsetError { message }
              }
            }
            """,
            {
                "params": {
                    "selector": {
                        "repositoryLocationName": location,
                        "repositoryName": REPOSITORY,
                        "jobName": job,
                    },
                    "runConfigData": dict(run_config),
                    "executionMetadata": {
                        "tags": [{"key": k, "value": v} for k, v in (tags or {}).items()]
                    },
                }
            },
        )
        result = data["launchRun"]
        if result["__typename"] != "LaunchRunSuccess":
            raise ClusterError(f"launchRun {job} on {location}: {result}")
        return str(result["run"]["runId"])

    def runs(self, run_ids: Sequence[str] | None = None, limit: int = 500) -> list[dict[str, Any]]:
        """Runs (newest first) with status, job, location and tags."""
        data = self(
            """
            query Runs($filter: RunsFilter, $limit: Int) {
              runsOrError(filter: $filter, limit: $limit) {
                ... on Runs {
                  results {
                    runId jobName status creationTime startTime endTime
                    repositoryOrigin { repositoryLocationName }
                    tags { key value }
                  }
                }
              }
            }
            """,
            {"filter": {"runIds": list(run_ids)} if run_ids else {}, "limit": limit},
        )
        results: list[dict[str, Any]] = data["runsOrError"].get("results") or []
        for run in results:
            origin = run.pop("repositoryOrigin") or {}
            run["location"] = origin.get("repositoryLocationName")
            run["tags"] = {t["key"]: t["value"] for t in run["tags"]}
        return results
