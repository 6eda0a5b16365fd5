"""Fixed settings against adaptive ones, under a load that changes: ``sekali bench --only
adaptive``.

One job type (:mod:`benchmarks.adaptive_jobs`) whose work shifts mid-run from 50 ms to a heavy
tail (p99 4 s, the tail a stall of the whole process: the holder is alive and cannot renew its
lease), then a burst of 10x the arrivals, then the base rate again. The same plan runs twice,
each on a fresh database (Postgres when there is one, else SQLite) and the run's Redis:

- ``fixed``: what an operator sets from the fast phase: a 2 s lease (40x its 50 ms; heartbeat
  every third of it), 2 workers (``SEKALI_WORKERS=light=2``), ``SEKALI_ADAPTIVE=0``;
- ``adaptive``: the same declared 2 s lease until the duration model has its samples, then
  p99.9 x 3 between the type's bounds; workers sized by Little's law between 1 and 8
  (``light=1..8``).

What runs is what ships: requests enter through :func:`engine.intake.enqueue`; each worker is
an OS process running :class:`engine.worker.ResidentWorker` (:mod:`benchmarks.adaptive_worker`,
the class the ``sekali_worker`` op runs); every tick the count of worker processes follows
:func:`sensors.workers.sized_targets` (the supervisor sensor's own sizing, up at once, down
after the hold) and a dead worker's requests are given back with the ledger's lease, as the
sensor does. What stands in for Dagster is the launcher: the benchmark starts and stops the
worker processes itself instead of launching runs (a run is a process: the measured cost of
each start is the interpreter's, not Dagster's). One worker is SIGKILLed in the tail phase.

Reported per mode: takeovers of live holders (an attempt taking over a key whose previous
holder later recorded ``lease_lost``; counted after the adaptation window for the headline),
attempts thrown away (``lease_lost``), crash-loop and other dead letters, queue wait p99 of the
burst's requests (enqueue to first claim), worker processes started, the most alive at once and
worker-seconds, the scale-down time (from the burst's end until the count is back at what the
base load after it keeps: the count at the last arrival, at least the floor), duplicates (two
effect rows for one key), lost requests (neither completed, dead-lettered nor still waiting:
invariant 2), and those still waiting when the run gave up draining. Headline:
``adaptive_live_takeovers`` (adaptive, after the window; target 0), ``adaptive_wait_p99_ratio``
(adaptive over fixed, target <= 0.5), ``adaptive_scale_down_s`` (target <= 120), and
``adaptive_duplicates_lost`` (0 and 0 in both modes).

    .venv/bin/python -m benchmarks.adaptive [--quick] [--json]
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import text

from benchmarks.adaptive_jobs import EFFECTS_DDL
from benchmarks.backends import postgres_schema, postgres_url, redis_url
from benchmarks.suite import module_main
from engine.capacity import Scale
from engine.delivery import DeliveryPolicy
from engine.health.metrics import percentile
from engine.intake import enqueue
from engine.registry import JOB_TYPES
from engine.requests import RequestStore
from engine.worker import WorkerTargets
from resources.idempotency import IdempotencyStore
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from sensors.workers import sized_targets

JOB = "adaptive_probe"
LEASE = 2.0


@dataclass(frozen=True)
class Plan:
    """The load over time, and the supervisor's tick."""

    rate: float
    warm_s: float
    tail_s: float
    burst_s: float
    calm_s: float
    burst_factor: float = 10.0
    kill_after_s: float = 20.0
    """Into the tail phase, one worker is SIGKILLed."""
    adapt_s: float | None = None
    """After the shift, the adaptation window: live takeovers after it are the headline's
    (None: the whole tail phase before the burst)."""
    tick_s: float = 5.0
    drain_s: float = 240.0
    env: dict[str, str] = field(default_factory=dict)

    def schedule(self) -> list[tuple[float, str]]:
        """Every arrival: (seconds from the start, phase)."""
        out: list[tuple[float, str]] = []
        t = 0.0
        for length, rate, phase in ((self.warm_s, self.rate, "fast"),
                                    (self.tail_s, self.rate, "tail"),
                                    (self.burst_s, self.rate * self.burst_factor, "tail"),
                                    (self.calm_s, self.rate, "tail")):
            n = round(length * rate)
            out += [(t + i / rate, phase) for i in range(n)]
            t += length
        return out

    @property
    def shift_at(self) -> float:
        return self.warm_s

    @property
    def burst(self) -> tuple[float, float]:
        start = self.warm_s + self.tail_s
        return start, start + self.burst_s


