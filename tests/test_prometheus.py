"""The Prometheus side of the metrics: the rules in deploy/prometheus pass promtool and its unit
tests, every alert is tested firing and silent, every metric they name is one the exporter
really emits, and a real Prometheus scraping ``sekali metrics serve`` sees a workload's numbers,
computes the recording rules and raises the alert they lead to."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from prometheus_client.parser import text_string_to_metric_families

from engine.health.diagnosis import CHECKS
from engine.health.metrics import MetricsSnapshot
from resources.cache.core import StampedeCache
from resources.dlq import DlqStore, FailureClass, FailureInfo
from resources.errors import TransientJobError
from resources.locks import RedisLockStats
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from sandbox.redis_server import free_port
from tests.conftest import IN_CI
from tests.metrics_support import FakeClock, World
from tests.test_metrics import collector_for, scripted_workload

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy" / "prometheus"
RULES = DEPLOY / "rules.yml"
HTTP_TIMEOUT = 5.0

Labels = tuple[tuple[str, str], ...]


def need_tool(name: str) -> str:
    """The tool's path; without it a laptop skips and CI fails (.ci/run installs it)."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} not installed (Debian package prometheus)"
        if IN_CI:
            pytest.fail(message + "; CI must provide it")
        pytest.skip(message)
    return path


def alert_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def run_promtool(*args: str) -> str:
    result = subprocess.run(
        [need_tool("promtool"), *args], cwd=DEPLOY, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def test_promtool_checks_config_and_rules() -> None:
    """Catches a rule or scrape config Prometheus would refuse to load."""
    rules = sum(len(g["rules"]) for g in yaml.safe_load(RULES.read_text())["groups"])
    assert f"SUCCESS: {rules} rules found" in run_promtool("check", "rules", "rules.yml")
    assert "SUCCESS" in run_promtool("check", "config", "prometheus.yml")


def test_promtool_unit_tests_pass() -> None:
    """Catches an alert that no longer fires on the series it must, or fires on ones it must
    not: tests.yml evaluates every rule over synthetic series."""
    assert "SUCCESS" in run_promtool("test", "rules", "tests.yml")


def test_every_alert_has_a_firing_and_a_silent_case() -> None:
    """Catches a new alert added without unit tests, or tested only one way."""
    tests = yaml.safe_load((DEPLOY / "tests.yml").read_text())["tests"]
    firing: set[str] = set()
    silent: set[str] = set()
    for group in tests:
        for case in group.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else silent).add(case["alertname"])
    names = {rule["alert"] for rule in alert_rules()}
    assert len(names) >= 12
    assert names - firing == set(), "alerts never tested firing"
    assert names - silent == set(), "alerts never tested silent"


def test_every_alert_names_a_doctor_check_and_says_what_to_check() -> None:
    """Catches a description pointing at a checklist item that does not exist (renamed)."""
    checks = {check.name for check in CHECKS}
    for rule in alert_rules():
        description = rule["annotations"]["description"]
        named = re.findall(r"sekali doctor --check\s+(\w+)", description)
        assert named, f"{rule['alert']}: no `sekali doctor --check NAME` in its description"
        assert set(named) <= checks, (rule["alert"], named)
        assert rule["annotations"]["summary"]
        assert rule["labels"]["severity"] in ("warning", "critical")


def emitted_names(text: str) -> set[str]:
    return {family.name for family in text_string_to_metric_families(text)}


