"""Side by side with the queues users would pick instead, sekali as it is deployed: Celery on
Redis and procrastinate on Postgres against sekali's resident workers through Dagster's real
launcher, on the same ``send_email`` job, in one run (``sekali bench --only peers``).

Every system sends the same mail for the same intent (:mod:`benchmarks.peer_handler`: sekali's
validation, template and key-derived Message-ID) to one sandbox mail sink in its own process,
with ``WORKERS`` worker processes each:

- **Celery 5** (:mod:`benchmarks.peer_celery`): Redis broker, ``acks_late``,
  ``reject_on_worker_lost``, prefetch 1, its own ``celery worker`` CLI with a prefork pool of
  ``WORKERS`` children;
- **procrastinate** (:mod:`benchmarks.peer_procrastinate`): its own ``procrastinate worker``
  CLI, ``WORKERS`` processes of concurrency 1, the documented stalled-job retry;
- **sekali** (``sekali``): ``sekali dev`` on SQLite, as the README starts it;
- **sekali_postgres**: the production profile on Postgres (dagster-postgres, a gRPC code
  server, ``dagster-daemon``).

Both sekali deployments (:mod:`benchmarks.peer_sekali`) run ``WORKERS`` resident worker runs,
each a process the code server launched, as deployed; the benchmark only enqueues (the
producer's :func:`engine.intake.enqueue`, with its wake-up) and watches the sink. No figure of
sekali here comes from an in-process shortcut.

Servers are private to the run: a ``redis-server`` on a free port (Celery's broker, the
production profile's Redis), the run's PostgreSQL cluster (procrastinate's, sekali's and
Dagster's databases; ``pg_stat_statements`` loaded so the production profile's statements are
counted) and ``sekali dev``'s own embedded Redis.

What is measured, each counted at the mail sink from its own records, ``REPETITIONS`` times
with the systems alternating inside each repetition (a slow spell of the shared machine lands
on every system of that repetition), medians with their min-max spread:

1. **Throughput** over a backlog (enqueued in one transaction, or with the peer's consumers
   held, then drained): jobs/s from the first mail to the last; the headline
   ``peers_sekali_over_celery`` is the median of the per-repetition ratios, per deployment.
   Around each sekali drain: CPU-seconds of the deployment's whole process tree (database
   servers excluded), rows added to Dagster's storage (event log, runs) and, on Postgres,
   statements and commits per database, net of the idle rate measured first.
2. **Latency**, enqueue to mail, p50/p99 at ``LATENCY_RATE`` (50) jobs/s offered.
3. **First effect**: one request into an idle system, enqueue to its mail.
4. **Dead letter in a worker run** (sekali): a request the mail provider refuses (550, a
   permanent error) between two good ones: its dead letter's time against the attempt's end
   (the decision), the same worker run still ``STARTED`` afterwards, the good ones sent.
5. **Kills** (once per system, after the repetitions): the backlog again with ``KILLS``
   SIGKILLs of random worker processes at random moments of the drain (a Celery pool child, a
   procrastinate worker, a resident worker run's process), and for the production profile one
   SIGKILL of the Dagster daemon (started again at once, as a process supervisor would).
   Counted per intent once every intent has a mail and the system holds nothing more:
   ``duplicates`` (mails beyond the first for one Message-ID) and ``lost``.

The full run also measures the delivery modes that came before resident workers (``modes``):
``sekali dev`` with ``SEKALI_INTAKE_MODES=send_email=micro_batch``, then ``=per_request``,
each a deployment of its own, for the before/after table of docs/scaling.md.

``--quick``: backlogs of 200, 2 s of steady load per repetition, a kill run of about 150 jobs,
no ``modes``; the same deployments and the same counts (tests assert the structure and the
correctness counts of this run, never its times).

A peer whose library is not installed (``pip install -e '.[bench]'``) is said in one line and
left out; sekali's side is measured anyway.

    .venv/bin/python -m benchmarks.peers [--quick] [--json]
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from benchmarks.backends import BENCH_EXTRA, CONNECT_TIMEOUT, note, postgres_url, private_postgres
from benchmarks.intake import SinkProcess, payloads
from benchmarks.peer_sekali import (
    Deployment,
    DevDeployment,
    ProductionDeployment,
    wait_until,
)
from benchmarks.spread import REPETITIONS, Spread
from benchmarks.suite import module_main
from pipelines.domain.mail import message_id_for
from pipelines.jobs import email
from sandbox.postgres_server import PostgresServer, PostgresUnavailable
from sandbox.redis_server import RedisServer, free_port

WORKERS = 2
"""Worker processes per system (this machine has two cores)."""
KILLS = 3
KILL_RUN_LIMIT_S = 600.0
"""A kill run ends by then whatever the system still holds (what it did not send is lost)."""
LATENCY_RATE = 50.0
"""Jobs/s offered in the latency run."""
FIRST_EFFECTS = 3
"""Single requests into an idle system per repetition."""
SIZES: dict[bool, dict[str, float]] = {
    True: {"backlog": 200, "latency_s": 2.0, "kill_jobs": 150, "idle_s": 3.0},
    False: {"backlog": 1500, "latency_s": 10.0, "kill_jobs": 1200, "idle_s": 10.0,
            "modes_backlog": 300, "per_request_backlog": 12},
}
"""Per ``quick``: backlog per throughput run, latency run length, jobs of the kill run, the
idle window the deployments' background rates are measured over; the full run's sizes of the
``modes`` part."""
PEER_LIBRARIES = {"celery": "celery", "procrastinate": "procrastinate"}


# -- the mail sink's records ------------------------------------------------------------------


class SinkRecords:
    """The sink's ``mail_messages`` rows, read from its database (never from the workers)."""

    def __init__(self, db_path: Path) -> None:
        self.engine = create_engine(f"sqlite:///{db_path}")

    def since(self, row_id: int) -> list[tuple[int, str, float]]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                text("SELECT id, message_id, received_at FROM mail_messages WHERE id > :id"
                     " ORDER BY id"), {"id": row_id},
            ).all()
        return [(int(r[0]), str(r[1]), float(r[2])) for r in rows]

    def last_id(self) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(text("SELECT coalesce(max(id), 0) FROM mail_messages"))
                       .scalar_one())