QUICK = Plan(rate=2.0, warm_s=50, tail_s=40, burst_s=20, calm_s=50, tick_s=2.0,
             drain_s=180, env={"SEKALI_ARRIVAL_WINDOW": "20", "SEKALI_SCALE_DOWN_AFTER": "10"})
FULL = Plan(rate=2.0, warm_s=60, tail_s=120, burst_s=60, calm_s=150, drain_s=900)

MODES: dict[str, dict[str, str]] = {
    "fixed": {"SEKALI_ADAPTIVE": "0", "SEKALI_WORKERS": "light=2,heavy=0"},
    "adaptive": {"SEKALI_ADAPTIVE": "1", "SEKALI_WORKERS": "light=1..8,heavy=0"},
}


class Pool:
    """The worker processes of one mode, by slot (what the supervisor's runs are)."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env = env
        self.logs = logs
        self.procs: dict[int, tuple[subprocess.Popen[bytes], str]] = {}
        self.started = 0
        self.dead: list[str] = []

    def resize(self, count: int) -> None:
        for slot in range(count):
            if slot not in self.procs:
                owner = f"worker-{uuid.uuid4().hex[:12]}"
                with (self.logs / f"{owner}.log").open("wb") as log:
                    proc = subprocess.Popen(  # niced: the producer keeps its schedule
                        ["nice", "-n", "5", sys.executable, "-m", "benchmarks.adaptive_worker",
                         owner], env=self.env, stdout=log, stderr=subprocess.STDOUT)
                self.procs[slot] = (proc, owner)
                self.started += 1
        for slot in sorted(self.procs, reverse=True):
            if slot >= count:
                proc, _ = self.procs[slot]
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)  # it ends after its batch

    def reap(self) -> list[str]:
        """The owners of the processes that ended since the last call; their slots free."""
        ended = []
        for slot, (proc, owner) in list(self.procs.items()):
            if proc.poll() is not None:
                ended.append(owner)
                del self.procs[slot]
        return ended

    def alive(self) -> int:
        return sum(1 for proc, _ in self.procs.values() if proc.poll() is None)

    def kill_one(self) -> str | None:
        for proc, owner in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                return owner
        return None

    def stop(self) -> None:
        for proc, _ in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        for proc, _ in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def give_back(requests: RequestStore, owners: list[str]) -> int:
    """What the supervisor does for ended worker runs: their requests back to pending, each
    claimable once the ledger's lease on its key ran out."""
    if not owners:
        return 0
    ledger = IdempotencyStore(requests.db)

    def lease_end(key: str) -> float | None:
        record = ledger.get(key)
        return record.lease_expires_at if record is not None else None

    return len(requests.take_back(owners, lease_end))


@contextlib.contextmanager
def _database(tmp: Path, mode: str) -> Iterator[str]:
    if postgres_url() is None:
        yield f"sqlite:///{tmp / f'{mode}.db'}"
        return
    with postgres_schema("bench_adaptive_") as url:
        yield url


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_mode(mode: str, plan: Plan, tmp: Path) -> dict[str, Any]:
    namespace = f"bench-adaptive-{mode}-{uuid.uuid4().hex[:8]}"
    logs = tmp / mode
    logs.mkdir()
    with _database(tmp, mode) as url:
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("SEKALI_")},
               "DATABASE_URL": url, "REDIS_URL": redis_url(),
               "SEKALI_JOB_MODULES": "benchmarks.adaptive_jobs",
               "SEKALI_WAKEUP_NAMESPACE": namespace, "SEKALI_BENCH_LEASE": str(LEASE),
               "SEKALI_WORKER_BATCH": "2", "SEKALI_WORKER_POLL": "0.5",
               "SEKALI_WORKER_IDLE": "3600", "SEKALI_WORKER_LIFETIME": "3600",
               "SEKALI_WORKER_PROGRESS": "60", "SEKALI_DURATION_REFRESH": "5",
               "SEKALI_AUTO_MIGRATE": "1", **plan.env, **MODES[mode]}
        with _environment({k: v for k, v in env.items() if k.startswith("SEKALI_")
                           or k in ("DATABASE_URL", "REDIS_URL")}):
            JOB_TYPES.reload()
            db = Database.from_url(url)
            upgrade(db)
            with db.transaction() as conn:
                conn.execute(text(EFFECTS_DDL))
            try:
                return _drive(mode, plan, db, Pool(env, logs))
            finally:
                db.dispose()