def test_rules_use_only_metrics_the_exporter_emits(
    sqlite_url: str, redis_client: redis.Redis, namespace: str
) -> None:
    """Every ``sekali_*`` name in rules.yml appears in a real scrape of a workload that touches
    every source; catches a rule written against a name the exporter never had (or lost)."""
    from cli.commands.metrics import MetricsServer

    db = Database.from_url(sqlite_url)
    upgrade(db)
    clock = FakeClock(time.time() - 1800)
    expected = scripted_workload(db, clock, redis_client, namespace)
    locks_key = f"{namespace}:lockstats"
    stats = RedisLockStats(redis_client, key=locks_key)
    stats.record("lost", "order:1")
    stats.flush()
    collector = collector_for(db, clock, expected["cache_obj"], locks_key, redis_client)
    server = MetricsServer(collector, min_interval=0.0, lease_seconds=60.0).start()
    try:
        with urllib.request.urlopen(server.url, timeout=HTTP_TIMEOUT) as response:
            names = emitted_names(response.read().decode())
    finally:
        server.stop()
        db.dispose()
    used = set()
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            used |= set(re.findall(r"(?<![\w:])sekali_[a-z0-9_]+", rule["expr"]))
    assert len(used) >= 15
    assert used - names == set(), f"rules use names the exporter does not emit: {used - names}"


def test_failing_snapshot_answers_503_and_keeps_serving(sqlite_url: str) -> None:
    """A scrape whose snapshot cannot be computed fails (so Prometheus's ``up`` turns 0) and
    the next scrape, once the source is back, succeeds."""
    from cli.commands.metrics import MetricsServer

    calls: list[int] = []

    class FlakySource:
        def collect(self) -> MetricsSnapshot:
            calls.append(1)
            if len(calls) == 1:
                raise ConnectionError("database down")
            snap = MetricsSnapshot(taken_at=time.time(), window_seconds=3600)
            snap.add("sekali_jobs_executed", 7, "completed attempts in the window")
            return snap

    server = MetricsServer(FlakySource(), min_interval=0.0).start()
    try:
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(server.url, timeout=HTTP_TIMEOUT)
        assert info.value.code == 503
        with urllib.request.urlopen(server.url, timeout=HTTP_TIMEOUT) as response:
            body = response.read().decode()
        assert "sekali_jobs_executed 7.0" in body
    finally:
        server.stop()


# -- a real Prometheus -----------------------------------------------------------------------