@dataclass
class Watch:
    """The mails of one set of intents, as they reach the sink."""

    sink: SinkRecords
    wanted: dict[str, int]  # Message-ID -> index of the intent
    start_id: int = 0
    first: dict[str, float] = field(default_factory=dict)
    mails: int = 0
    _cursor: int = 0

    def __post_init__(self) -> None:
        self._cursor = self.start_id

    def poll(self) -> None:
        for row_id, message_id, at in self.sink.since(self._cursor):
            self._cursor = row_id
            if message_id in self.wanted:
                self.mails += 1
                self.first.setdefault(message_id, at)

    def done(self) -> bool:
        self.poll()
        return len(self.first) == len(self.wanted)

    def started(self) -> bool:
        self.poll()
        return bool(self.first)


def watch(sink: SinkRecords, items: list[dict[str, Any]]) -> Watch:
    ids = {message_id_for(email.key_for(email.validate(p))): i for i, p in enumerate(items)}
    return Watch(sink, ids, start_id=sink.last_id())


# -- the systems --------------------------------------------------------------------------------
class System:
    """One queue under test: start/stop its workers, enqueue, name its worker processes."""

    name = ""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def hold(self) -> None:
        """Stop taking new work, so a backlog can be enqueued before the drain starts."""

    def release(self, backlog: bool = True) -> None:
        """Take work again; ``backlog``: a backlog waits, start on it without delay."""

    def enqueue_backlog(self, items: list[dict[str, Any]]) -> None:
        for item in items:
            self.enqueue(item)

    def enqueue(self, item: dict[str, Any]) -> None: ...

    def worker_pids(self) -> list[int]:
        return []

    def after_kill(self, pid: int) -> None:
        """What the system's supervisor does when a worker died (nothing: it does it itself)."""

    def recover(self) -> None:
        """The recovery the system documents for dead workers, run every second during kills."""

    def in_flight(self) -> int:
        """Jobs the system still holds (queued, reserved or running), by its own records."""
        return 0

    def cpu_seconds(self) -> float:
        """CPU used so far by the system's processes (its servers excluded)."""
        return cpu_of(self.top_pids())

    def top_pids(self) -> list[int]:
        return []


