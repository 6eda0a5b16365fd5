"""A burst into a platform whose launcher fails for a minute: it degrades, it never dead-letters.

``sekali dev`` runs as a user runs it (its own state folder and ports, the real daemon, code
server and launcher, resident workers). Then:

1. a burst of ``send_email`` requests is enqueued (50,000; ``--quick`` 5,000), in transactions
   of 500 as a batch producer would;
2. right after the burst starts, the code server is frozen (SIGSTOP) for a minute and one
   resident worker run's process is killed: for that minute no run can be launched (the
   supervisor's sensor runs in the code server; a relaunch waits for it), so the dead worker is
   not replaced and its requests wait for their leases, while the living workers go on;
3. the code server is thawed; the supervisor relaunches the worker and gives back what the dead
   one held; the burst drains.

Reported: drain rate (requests completed per second from the burst's first enqueue to its last
completion; and its floor, the same burst drained with no fault, measured first in the same run:
the ratio is the headline ``overload_drain_ratio``), the oldest waiting request's age over the
run (its maximum), the peak resident memory of every process of the ``sekali dev`` tree (their
``VmHWM``: the intake's, the daemon's and each worker's high-water mark), and dead letters: the
target is 0 among the burst's requests (``overload_dead_letters``), all of which complete.

    .venv/bin/python -m benchmarks.overload [--quick] [--json]
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import text

from benchmarks.suite import module_main
from engine.intake import enqueue
from resources.storage.db import Database

SEKALI = str(Path(sys.executable).with_name("sekali"))
FREEZE_SECONDS = 60.0
BATCH = 500


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Dev:
    """A ``sekali dev`` of this run: its process, its state folder and its environment."""

    proc: subprocess.Popen[bytes]
    state: Path
    env: dict[str, str]
    log: Path

    @property
    def db(self) -> Database:
        return Database.from_url(f"sqlite:///{self.state / 'app.db'}")

    def tree(self) -> list[int]:
        """Every process below ``sekali dev``."""
        children: dict[int, list[int]] = {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    stat = Path(f"/proc/{entry.name}/stat").read_text()
                    children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(
                        int(entry.name))
        found, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            found.append(pid)
            todo.extend(children.get(pid, []))
        return found

    def workers(self) -> list[int]:
        """The resident worker runs' processes: spawned by the code server for each run."""
        return [pid for pid in self.processes(b"spawn_main")
                if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()]

    def code_server(self) -> int:
        """The gRPC code server that evaluates the sensors and launches every run."""
        (pid,) = self.processes(b"api grpc")
        return pid

    def processes(self, needle: bytes) -> list[int]:
        out = []
        for pid in self.tree():
            with contextlib.suppress(OSError):
                if needle in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" "):
                    out.append(pid)
        return out


@contextlib.contextmanager
def sekali_dev(root: Path) -> Iterator[Dev]:
    """``sekali dev`` on its embedded defaults under ``root``, free ports, ready; stopped after."""
    port = _free_port()
    state = root / "state"
    env = {k: v for k, v in os.environ.items()
           if k not in ("REDIS_URL", "DATABASE_URL", "DAGSTER_PG_URL", "SEKALI_INTAKE_MODE",
                        "SEKALI_INTAKE_MODES")}
    env.update(SEKALI_STATE_DIR=str(state), DAGSTER_HOME=str(state / "dagster_home"),
               SEKALI_GATEWAY_URL=f"http://127.0.0.1:{_free_port()}",
               SEKALI_SMTP_HOST="127.0.0.1", SEKALI_SMTP_PORT=str(_free_port()),
               SEKALI_WEBHOOKS_URL=f"http://127.0.0.1:{_free_port()}")
    log = root / "dev.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([SEKALI, "dev", "--port", str(port)], env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    dev = Dev(proc, state, env, log)
    try:
        deadline = time.monotonic() + 600
        while not _answers(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"sekali dev did not start: {log.read_text()[-2000:]}")
            time.sleep(1)
        while len(dev.workers()) < 3:  # the supervisor's workers are up
            if time.monotonic() > deadline:
                raise RuntimeError("sekali dev's resident workers did not start")
            time.sleep(1)
        yield dev
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=2) as r:  # nosec B310: our own UI on loopback
            return int(r.status) == 200
    except OSError:
        return False


def _burst(dev: Dev, n: int, tag: str) -> tuple[float, list[int]]:
    """Enqueue ``n`` mails in transactions of :data:`BATCH` (wake-ups after each commit);
    returns when the first was enqueued and the ids."""
    os.environ.update({k: dev.env[k] for k in ("SEKALI_STATE_DIR", "DAGSTER_HOME")})
    db = dev.db
    ids: list[int] = []
    started = time.time()
    for start in range(0, n, BATCH):
        with db.transaction() as conn:
            for i in range(start, min(n, start + BATCH)):
                ids.append(enqueue("send_email", {
                    "template": "welcome", "user_id": f"{tag}{i}", "date": "2026-12-06",
                    "to": f"{tag}{i}@example.com"}, conn=conn).id)
    db.dispose()
    return started, ids