def _drive(mode: str, plan: Plan, db: Database, pool: Pool) -> dict[str, Any]:
    requests = RequestStore(db)
    delivery, targets = DeliveryPolicy.from_env(), WorkerTargets.from_env()
    floor = targets.bounds("light")[0]
    scales: dict[str, Scale] = {}
    schedule = plan.schedule()
    ids: list[tuple[int, float, str]] = []
    alive_log: list[tuple[float, int]] = []
    killed: str | None = None
    t0 = time.time()
    next_tick = 0.0
    done_at: float | None = None
    try:
        while True:
            now = time.time() - t0
            while len(ids) < len(schedule) and schedule[len(ids)][0] <= now:
                n = len(ids)
                request = enqueue(JOB, {"run": mode, "n": n, "phase": schedule[n][1]}, db=db)
                ids.append((request.id, schedule[n][0], schedule[n][1]))
            if now >= next_tick:
                give_back(requests, pool.reap())
                sized, scales, _ = sized_targets(requests, delivery, targets, scales, t0 + now)
                pool.resize(sized.of("light"))
                alive_log.append((round(now, 1), pool.alive()))
                next_tick += plan.tick_s
                if len(ids) == len(schedule):
                    if _unfinished(db, ids) == 0:
                        done_at = now
                        break
                    if now > schedule[-1][0] + plan.drain_s:
                        break
            if killed is None and now >= plan.shift_at + plan.kill_after_s:
                killed = pool.kill_one()
            time.sleep(0.02)
    finally:
        pool.stop()
    return _measure(mode, plan, db, pool, ids, alive_log, floor, killed, done_at)


def _unfinished(db: Database, ids: list[tuple[int, float, str]]) -> int:
    with db.statement() as conn:
        return int(conn.execute(text(
            "SELECT COUNT(*) FROM job_requests WHERE id BETWEEN :lo AND :hi"
            " AND status NOT IN ('completed', 'failed', 'cancelled', 'dead_lettered')"),
            {"lo": ids[0][0], "hi": ids[-1][0]}).scalar_one())


def _measure(mode: str, plan: Plan, db: Database, pool: Pool,
             ids: list[tuple[int, float, str]], alive_log: list[tuple[float, int]], floor: int,
             killed: str | None, done_at: float | None) -> dict[str, Any]:
    lo, hi = ids[0][0], ids[-1][0]
    burst_start, burst_end = plan.burst
    burst_ids = [i for i, at, _ in ids if burst_start <= at < burst_end]
    with db.statement() as conn:
        statuses = dict(conn.execute(text(
            "SELECT status, COUNT(*) FROM job_requests WHERE id BETWEEN :lo AND :hi"
            " GROUP BY status"), {"lo": lo, "hi": hi}).all())
        waits = [float(r[0]) for r in conn.execute(text(
            "SELECT claimed_at - created_at FROM job_requests WHERE id BETWEEN :lo AND :hi"
            " AND claimed_at IS NOT NULL"), {"lo": min(burst_ids), "hi": max(burst_ids)})]
        dead = dict(conn.execute(text(
            "SELECT error_class, COUNT(*) FROM dlq_records WHERE request_id BETWEEN :lo AND :hi"
            " GROUP BY error_class"), {"lo": lo, "hi": hi}).all())
        lost = int(conn.execute(text(  # invariant 2: completed, dead-lettered, or waiting
            "SELECT COUNT(*) FROM job_requests r WHERE id BETWEEN :lo AND :hi"
            " AND r.status NOT IN ('completed', 'pending', 'running', 'launched')"
            " AND NOT EXISTS (SELECT 1 FROM dlq_records d WHERE d.request_id = r.id)"),
            {"lo": lo, "hi": hi}).scalar_one())
        unfinished = int(conn.execute(text(
            "SELECT COUNT(*) FROM job_requests WHERE id BETWEEN :lo AND :hi"
            " AND status IN ('pending', 'running', 'launched')"),
            {"lo": lo, "hi": hi}).scalar_one())
        duplicates = int(conn.execute(text(
            "SELECT COUNT(*) FROM (SELECT key FROM adaptive_effects GROUP BY key"
            " HAVING COUNT(*) > 1) d")).scalar_one())
        thrown = int(conn.execute(text(
            "SELECT COUNT(*) FROM job_attempts WHERE job_type = :jt AND outcome = 'lease_lost'"),
            {"jt": JOB}).scalar_one())
        first = float(conn.execute(text(
            "SELECT MIN(created_at) FROM job_requests WHERE id = :lo"), {"lo": lo}).scalar_one())
        live = [float(r[0]) - first for r in conn.execute(text(
            "SELECT a.started_at FROM job_attempts a WHERE a.job_type = :jt AND a.takeover = 1"
            " AND EXISTS (SELECT 1 FROM job_attempts b WHERE b.idempotency_key ="
            " a.idempotency_key AND b.started_at < a.started_at AND b.outcome = 'lease_lost')"),
            {"jt": JOB})]
    after = plan.shift_at + (plan.adapt_s if plan.adapt_s is not None else plan.tail_s)
    last_arrival = ids[-1][1]
    settled = next((n for t, n in reversed(alive_log) if t <= last_arrival), floor)
    down = next((t for t, n in alive_log if t >= burst_end and n <= settled), None)
    peak = max((n for _, n in alive_log), default=0)
    worker_seconds = sum(n * plan.tick_s for _, n in alive_log)
    return {
        "mode": mode, "env": MODES[mode], "requests": len(ids), "statuses": statuses,
        "drained": done_at is not None, "seconds": round(done_at or 0.0, 1),
        "live_takeovers": len(live),
        "live_takeovers_after_window": sum(t >= after for t in live),
        "live_takeover_times_s": sorted(round(t, 1) for t in live),
        "adaptation_window_ends_s": after,
        "attempts_thrown_away": thrown, "dead_letters": dead,
        "crash_loop_dead_letters": int(dead.get("crash_loop", 0)),
        "burst_requests": len(burst_ids),
        "burst_wait_p99_s": round(percentile(waits, 0.99), 2) if waits else None,
        "burst_wait_p50_s": round(percentile(waits, 0.5), 2) if waits else None,
        "worker_processes_started": pool.started, "workers_peak": peak,
        "worker_seconds": round(worker_seconds), "killed_worker": killed,
        "scale_down_s": None if down is None else round(max(0.0, down - burst_end), 1),
        "workers_settled": settled, "workers_floor": floor,
        "duplicates": duplicates, "lost": lost, "unfinished_when_stopped": unfinished,
        "workers_over_time": alive_log,
    }