def cpu_of(pids: list[int]) -> float:
    """CPU-seconds of the processes ``pids`` and all below them: each live one's own time plus
    its reaped children's (so an ended child stays counted and nothing counts twice)."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            top = psutil.Process(pid)
            for proc in [top, *top.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    t = proc.cpu_times()
                    total += t.user + t.system + t.children_user + t.children_system
    return total


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _stop_process(proc: subprocess.Popen[Any], timeout: float = 20.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Celery(System):
    name = "celery"

    def __init__(self, broker_url: str, env: dict[str, str], log: Path) -> None:
        os.environ["SEKALI_PEERS_BROKER_URL"] = broker_url
        self.module = importlib.import_module("benchmarks.peer_celery")
        self.env = {**env, "SEKALI_PEERS_BROKER_URL": broker_url}
        self.queue = f"peers-{uuid.uuid4().hex[:6]}"
        self.node = f"{self.queue}@bench"
        self.log = log
        self.proc: subprocess.Popen[Any] | None = None

    def start(self) -> None:
        celery = shutil.which("celery", path=str(Path(sys.executable).parent)) or "celery"
        self.proc = subprocess.Popen(
            [celery, "-A", "benchmarks.peer_celery", "worker", "--pool", "prefork",
             "--concurrency", str(WORKERS), "-Q", self.queue, "-n", self.node,
             "--loglevel", "WARNING"],
            env=self.env, stdout=subprocess.DEVNULL, stderr=self.log.open("ab"),
        )
        control = self.module.app.control
        if not wait_until(lambda: bool(control.ping(destination=[self.node], timeout=0.5)), 120):
            raise RuntimeError(f"the Celery worker did not answer (log: {self.log})")
        wait_until(lambda: len(self.worker_pids()) >= WORKERS, 60)

    def stop(self) -> None:
        if self.proc is not None:
            _stop_process(self.proc)

    def hold(self) -> None:
        self.module.app.control.cancel_consumer(
            self.queue, destination=[self.node], reply=True, timeout=5
        )

    def release(self, backlog: bool = True) -> None:
        self.module.app.control.add_consumer(
            self.queue, destination=[self.node], reply=True, timeout=5
        )

    def enqueue(self, item: dict[str, Any]) -> None:
        self.module.send_email.apply_async(args=[item], queue=self.queue)

    def worker_pids(self) -> list[int]:
        return [] if self.proc is None else _children(self.proc.pid)

    def top_pids(self) -> list[int]:
        return [] if self.proc is None else [self.proc.pid]

    def in_flight(self) -> int:
        """Messages in the queue plus those delivered and not acknowledged (kombu's Redis
        transport keeps them in its ``unacked`` hash until the ack, or a requeue)."""
        with self.module.app.connection_for_write() as conn:
            client = conn.default_channel.client
            return int(client.llen(self.queue)) + int(client.hlen("unacked"))


class Procrastinate(System):
    name = "procrastinate"

    def __init__(self, url: str, env: dict[str, str], log: Path) -> None:
        self.url = url
        conninfo = libpq_conninfo(url)
        os.environ["SEKALI_PEERS_PG_CONNINFO"] = conninfo
        self.module = importlib.import_module("benchmarks.peer_procrastinate")
        procrastinate = importlib.import_module("procrastinate")
        self.env = {**env, "SEKALI_PEERS_PG_CONNINFO": conninfo}
        self.conninfo = conninfo
        self.queue = f"peers_{uuid.uuid4().hex[:6]}"
        self.log = log
        self.procs: list[subprocess.Popen[Any]] = []
        self.app = self.module.app  # opened synchronously here: deferring from this process
        self.recovery_app = self.app.with_connector(  # and an async one for the stalled retry
            procrastinate.PsycopgConnector(conninfo=conninfo + " connect_timeout=3", timeout=10)
        )
        self.cli = shutil.which("procrastinate", path=str(Path(sys.executable).parent))
        self.engine = create_engine(url, connect_args={"connect_timeout": CONNECT_TIMEOUT},
                                    pool_size=1)

    def _run_cli(self, *args: str) -> subprocess.Popen[Any]:
        return subprocess.Popen(
            [self.cli or "procrastinate", "--app=benchmarks.peer_procrastinate.app", *args],
            env=self.env, stdout=subprocess.DEVNULL, stderr=self.log.open("ab"),
        )

    def start(self) -> None:
        schema = self._run_cli("schema", "--apply")
        if schema.wait(timeout=120) != 0:
            raise RuntimeError(f"procrastinate schema --apply failed (log: {self.log})")
        self.app.open()
        for _ in range(WORKERS):
            self.procs.append(self._worker())
        wait_until(lambda: self._beating() >= WORKERS, 120, step=0.2)

    def _worker(self) -> subprocess.Popen[Any]:
        return self._run_cli("worker", "--concurrency", "1", "-q", self.queue)

    def _beating(self) -> int:
        return self._count("SELECT count(*) FROM procrastinate_workers")

    def _count(self, sql: str, **params: Any) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(text(sql), params).scalar_one())

    def stop(self) -> None:
        for proc in self.procs:
            _stop_process(proc)
        self.app.close()
        self.engine.dispose()

    def enqueue_backlog(self, items: list[dict[str, Any]]) -> None:
        self.app.configure_task("send_email", queue=self.queue).batch_defer(
            *({"payload": item} for item in items)
        )

    def enqueue(self, item: dict[str, Any]) -> None:
        self.app.configure_task("send_email", queue=self.queue).defer(payload=item)

    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.poll() is None]

    def top_pids(self) -> list[int]:
        return self.worker_pids()

    def in_flight(self) -> int:
        return self._count(
            "SELECT count(*) FROM procrastinate_jobs WHERE queue_name = :q"
            " AND status IN ('todo', 'doing')", q=self.queue
        )

    def after_kill(self, pid: int) -> None:
        """As a process supervisor would: a new worker in the dead one's place."""
        self.procs = [p for p in self.procs if p.pid != pid]
        self.procs.append(self._worker())

    def recover(self) -> None:
        async def once() -> int:
            async with self.recovery_app.open_async():
                return int(await self.module.retry_stalled_jobs(self.recovery_app))

        asyncio.run(once())




class Sekali(System):
    """A sekali deployment (:mod:`benchmarks.peer_sekali`): resident workers take a request
    as it commits, so a backlog is one transaction and there is nothing to hold; a dead worker
    run is replaced by the deployment's own supervisor sensor, its requests given back once
    Dagster's run monitoring has ended its run and the ledger's lease has run out."""

    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment
        self.name = deployment.name

    def start(self) -> None:
        self.deployment.start()

    def stop(self) -> None:
        self.deployment.stop()

    def enqueue_backlog(self, items: list[dict[str, Any]]) -> None:
        self.deployment.enqueue_many("send_email", items)

    def enqueue(self, item: dict[str, Any]) -> None:
        self.deployment.enqueue_one("send_email", item)

    def worker_pids(self) -> list[int]:
        return self.deployment.worker_pids()

    def in_flight(self) -> int:
        return self.deployment.backlog()

    def cpu_seconds(self) -> float:
        return self.deployment.cpu_seconds()


# -- the measurements ---------------------------------------------------------------------------


@dataclass
class Run:
    sink: SinkRecords
    rng: random.Random
    tags: Iterator[int]

    def items(self, system: System, n: int) -> list[dict[str, Any]]:
        return payloads(f"{system.name}-{next(self.tags)}-{uuid.uuid4().hex[:6]}", n)