def _watch(dev: Dev, ids: list[int], started: float, timeout: float) -> dict[str, Any]:
    """Until every request of ``ids`` ended: the oldest waiting age, sampled every second."""
    db = dev.db
    lo, hi = min(ids), max(ids)
    oldest = 0.0
    ended = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with db.statement() as conn:
            row = conn.execute(text(
                "SELECT COUNT(*), MIN(created_at) FROM job_requests WHERE id BETWEEN :lo AND :hi"
                " AND status NOT IN ('completed', 'failed', 'cancelled', 'coalesced')"),
                {"lo": lo, "hi": hi}).one()
        waiting, first = int(row[0]), row[1]
        if first is not None:
            oldest = max(oldest, time.time() - float(first))
        if not waiting:
            with db.statement() as conn:
                ended = float(conn.execute(text(
                    "SELECT MAX(updated_at) FROM job_requests WHERE id BETWEEN :lo AND :hi"),
                    {"lo": lo, "hi": hi}).scalar_one())
            break
        time.sleep(1.0)
    with db.statement() as conn:
        counts = dict(conn.execute(text(
            "SELECT status, COUNT(*) FROM job_requests WHERE id BETWEEN :lo AND :hi"
            " GROUP BY status"), {"lo": lo, "hi": hi}).all())
        dead = int(conn.execute(text(
            "SELECT COUNT(*) FROM dlq_records WHERE request_id BETWEEN :lo AND :hi"),
            {"lo": lo, "hi": hi}).scalar_one())
    db.dispose()
    seconds = (ended or time.time()) - started
    return {"requests": len(ids), "statuses": counts, "dead_letters": dead,
            "seconds": round(seconds, 1), "drained": ended is not None,
            "jobs_per_second": round(len(ids) / seconds, 1) if ended else None,
            "oldest_waiting_s": round(oldest, 1)}


def _peak_rss_mb(dev: Dev) -> dict[str, float]:
    """Each process's resident high-water mark (``VmHWM``), by what it is."""
    out: dict[str, float] = {}
    for pid in dev.tree():
        with contextlib.suppress(OSError):
            status = Path(f"/proc/{pid}/status").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            hwm = next(int(line.split()[1]) for line in status.splitlines()
                       if line.startswith("VmHWM:"))
            what = ("worker run" if "spawn_main" in cmd else "daemon" if "dagster-daemon" in cmd
                    or "_daemon" in cmd else "code server" if "api grpc" in cmd
                    or "code-server" in cmd
                    else "webserver" if "webserver" in cmd else "redis" if "redis" in cmd
                    else "sekali dev" if "sekali" in cmd else "other")
            name = f"{what} {pid}"
            out[name] = round(hwm / 1024, 1)
    return out


def run(quick: bool = False) -> dict[str, Any]:
    n = 5_000 if quick else 50_000
    freeze = 15.0 if quick else FREEZE_SECONDS
    out: dict[str, Any] = {"requests": n, "freeze_s": freeze, "summary": []}
    with tempfile.TemporaryDirectory(prefix="sekali-overload-") as tmp, \
            sekali_dev(Path(tmp)) as dev:
        started, ids = _burst(dev, n, "calm")
        out["calm"] = _watch(dev, ids, started, timeout=3600)
        code_server = dev.code_server()
        workers = dev.workers()
        started = time.time()
        os.kill(code_server, signal.SIGSTOP)
        thaw_at = time.monotonic() + freeze
        try:
            os.kill(workers[0], signal.SIGKILL)
            _, ids = _burst(dev, n, "burst")
            time.sleep(max(0.0, thaw_at - time.monotonic()))
        finally:
            os.kill(code_server, signal.SIGCONT)
        out["fault"] = _watch(dev, ids, started, timeout=3600)
        out["fault"]["killed_worker"] = workers[0]
        out["peak_rss_mb"] = _peak_rss_mb(dev)
    calm, fault = out["calm"], out["fault"]
    ratio = (round(fault["jobs_per_second"] / calm["jobs_per_second"], 3)
             if calm["jobs_per_second"] and fault["jobs_per_second"] else None)
    out["headline"] = {"overload_drain_ratio": ratio,
                       "overload_dead_letters": fault["dead_letters"],
                       "overload_oldest_waiting_s": fault["oldest_waiting_s"],
                       "overload_peak_rss_mb": max(out["peak_rss_mb"].values(), default=None)}
    out["summary"] += [
        {"metric": f"burst of {n} drained under a {freeze:.0f} s launcher freeze and a killed"
                   " worker, over the same burst with no fault", "value":
         fault["jobs_per_second"], "unit": "jobs/s", "baseline": calm["jobs_per_second"],
         "ratio": ratio, "target": None, "ok": None},
        {"metric": "dead letters among the burst's requests", "value": fault["dead_letters"],
         "unit": "records", "baseline": None, "ratio": None, "target": 0,
         "ok": fault["dead_letters"] == 0 and fault["drained"]},
    ]
    return out


def render(result: dict[str, Any]) -> None:
    for name in ("calm", "fault"):
        print(f"{name}: {result[name]}")
    for proc, mb in sorted(result["peak_rss_mb"].items(), key=lambda kv: -kv[1]):
        print(f"  peak RSS {mb:8.1f} MB  {proc}")
    print(result["headline"])


if __name__ == "__main__":
    sys.exit(module_main(__doc__, run, render))