def run(quick: bool = False) -> dict[str, Any]:
    plan = QUICK if quick else FULL
    out: dict[str, Any] = {"plan": {k: v for k, v in asdict(plan).items()}, "summary": []}
    with tempfile.TemporaryDirectory(prefix="sekali-adaptive-") as tmp:
        for mode in MODES:
            print(f"   adaptive: {mode} ...", file=sys.stderr, flush=True)
            out[mode] = run_mode(mode, plan, Path(tmp))
    fixed, adaptive = out["fixed"], out["adaptive"]
    ratio = (round(adaptive["burst_wait_p99_s"] / fixed["burst_wait_p99_s"], 3)
             if adaptive["burst_wait_p99_s"] is not None and fixed["burst_wait_p99_s"] else None)
    out["headline"] = {
        "adaptive_live_takeovers": adaptive["live_takeovers_after_window"],
        "adaptive_wait_p99_ratio": ratio,
        "adaptive_scale_down_s": adaptive["scale_down_s"],
        "adaptive_duplicates_lost": {f"sekali {m}": {"duplicates": out[m]["duplicates"],
                                                     "lost": out[m]["lost"]} for m in MODES},
    }
    out["summary"] += [
        {"metric": "takeovers of live holders after the adaptation window, adaptive (fixed: "
                   f"{fixed['live_takeovers_after_window']})",
         "value": adaptive["live_takeovers_after_window"], "unit": "attempts",
         "baseline": fixed["live_takeovers_after_window"], "ratio": None, "target": 0,
         "ok": adaptive["live_takeovers_after_window"] == 0},
        {"metric": "queue wait p99 of the burst's requests, adaptive over fixed",
         "value": adaptive["burst_wait_p99_s"], "unit": "s",
         "baseline": fixed["burst_wait_p99_s"], "ratio": ratio, "target": 0.5,
         "ok": ratio is not None and ratio <= 0.5},
        {"metric": "workers back at the base load's count after the burst", "value":
         adaptive["scale_down_s"], "unit": "s", "baseline": None, "ratio": None,
         "target": 120, "ok": adaptive["scale_down_s"] is not None
         and adaptive["scale_down_s"] <= 120},
    ]
    return out


def render(result: dict[str, Any]) -> None:
    keys = ("requests", "drained", "seconds", "live_takeovers", "live_takeovers_after_window",
            "attempts_thrown_away", "crash_loop_dead_letters", "dead_letters",
            "burst_wait_p50_s", "burst_wait_p99_s", "worker_processes_started", "workers_peak",
            "worker_seconds", "scale_down_s", "duplicates", "lost")
    print(f"{'':34} {'fixed':>14} {'adaptive':>14}")
    for key in keys:
        print(f"{key:34} {result['fixed'][key]!s:>14} {result['adaptive'][key]!s:>14}")
    print(result["headline"])


if __name__ == "__main__":
    sys.exit(module_main(__doc__, run, render))