@dataclass
class Counters:
    """What a deployment has used so far: CPU-seconds, Dagster rows, statements."""

    at: float
    cpu: float
    dagster: dict[str, int] = field(default_factory=dict)
    statements: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, system: System) -> Counters:
        deployment = system.deployment if isinstance(system, Sekali) else None
        return cls(
            time.monotonic(), system.cpu_seconds(),
            deployment.dagster_rows() if deployment is not None else {},
            (deployment.statements() or {}) if deployment is not None else {},
        )

    def rates(self, later: Counters) -> dict[str, float]:
        """Each counter's growth per second from this snapshot to ``later``."""
        seconds = max(later.at - self.at, 1e-6)
        out = {"cpu_seconds": (later.cpu - self.cpu) / seconds}
        for name in later.dagster:
            out[f"dagster_{name}"] = (later.dagster[name] - self.dagster.get(name, 0)) / seconds
        for name in later.statements:
            out[name] = (later.statements[name] - self.statements.get(name, 0)) / seconds
        return out


def per_job(before: Counters, after: Counters, jobs: int,
            idle: dict[str, float] | None) -> dict[str, float]:
    """Each counter's growth over ``jobs`` jobs: gross, and net of the ``idle`` rates (the
    deployment's background: sensor ticks, heartbeats, run monitoring) over the same time."""
    seconds = after.at - before.at
    gross = {k: v * seconds for k, v in before.rates(after).items()}
    out: dict[str, float] = {}
    for name, value in gross.items():
        net = value - (idle or {}).get(name, 0.0) * seconds
        scale = 1.0 if name == "cpu_seconds" else 1000.0  # CPU per job; rows per 1,000 jobs
        suffix = "_per_job" if name == "cpu_seconds" else "_per_1000_jobs"
        out[f"{name}{suffix}"] = round(scale * value / jobs, 4)
        out[f"{name}{suffix}_net"] = round(scale * max(net, 0.0) / jobs, 4)
    return out


def idle_rates(system: System, seconds: float) -> dict[str, float]:
    """The counters' growth per second of a system with nothing to do."""
    wait_until(lambda: system.in_flight() == 0, 120, step=0.5)
    before = Counters.of(system)
    time.sleep(seconds)
    return {k: round(v, 4) for k, v in before.rates(Counters.of(system)).items()}


def drain(run: Run, system: System, n: int, timeout: float,
          idle: dict[str, float] | None = None) -> dict[str, Any]:
    """A backlog of ``n``: jobs/s from its first mail to its last (``jobs_per_s``) and from its
    enqueue to its last (``enqueue_to_last_per_s``), with what the system used for it."""
    items = run.items(system, n)
    w = watch(run.sink, items)
    system.hold()
    before = Counters.of(system)
    enqueued = time.time()
    system.enqueue_backlog(items)
    system.release()
    if not wait_until(w.done, timeout, step=0.1):
        raise RuntimeError(f"{system.name}: {len(w.first)} of {n} mails within {timeout:.0f} s")
    if isinstance(system, Sekali):  # its requests' final rows written before the counters
        wait_until(lambda: system.in_flight() == 0, 60, step=0.1)
    after = Counters.of(system)
    times = sorted(w.first.values())
    out = {"jobs": n, "jobs_per_s": (n - 1) / max(times[-1] - times[0], 1e-6),
           "enqueue_to_last_per_s": n / max(times[-1] - enqueued, 1e-6)}
    out.update(per_job(before, after, n, idle))
    return out


def latency(run: Run, system: System, rate: float, seconds: float) -> dict[str, Any]:
    """Enqueue-to-mail latency at ``rate`` jobs/s offered for ``seconds``."""
    n = max(2, int(rate * seconds))
    items = run.items(system, n)
    w = watch(run.sink, items)
    sent: list[float] = []
    started = time.time()
    for i, item in enumerate(items):
        delay = started + i / rate - time.time()
        if delay > 0:
            time.sleep(delay)
        sent.append(time.time())
        system.enqueue(item)
    wait_until(w.done, 120 + seconds, step=0.2)
    ms = sorted(1000 * (w.first[mid] - sent[i]) for mid, i in w.wanted.items() if mid in w.first)
    return {
        "offered_per_s": round(rate, 1), "jobs": n, "arrived": len(ms),
        "p50_ms": round(statistics.median(ms), 1) if ms else None,
        "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 1) if ms else None,
    }


def first_effects(run: Run, system: System, idle_s: float, count: int = FIRST_EFFECTS
                  ) -> list[float]:
    """``count`` times: once the system has held nothing for ``idle_s`` (its workers waiting),
    one request enqueued; ms from the enqueue to its mail."""
    out = []
    for _ in range(count):
        wait_until(lambda: system.in_flight() == 0, 120, step=0.2)
        time.sleep(idle_s)
        (item,) = run.items(system, 1)
        w = watch(run.sink, [item])
        at = time.time()
        system.enqueue(item)
        if wait_until(w.done, 120, step=0.005):
            out.append(round(1000 * (next(iter(w.first.values())) - at), 1))
    return out