class Prometheus:
    """A Prometheus process on a private port and data directory, scraping one target."""

    def __init__(self, workdir: Path, target: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
        config["global"].update(
            scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s"
        )
        config["rule_files"] = [str(RULES)]
        [job] = config["scrape_configs"]
        job["static_configs"] = [{"targets": [target]}]
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = (workdir / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [
                need_tool("prometheus"),
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        self.logfile = workdir / "prometheus.log"

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base}/-/ready", timeout=HTTP_TIMEOUT) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, ConnectionError):
            return False

    def query(self, expr: str) -> dict[Labels, float]:
        """Instant query through /api/v1/query: ``{sorted labels without __name__: value}``."""
        url = f"{self.base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return {
            tuple(sorted((k, v) for k, v in item["metric"].items() if k != "__name__")):
                float(item["value"][1])
            for item in body["data"]["result"]
        }

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()


def wait_until(
    what: str, probe: Callable[[], Any], ok: Callable[[Any], bool], *, timeout: float,
    alive: Callable[[], str | None],
) -> Any:
    """Poll ``probe`` until ``ok``; fail with the last value when the deadline passes or a
    process the test started has died (``alive`` returns why)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = probe()
            if ok(last):
                return last
        except (urllib.error.URLError, ConnectionError) as exc:
            last = exc
        dead = alive()
        if dead is not None:
            pytest.fail(f"waiting for {what}: {dead}")
        if time.monotonic() > deadline:
            pytest.fail(f"waiting for {what}: still {last!r} after {timeout:g}s")
        time.sleep(0.25)


def close_to(want: float, got: float | None) -> bool:
    return got is not None and abs(got - want) < 1e-9


@pytest.fixture
def exporter(db_url: str, redis_url: str, namespace: str, tmp_path: Path) -> Iterator[str]:
    """``sekali metrics serve`` as a subprocess on a free port over a migrated test database;
    yields its ``host:port``."""
    db = Database.from_url(db_url)
    upgrade(db)
    db.dispose()
    port = free_port()
    env = {**os.environ, "DATABASE_URL": db_url, "REDIS_URL": redis_url,
           "SEKALI_STATE_DIR": str(tmp_path / "state")}
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "metrics", "serve", "--port", str(port),
         "--cache-namespace", namespace, "--lease-seconds", "45"],
        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
    )
    try:
        yield f"127.0.0.1:{port}"
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


@pytest.mark.slow
@pytest.mark.redis
def test_real_prometheus_scrapes_the_workload(
    exporter: str, db_url: str, redis_client: redis.Redis, namespace: str, tmp_path: Path
) -> None:
    """A Prometheus started here scrapes ``sekali metrics serve`` every second while attempts,
    dead letters and cache reads are written; its query API returns each number, the
    recording rule turns the window count into a rate, and the DLQ inflow alert goes pending."""
    prom = Prometheus(tmp_path / "prometheus", exporter)

    def alive() -> str | None:
        if prom.proc.poll() is not None:
            return f"prometheus exited: {prom.logfile.read_text()[-2000:]}"
        return None

    def value(expr: str) -> Callable[[], float | None]:
        def probe() -> float | None:
            result = prom.query(expr)
            return next(iter(result.values())) if len(result) == 1 else None
        return probe

    try:
        wait_until("prometheus ready", prom.ready, bool, timeout=60, alive=alive)
        # before the workload: the target is up and reports an empty window
        wait_until("the first scrape", value('up{job="sekali"}'), lambda v: v == 1.0,
                   timeout=90, alive=alive)
        wait_until("an empty window", value("sekali_jobs_executed"), lambda v: v == 0.0,
                   timeout=30, alive=alive)

        db = Database.from_url(db_url)
        world = World(db, FakeClock(time.time() - 120))
        for i in range(3):
            world.run("send_email", f"email:e2e:{i}", duration=0.2, correlation_id=f"c{i}")
        world.run("send_email", "email:e2e:0")  # a redelivery, answered from the store
        for i in range(2):
            world.run("charge_payment", f"payment:e2e:{i}",
                      fail_with=TransientJobError("gateway 503"))
        dlq = DlqStore(db)
        for i in range(12):
            dlq.record_failure(FailureInfo(
                job_type="charge_payment", dedupe_key=f"dlq:e2e:{i}",
                error_type="GatewayRejected", message="declined", run_id=f"run{i}",
                error_class=FailureClass.PERMANENT, failed_at=time.time(),
            ))
        cache = StampedeCache(redis_client, namespace=namespace)
        for _ in range(2):
            for k in range(3):
                cache.get_or_load(f"report:{k}", functools.partial(dict, k=k), ttl=3600)
        cache.recorder.flush()
        db.dispose()

        expected = {
            "sekali_jobs_executed": 3.0,
            'sekali_attempts{job_type="send_email", outcome="duplicate_suppressed"}': 1.0,
            'sekali_retries{reason="TransientJobError"}': 2.0,
            'sekali_dlq_inflow{error_class="permanent"}': 12.0,
            "sekali_dlq_open_total": 12.0,
            f'sekali_cache_rebuilds{{pattern="{namespace}/report:*"}}': 3.0,
            f'sekali_cache_reads{{pattern="{namespace}/report:*", result="hit"}}': 3.0,
            "sekali_lease_seconds": 45.0,
            "sekali_metrics_missing_sources": 0.0,
            # recording rule: 12 records in the 1 h window is 12 an hour
            'sekali:dlq_inflow_per_hour:by_class{error_class="permanent"}': 12.0,
            'sekali:retries_per_attempt:ratio': 2.0 / 6.0,
            # 12 an hour is over the threshold: pending until held for 10 minutes
            'ALERTS{alertname="SekaliDlqInflow", alertstate="pending",'
            ' error_class="permanent"}': 1.0,
        }
        for expr, want in expected.items():
            wait_until(expr, value(expr), functools.partial(close_to, want), timeout=60,
                       alive=alive)
        labels = prom.query('sekali_processing_seconds{quantile="0.99"} >= 0')
        assert {dict(k)["job_type"] for k in labels} == {"send_email"}
        assert all(dict(k)["job"] == "sekali" and dict(k)["instance"] == exporter
                   for k in labels)
    finally:
        prom.stop()
    assert prom.proc.returncode is not None