def dead_letter(run: Run, system: Sekali) -> dict[str, Any]:
    """A request the mail provider refuses for good, between two good ones, into a live worker
    run: its dead letter against its decision (the failing attempt's end), and whether the run
    that decided it is still serving afterwards."""
    d = system.deployment
    good = run.items(system, 4)
    bad = {**run.items(system, 1)[0], "to": f"nobody-{uuid.uuid4().hex[:6]}@reject.invalid"}
    w = watch(run.sink, good)
    enqueued = time.time()
    ids = d.enqueue_many("send_email", [good[0], bad, good[1]])
    bad_id = ids[1]
    row = None
    deadline = time.monotonic() + 120
    while row is None and time.monotonic() < deadline:
        with d.db.statement() as conn:
            row = conn.execute(text(
                "SELECT d.created_at, d.run_id, a.ended_at, a.outcome FROM dlq_records d"
                " JOIN job_attempts a ON a.request_id = d.request_id"
                " AND a.outcome IN ('dead_lettered', 'failed_permanent')"
                " WHERE d.request_id = :id"), {"id": bad_id}).first()
        if row is None:
            time.sleep(0.01)
    seen = time.time()
    if row is None:
        return {"request_id": bad_id, "dead_lettered": False}
    created, run_id, decided = float(row[0]), str(row[1]), float(row[2] or row[0])
    d.enqueue_many("send_email", good[2:])  # after the dead letter: the workers go on
    sent = wait_until(w.done, 120, step=0.05)
    return {
        "request_id": bad_id, "dead_lettered": True, "attempt_outcome": row[3],
        "after_decision_ms": round(1000 * (created - decided), 1),
        "enqueue_to_visible_ms": round(1000 * (seen - enqueued), 1),
        "run_id": run_id, "run_status_after": d.run_status(run_id),
        "good_mails_sent": len(w.first), "good_requests": len(good), "all_sent": sent,
    }


def under_kills(run: Run, system: System, n: int, drain_s: float, rng: random.Random
                ) -> dict[str, Any]:
    """The backlog again, with ``KILLS`` SIGKILLs of random workers at random moments of the
    drain (a kill that finds every worker dead waits for a replacement, so all ``KILLS``
    land), and one of the Dagster daemon where the deployment offers it; duplicates and lost
    intents counted at the sink once every intent has a mail and the system holds nothing
    more (its own records: queue and reservations, or requests not final), or after
    ``KILL_RUN_LIMIT_S`` at most."""
    items = run.items(system, n)
    w = watch(run.sink, items)
    system.hold()
    system.enqueue_backlog(items)
    system.release()
    wait_until(w.started, 120, step=0.02)
    began = time.monotonic()
    moments = [(rng.uniform(0.05, 0.6) * drain_s, "worker") for _ in range(KILLS)]
    if isinstance(system, Sekali) and system.deployment.daemon_pid() is not None:
        moments.append((rng.uniform(0.05, 0.6) * drain_s, "daemon"))
    moments.sort()
    killed: list[dict[str, Any]] = []
    dead: set[int] = set()
    last_recover = 0.0
    deadline = began + KILL_RUN_LIMIT_S
    while time.monotonic() < deadline:
        now = time.monotonic()
        if moments and now - began >= moments[0][0]:
            _, what = moments.pop(0)
            w.poll()
            if what == "daemon" and isinstance(system, Sekali):
                pid = system.deployment.kill_daemon()
                if pid is not None:
                    killed.append({"what": "daemon", "pid": pid, "at_s": round(now - began, 2),
                                   "mails_so_far": len(w.first)})
            else:
                pids = [pid for pid in system.worker_pids() if pid not in dead]
                if not pids:  # all dead: the next kill waits for a replacement to start
                    moments = sorted([*moments, (now - began + 0.5, "worker")])
                if pids:
                    pid = rng.choice(pids)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                        killed.append({"what": "worker", "pid": pid,
                                       "at_s": round(now - began, 2),
                                       "mails_so_far": len(w.first)})
                    dead.add(pid)
                    system.after_kill(pid)
        if now - last_recover >= 1.0:
            system.recover()
            last_recover = now
        if not moments and w.done() and system.in_flight() == 0:
            break
        time.sleep(0.05)
    time.sleep(1.0)
    w.poll()
    return {
        "jobs": n, "kills": killed, "mails": w.mails, "intents_reached": len(w.first),
        "duplicates": w.mails - len(w.first), "lost": n - len(w.first),
        "waited_s": round(time.monotonic() - began, 1),
    }


def spread(values: list[float]) -> dict[str, Any] | None:
    return Spread.of(values).as_dict() if values else None

# -- servers ------------------------------------------------------------------------------------


@contextmanager
def postgres_databases(names: list[str]) -> Iterator[dict[str, str]]:
    """SQLAlchemy URLs of fresh databases, dropped after: on the run's private cluster
    (:func:`benchmarks.backends.private_postgres`, shared with the other suites), or (no
    binaries) on the benchmark server."""
    try:
        server: PostgresServer | None = private_postgres()
    except PostgresUnavailable as exc:
        note(f"no private PostgreSQL cluster ({exc}); peers use databases made for the run")
        server = None
    base = server.url() if server is not None else postgres_url()
    if base is None:
        raise RuntimeError("peers need PostgreSQL (procrastinate's and sekali's store)")
    suffix = uuid.uuid4().hex[:6]
    made = {name: f"peers_{name}_{suffix}" for name in names}
    admin = create_engine(make_url(base).set(database="postgres"), isolation_level="AUTOCOMMIT",
                          connect_args={"connect_timeout": CONNECT_TIMEOUT})
    try:
        with admin.connect() as conn:
            for db in made.values():
                conn.execute(text(f'CREATE DATABASE "{db}"'))
        yield {name: make_url(base).set(database=db).render_as_string(False)
               for name, db in made.items()}
    finally:
        with contextlib.suppress(Exception), admin.connect() as conn:
            for db in made.values():
                conn.execute(text(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)'))
        admin.dispose()


def libpq_conninfo(url: str) -> str:
    u = make_url(url)
    password = f" password={u.password}" if u.password else ""
    return (f"host={u.host} port={u.port or 5432} user={u.username or 'postgres'}"
            f" dbname={u.database}{password}")


def in_background(calls: list[Callable[[], None]]) -> Callable[[], None]:
    """Start ``calls`` on threads; the function returned joins them and raises the first
    error one of them raised."""
    errors: list[BaseException] = []

    def guarded(call: Callable[[], None]) -> None:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - handed to the joining thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(call,)) for call in calls]
    for thread in threads:
        thread.start()

    def join() -> None:
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]

    return join


def installed(system: str) -> bool:
    """Whether the peer's library imports. One that is absent, or present but failing to
    import, is said in one line and left out; sekali's side is measured anyway."""
    try:
        importlib.import_module(PEER_LIBRARIES[system])
        return True
    except ImportError:
        pass
    note(f"{PEER_LIBRARIES[system]} is not installed: the peers suite leaves {system} out and "
         f"measures sekali's side ({BENCH_EXTRA} installs the peers)")
    return False


# -- the suite ----------------------------------------------------------------------------------


def enable_statement_counts(server: PostgresServer | None) -> bool:
    """Load ``pg_stat_statements`` on the run's private cluster (a restart, once), so the
    production profile's statements per job are counted; False where it cannot be."""
    if server is None:
        return False
    engine = create_engine(server.url(), isolation_level="AUTOCOMMIT",
                           connect_args={"connect_timeout": CONNECT_TIMEOUT})
    try:
        with engine.connect() as conn:
            loaded = conn.execute(text("SHOW shared_preload_libraries")).scalar_one()
            if "pg_stat_statements" not in str(loaded):
                conn.execute(text("ALTER SYSTEM SET shared_preload_libraries = "
                                  "'pg_stat_statements'"))
        if "pg_stat_statements" not in str(loaded):
            engine.dispose()
            server.restart()
        with engine.connect() as conn:
            conn.execute(text("CREATE EXTENSION IF NOT EXISTS pg_stat_statements"))
        return True
    except Exception as exc:  # noqa: BLE001 - statement counts are optional, said in one line
        note(f"peers: no pg_stat_statements ({type(exc).__name__}: {exc}); statements not counted")
        return False
    finally:
        engine.dispose()


def run(quick: bool = False) -> dict[str, Any]:
    sizes = SIZES[quick]
    out: dict[str, Any] = {"quick": quick, "workers": WORKERS, "sizes": sizes,
                           "repetitions": REPETITIONS, "systems": {},
                           "load_before": [round(x, 2) for x in os.getloadavg()]}
    began = time.monotonic()
    with contextlib.ExitStack() as stack:
        saved = dict(os.environ)  # the suites after this one must not see its private servers
        stack.callback(lambda: (os.environ.clear(), os.environ.update(saved)))
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sekali-peers-")))
        redis = RedisServer(tmp / "redis", port=free_port()).start()
        stack.callback(redis.stop)
        sink = SinkProcess(tmp / "sink.db")
        stack.callback(sink.stop)
        try:
            server: PostgresServer | None = private_postgres()
        except PostgresUnavailable:
            server = None
        out["statements_counted"] = enable_statement_counts(server)
        urls = stack.enter_context(
            postgres_databases(["sekali", "dagster", "procrastinate"]))
        env = {**os.environ, "SEKALI_SMTP_HOST": "127.0.0.1", "SEKALI_SMTP_PORT": str(sink.port)}
        redis_base = f"redis://:{redis.password}@127.0.0.1:{redis.port}"
        sink_url = f"sqlite:///{tmp / 'sink.db'}"
        admin = make_url(urls["sekali"]).set(database="postgres").render_as_string(False)
        systems: dict[str, System] = {}
        if installed("celery"):
            systems["celery"] = Celery(f"{redis_base}/0", env, tmp / "celery.log")
        systems["sekali"] = Sekali(DevDeployment(tmp / "dev", sink.port, sink_url, WORKERS))
        systems["sekali_postgres"] = Sekali(ProductionDeployment(
            tmp / "production", sink.port, sink_url, WORKERS, app_url=urls["sekali"],
            dagster_url=urls["dagster"], admin_url=admin, redis_url=f"{redis_base}/1"))
        if installed("procrastinate"):
            systems["procrastinate"] = Procrastinate(
                urls["procrastinate"], env, tmp / "procrastinate.log"
            )
        for system in systems.values():
            stack.callback(system.stop)
        in_background([system.start for system in systems.values()])()
        run_ = Run(SinkRecords(tmp / "sink.db"), random.Random(26), iter(range(10**6)))
        out["phase_seconds"] = {"start": round(time.monotonic() - began, 1)}
        out["systems"] = measure(run_, systems, sizes, out["phase_seconds"])
        out["sekali_daemon_restarts"] = {
            name: s.deployment.daemon_restarts for name, s in systems.items()
            if isinstance(s, Sekali)}
        for system in list(systems.values()):
            if isinstance(system, Sekali):  # the modes' deployments need the machine
                system.stop()
        if not quick:
            mark = time.monotonic()
            out["modes"] = delivery_modes(run_, tmp, sink.port, sink_url, sizes)
            out["phase_seconds"]["modes"] = round(time.monotonic() - mark, 1)
    out["load_after"] = [round(x, 2) for x in os.getloadavg()]
    return summarise(out)


def measure(run_: Run, systems: dict[str, System], sizes: dict[str, float],
            phases: dict[str, float]) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {name: {"drains": [], "latency": [],
                                                 "first_effect_ms": []} for name in systems}
    mark = time.monotonic()

    def phase(name: str) -> None:
        nonlocal mark
        phases[name] = round(time.monotonic() - mark, 1)
        mark = time.monotonic()

    idle = {name: idle_rates(s, sizes["idle_s"]) for name, s in systems.items()
            if isinstance(s, Sekali)}
    for name, rates in idle.items():
        results[name]["idle_per_s"] = rates
    phase("idle")
    backlog = int(sizes["backlog"])
    for _ in range(REPETITIONS):
        for name, system in systems.items():
            r = results[name]
            r["drains"].append(drain(run_, system, backlog, 300.0 + backlog / 5,
                                     idle.get(name)))
            r["latency"].append(latency(run_, system, LATENCY_RATE, sizes["latency_s"]))
            r["first_effect_ms"] += first_effects(run_, system, sizes["idle_s"] / 3)
            if isinstance(system, Sekali):
                r.setdefault("dead_letters", []).append(dead_letter(run_, system))
    phase("repetitions")
    seeds = {name: run_.rng.randrange(2**32) for name in systems}
    for name, system in systems.items():  # one at a time: the kills land in its own drain
        rate = statistics.median(d["jobs_per_s"] for d in results[name]["drains"])
        n = int(sizes["kill_jobs"])
        results[name]["kills"] = under_kills(run_, system, n, n / rate,
                                             random.Random(seeds[name]))
    phase("kills")
    return results


MODES = ("micro_batch", "per_request")


def delivery_modes(run_: Run, tmp: Path, smtp_port: int, sink_url: str,
                   sizes: dict[str, float]) -> dict[str, Any]:
    """The delivery modes before resident workers, each on a ``sekali dev`` of its own with
    ``SEKALI_INTAKE_MODES=send_email=MODE`` (the intake sensor launches a run per batch or per
    request): a backlog's rate and costs, latency at half that rate, first effects."""
    out: dict[str, Any] = {}
    for mode in MODES:
        deployment = DevDeployment(tmp / f"dev-{mode}", smtp_port, sink_url, WORKERS,
                                   extra_env={"SEKALI_INTAKE_MODES": f"send_email={mode}"})
        system = Sekali(deployment)
        system.name = f"sekali_{mode}"
        try:  # a mode that fails is said in the report; the measurements before it stand
            system.start()
            idle = idle_rates(system, sizes["idle_s"])
            n = int(sizes["per_request_backlog" if mode == "per_request" else "modes_backlog"])
            d = drain(run_, system, n, 1800.0, idle)
            rate = d["enqueue_to_last_per_s"]
            out[mode] = {
                "drain": d, "idle_per_s": idle,
                "latency": latency(run_, system, max(0.05, 0.5 * rate),
                                   max(10.0, 8 / max(0.5 * rate, 1e-6))),
                "first_effect_ms": first_effects(run_, system, sizes["idle_s"] / 3),
            }
        except Exception as exc:  # noqa: BLE001 - reported, the suite's other figures kept
            out[mode] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        finally:
            system.stop()
    return out


def summarise(out: dict[str, Any]) -> dict[str, Any]:
    s = out["systems"]
    for r in s.values():
        rates = [d["jobs_per_s"] for d in r["drains"]]
        r["jobs_per_s"] = round(statistics.median(rates), 1)
        r["jobs_per_s_runs"] = [round(x, 1) for x in rates]
        costs = [k for k in r["drains"][0] if k.endswith(("_per_job", "_per_1000_jobs",
                                                          "_net"))]
        r["costs"] = {k: round(statistics.median(d[k] for d in r["drains"]), 4) for k in costs}
    sekalis = [name for name in s if name.startswith("sekali")]
    spreads: dict[str, dict[str, Spread | None]] = {
        "peers_sekali_over_celery": {}, "peers_sekali_over_procrastinate": {},
        "peers_latency_p50_ms": {}, "peers_latency_p99_ms": {}, "first_effect_idle_ms": {},
        "peers_dead_letter_after_decision_ms": {},
    }
    for name in sekalis:
        for peer in ("celery", "procrastinate"):
            if peer in s:
                spreads[f"peers_sekali_over_{peer}"][name] = Spread.of([
                    mine["jobs_per_s"] / theirs["jobs_per_s"]
                    for mine, theirs in zip(s[name]["drains"], s[peer]["drains"], strict=True)])
        dead = [d["after_decision_ms"] for d in s[name].get("dead_letters", [])
                if d.get("dead_lettered")]
        spreads["peers_dead_letter_after_decision_ms"][name] = Spread.of(dead) if dead else None
    for name, r in s.items():
        for q in ("p50", "p99"):
            values = [x[f"{q}_ms"] for x in r["latency"] if x[f"{q}_ms"] is not None]
            spreads[f"peers_latency_{q}_ms"][name] = Spread.of(values) if values else None
        fe = r["first_effect_ms"]
        spreads["first_effect_idle_ms"][name] = Spread.of(fe) if fe else None
    headline: dict[str, Any] = {
        key: {name: None if sp is None else round(sp.median, 3) for name, sp in by.items()}
        for key, by in spreads.items()
    }
    headline["peers_duplicates_under_kills"] = {
        name: {"duplicates": r["kills"]["duplicates"], "lost": r["kills"]["lost"]}
        for name, r in s.items()}
    headline["peers_dead_letter_run_kept_going"] = {
        name: all(d.get("dead_lettered") and d.get("run_status_after") == "STARTED"
                  and d.get("all_sent") for d in s[name].get("dead_letters", []))
        for name in sekalis}
    out["headline"] = headline
    out["headline_spread"] = {f"{key}.{name}": sp.as_dict() for key, by in spreads.items()
                              for name, sp in by.items() if sp is not None}
    out["summary"] = summary_rows(out)
    return out


def summary_rows(out: dict[str, Any]) -> list[dict[str, Any]]:
    s, h = out["systems"], out["headline"]
    rows = []
    base = s.get("celery", {}).get("jobs_per_s")
    for name, r in s.items():
        ratio = h["peers_sekali_over_celery"].get(name)
        rows.append({"metric": f"{name}: send_email over a backlog", "value": r["jobs_per_s"],
                     "unit": "jobs/s", "baseline": f"celery {base}/s" if base else None,
                     "ratio": ratio, "target": 1.0 if ratio is not None else None,
                     "ok": ratio >= 1.0 if ratio is not None else None})
        p50, p99 = h["peers_latency_p50_ms"].get(name), h["peers_latency_p99_ms"].get(name)
        sekali = name.startswith("sekali")
        rows.append({"metric": f"{name}: enqueue to mail at {LATENCY_RATE:g}/s, p50 "
                     f"(p99 {p99} ms)", "value": p50, "unit": "ms", "baseline": None,
                     "ratio": None, "target": 50 if sekali else None,
                     "ok": (p50 is not None and p50 <= 50 and p99 is not None and p99 <= 500)
                     if sekali else None})
        fe = h["first_effect_idle_ms"].get(name)
        rows.append({"metric": f"{name}: enqueue into an idle system to the mail", "value": fe,
                     "unit": "ms", "baseline": None, "ratio": None,
                     "target": 1000 if sekali else None,
                     "ok": (fe is not None and fe <= 1000) if sekali else None})
        k = r["kills"]
        what = ", ".join(sorted({x["what"] for x in k["kills"]})) if k["kills"] else "none"
        rows.append({"metric": f"{name}: {len(k['kills'])} SIGKILLs ({what}) over {k['jobs']}"
                     " jobs: duplicates / lost", "value": f"{k['duplicates']} / {k['lost']}",
                     "unit": "mails", "baseline": f"{k['mails']} mails", "ratio": None,
                     "target": "0 / 0" if sekali else None,
                     "ok": (k["duplicates"] == 0 and k["lost"] == 0) if sekali else None})
        if sekali:
            ms = h["peers_dead_letter_after_decision_ms"].get(name)
            rows.append({"metric": f"{name}: dead letter after its decision, worker run going"
                         f" on: {h['peers_dead_letter_run_kept_going'][name]}", "value": ms,
                         "unit": "ms", "baseline": None, "ratio": None, "target": 1000,
                         "ok": ms is not None and ms <= 1000
                         and h["peers_dead_letter_run_kept_going"][name]})
    return rows


def render(results: dict[str, Any]) -> None:
    print(f"send_email side by side, {results['workers']} worker processes each, load "
          f"{results['load_before']} before, {results['load_after']} after")
    print(f"{'system':18}{'jobs/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'first ms':>9}{'cpu/job':>9}"
          f"{'kills':>6}{'mails':>7}{'dup':>5}{'lost':>5}")
    h = results["headline"]
    for name, r in results["systems"].items():
        k = r["kills"]
        print(f"{name:18}{r['jobs_per_s']:>9.1f}{h['peers_latency_p50_ms'][name] or 0:>9.1f}"
              f"{h['peers_latency_p99_ms'][name] or 0:>9.1f}"
              f"{h['first_effect_idle_ms'][name] or 0:>9.1f}"
              f"{r['costs'].get('cpu_seconds_per_job', 0):>9.4f}{len(k['kills']):>6}"
              f"{k['mails']:>7}{k['duplicates']:>5}{k['lost']:>5}")
    for name, sp in results["headline_spread"].items():
        print(f"{name}: median {sp['median']} (min {sp['min']}, max {sp['max']})")
    for mode, m in results.get("modes", {}).items():
        if "error" in m:
            print(f"{mode}: {m['error']}")
            continue
        print(f"{mode}: {m['drain']['enqueue_to_last_per_s']:.2f} jobs/s, latency {m['latency']}"
              f", first effect {m['first_effect_ms']} ms")


def main() -> None:
    module_main(__doc__, run, render)


if __name__ == "__main__":
    main()
