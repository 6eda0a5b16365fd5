"""Side by side with the queues users would pick instead: Celery on Redis and procrastinate on
Postgres against sekali's micro-batch and per-request intake, on the same ``send_email`` job, in
one run (``sekali bench --only peers``).

Every system sends the same mail for the same intent (:mod:`benchmarks.peer_handler`: sekali's
validation, template and key-derived Message-ID) to one sandbox mail sink in its own process,
with ``WORKERS`` worker processes each:

- **Celery 5** (:mod:`benchmarks.peer_celery`): Redis broker, ``acks_late``,
  ``reject_on_worker_lost``, prefetch 1, its own ``celery worker`` CLI with a prefork pool of
  ``WORKERS`` children;
- **procrastinate** (:mod:`benchmarks.peer_procrastinate`): its own ``procrastinate worker``
  CLI, ``WORKERS`` processes of concurrency 1, the documented stalled-job retry;
- **sekali** (:mod:`benchmarks.peer_sekali`): ``enqueue``, the real ``intake_sensor`` and jobs,
  micro-batch (50 a run) or per request, on ``WORKERS`` run-worker processes.

Servers are private to the run: a ``redis-server`` on a free port (Celery's broker, sekali's
cache and budgets) and a PostgreSQL cluster of its own (procrastinate's and sekali's databases;
without the binaries, two databases made for the run on the benchmark server, dropped after).

Three measurements per system, each counted at the mail sink from its own records:

1. **Throughput** over a fixed backlog: the backlog is enqueued while nothing takes it (Celery's
   consumers cancelled, procrastinate's ``batch_defer`` and sekali's enqueue in one transaction
   each), then drained; jobs/s from the first mail to the last. Three repetitions, Celery,
   sekali micro-batch and procrastinate alternating; the headline ratios are the medians of the
   per-repetition ratios (``benchmarks.spread``). Per request runs once.
2. **Latency**, enqueue to mail, p50/p99 at a steady offered load below saturation (half the
   slowest system's throughput, at most ``MAX_RATE``; per request at half its own).
3. **Kills**: the backlog again with 3 SIGKILLs of random workers at random moments during the
   drain (a Celery pool child, a procrastinate worker, a sekali run worker), each system
   recovering its own way (Celery requeues on worker loss; procrastinate's stalled-job retry;
   sekali's run retry once the ledger's lease ran out). Then, per intent: ``duplicates`` (mails
   beyond the first for one Message-ID) and ``lost`` (intents with no mail within the wait).

``--quick``: backlogs of 300 (full 1,500), 30 per request, 2 s of steady load and a kill run of
about 3 s of drain; the kill run's wait for sekali's recovery (twice the lease) is the same as in
the full run, as that is what the duplicates and lost counts are about. The throughput ratios of
a 300-job backlog swing more than the full run's (its median of three is in the report, with
the spread).

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

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from benchmarks.backends import BENCH_EXTRA, CONNECT_TIMEOUT, note, postgres_url, private_postgres
from benchmarks.intake import SinkProcess, payloads
from benchmarks.peer_sekali import LEASE_SECONDS, IntakeDaemon, wait_until
from benchmarks.spread import REPETITIONS, Interleaved, Spread
from benchmarks.suite import module_main
from engine.intake import enqueue
from engine.requests import RequestStore
from pipelines.domain.mail import message_id_for
from pipelines.jobs import email
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from sandbox.postgres_server import PostgresServer, PostgresUnavailable
from sandbox.redis_server import RedisServer, free_port

WORKERS = 2
"""Worker processes per system (this machine has two cores)."""
KILLS = 3
KILL_RUN_LIMIT_S = 600.0
"""A kill run ends by then whatever the system still holds (what it did not send is lost)."""
MAX_RATE = 50.0
"""Jobs/s offered in the latency run, at most."""
SIZES = {
    True: {"backlog": 300, "per_request": 30, "latency_s": 2.0, "kill_drain_s": 3.0},
    False: {"backlog": 1500, "per_request": 120, "latency_s": 15.0, "kill_drain_s": 12.0},
}
"""Per ``quick``: backlog per throughput run, per-request backlog, latency run length, and how
long the kill run's backlog takes to drain at the measured rate."""
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
    def __init__(self, mode: str, daemon: IntakeDaemon, db: Database) -> None:
        self.name = f"sekali_{mode}"
        self.mode = mode
        self.daemon = daemon
        self.db = db

    def hold(self) -> None:
        os.environ["SEKALI_INTAKE_MODE"] = self.mode  # read by the sensor at each tick

    def release(self, backlog: bool = True) -> None:
        if backlog:  # timed from its first mail: the sensor's interval is not part of it
            self.daemon.tick_now()

    def enqueue_backlog(self, items: list[dict[str, Any]]) -> None:
        with self.db.transaction() as conn:  # visible to the intake all at once
            for item in items:
                enqueue("send_email", item, conn=conn)

    def enqueue(self, item: dict[str, Any]) -> None:
        enqueue("send_email", item, db=self.db)

    def worker_pids(self) -> list[int]:
        return self.daemon.worker_pids()

    def in_flight(self) -> int:
        counts = RequestStore(self.db).counts("send_email")
        waiting = counts["pending"] + counts["launched"] + counts["running"]
        return waiting + (0 if self.daemon.idle() else 1)


# -- the measurements ---------------------------------------------------------------------------


@dataclass
class Run:
    sink: SinkRecords
    rng: random.Random
    tags: Iterator[int]

    def items(self, system: System, n: int) -> list[dict[str, Any]]:
        return payloads(f"{system.name}-{next(self.tags)}-{uuid.uuid4().hex[:6]}", n)


def drain_rate(run: Run, system: System, n: int, timeout: float) -> float:
    """Jobs/s from the first mail of a backlog of ``n`` to its last."""
    items = run.items(system, n)
    w = watch(run.sink, items)
    system.hold()
    system.enqueue_backlog(items)
    system.release()
    if not wait_until(w.done, timeout, step=0.2):
        raise RuntimeError(f"{system.name}: {len(w.first)} of {n} mails within {timeout:.0f} s")
    times = sorted(w.first.values())
    return (n - 1) / max(times[-1] - times[0], 1e-6)


def latency(run: Run, system: System, rate: float, seconds: float) -> dict[str, Any]:
    """Enqueue-to-mail latency at ``rate`` jobs/s offered for ``seconds``."""
    n = max(2, int(rate * seconds))
    items = run.items(system, n)
    w = watch(run.sink, items)
    system.hold()
    system.release(backlog=False)  # sekali: the sensor ticks at its own interval
    sent: list[float] = []
    started = time.time()
    for i, item in enumerate(items):
        delay = started + i / rate - time.time()
        if delay > 0:
            time.sleep(delay)
        sent.append(time.time())
        system.enqueue(item)
    wait_until(w.done, 60 + seconds, step=0.2)
    ms = sorted(1000 * (w.first[mid] - sent[i]) for mid, i in w.wanted.items() if mid in w.first)
    return {
        "offered_per_s": round(rate, 1), "jobs": n, "arrived": len(ms),
        "p50_ms": round(statistics.median(ms), 1) if ms else None,
        "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 1) if ms else None,
    }


def under_kills(run: Run, system: System, n: int, drain_s: float, wait_s: float,
                rng: random.Random) -> dict[str, Any]:
    """The backlog again, with ``KILLS`` SIGKILLs of random workers at random moments of the
    drain; duplicates and lost intents counted at the sink once every intent has a mail, or
    once the system holds nothing more (``in_flight``: its queue, reservations and runs are
    empty for two seconds after its recovery has had ``wait_s``), or after
    ``KILL_RUN_LIMIT_S`` at most."""
    items = run.items(system, n)
    w = watch(run.sink, items)
    system.hold()
    system.enqueue_backlog(items)
    system.release()
    wait_until(w.started, 60, step=0.05)
    began = time.monotonic()
    moments = sorted(rng.uniform(0.05, 0.6) * drain_s for _ in range(KILLS))
    killed: list[dict[str, Any]] = []
    dead: set[int] = set()
    last_recover = 0.0
    deadline = began + KILL_RUN_LIMIT_S
    settled_since: float | None = None
    while time.monotonic() < deadline:
        now = time.monotonic()
        if moments and now - began >= moments[0]:
            moments.pop(0)
            pids = [pid for pid in system.worker_pids() if pid not in dead]
            if pids:
                pid = rng.choice(pids)
                w.poll()
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    killed.append({"pid": pid, "at_s": round(now - began, 2),
                                   "mails_so_far": len(w.first)})
                dead.add(pid)
                system.after_kill(pid)
        if now - last_recover >= 1.0:
            system.recover()
            last_recover = now
            if not moments and now - killed_at(killed, began) >= wait_s and not (
                system.in_flight()
            ):
                settled_since = settled_since or now
                if now - settled_since >= 2.0:
                    break
            else:
                settled_since = None
        if not moments and w.done():
            break
        time.sleep(0.05)
    time.sleep(0.5)
    w.poll()
    return {
        "jobs": n, "kills": killed, "mails": w.mails, "intents_reached": len(w.first),
        "duplicates": w.mails - len(w.first), "lost": n - len(w.first),
        "waited_s": round(time.monotonic() - began, 1),
    }


def killed_at(killed: list[dict[str, Any]], began: float) -> float:
    """When the last kill struck (monotonic), or the start when none did."""
    return began + max((k["at_s"] for k in killed), default=0.0)


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


def run(quick: bool = False) -> dict[str, Any]:
    sizes = SIZES[quick]
    out: dict[str, Any] = {"quick": quick, "workers": WORKERS, "sizes": sizes,
                           "lease_seconds": LEASE_SECONDS, "systems": {}}
    began = time.monotonic()
    with contextlib.ExitStack() as stack:
        saved = dict(os.environ)  # the suites after this one must not see its private servers
        stack.callback(lambda: (os.environ.clear(), os.environ.update(saved)))
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sekali-peers-")))
        redis = RedisServer(tmp / "redis", port=free_port()).start()
        stack.callback(redis.stop)
        sink = SinkProcess(tmp / "sink.db")
        stack.callback(sink.stop)
        urls = stack.enter_context(postgres_databases(["sekali", "procrastinate"]))
        env = {**os.environ, "SEKALI_SMTP_HOST": "127.0.0.1", "SEKALI_SMTP_PORT": str(sink.port)}
        redis_base = f"redis://:{redis.password}@127.0.0.1:{redis.port}"
        # the provider's record (the sink's database), as production configures it: a mail
        # handed over by a worker killed before recording it is looked up, not sent again
        sekali_env = {"DATABASE_URL": urls["sekali"], "REDIS_URL": f"{redis_base}/1",
                      "SEKALI_SMTP_PORT": str(sink.port), "SEKALI_INTAKE_BATCH_SIZE": "50",
                      "SEKALI_INTAKE_MAX_PER_TICK": "5000",
                      "SEKALI_SMTP_LOG_URL": f"sqlite:///{tmp / 'sink.db'}"}
        os.environ.update(sekali_env)
        db = Database.from_url(urls["sekali"])
        upgrade(db)
        stack.callback(db.dispose)
        daemon = IntakeDaemon(WORKERS, urls["sekali"], sink.port, "peers", sekali_env)
        systems: dict[str, System] = {}
        if installed("celery"):
            systems["celery"] = Celery(f"{redis_base}/0", env, tmp / "celery.log")
        if installed("procrastinate"):
            systems["procrastinate"] = Procrastinate(
                urls["procrastinate"], env, tmp / "procrastinate.log"
            )
        for system in systems.values():
            stack.callback(system.stop)
        started = in_background([system.start for system in systems.values()])
        daemon.start()  # meanwhile: the peers boot while sekali's run workers import Dagster
        stack.callback(daemon.stop)
        started()
        systems["sekali_micro_batch"] = Sekali("micro_batch", daemon, db)
        systems["sekali_per_request"] = Sekali("per_request", daemon, db)
        run_ = Run(SinkRecords(tmp / "sink.db"), random.Random(26), iter(range(10**6)))
        out["phase_seconds"] = {"start": round(time.monotonic() - began, 1)}
        out["systems"] = measure(run_, systems, sizes, out["phase_seconds"])
        out["sekali_run_retries"] = daemon.retries
        out["sekali_requests"] = RequestStore(db).counts()
    return summarise(out)


def measure(run_: Run, systems: dict[str, System], sizes: dict[str, float],
            phases: dict[str, float]) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {name: {} for name in systems}
    mark = time.monotonic()

    def phase(name: str) -> None:
        nonlocal mark
        phases[name] = round(time.monotonic() - mark, 1)
        mark = time.monotonic()
    backlog = int(sizes["backlog"])
    timeout = 120.0 + backlog / 5
    paired = [name for name in ("celery", "sekali_micro_batch", "procrastinate")
              if name in systems]
    for _ in range(REPETITIONS):
        for name in paired:
            results[name].setdefault("jobs_per_s_runs", []).append(
                drain_rate(run_, systems[name], backlog, timeout)
            )
    per_request = int(sizes["per_request"])
    results["sekali_per_request"]["jobs_per_s_runs"] = [
        drain_rate(run_, systems["sekali_per_request"], per_request, 120.0 + per_request)
    ]
    phase("throughput")
    rates = {name: statistics.median(r["jobs_per_s_runs"]) for name, r in results.items()}
    for name, r in results.items():
        r["jobs_per_s"] = round(rates[name], 1)
    common = min(MAX_RATE, 0.5 * min(rates[name] for name in paired))
    for name, system in systems.items():
        rate = min(common, 0.5 * rates[name])
        results[name]["latency"] = latency(run_, system, rate, sizes["latency_s"])
    phase("latency")
    def kill_run(name: str, seed: int) -> Callable[[], None]:
        def go() -> None:
            n = max(20, int(rates[name] * sizes["kill_drain_s"]))
            results[name]["kills"] = under_kills(
                run_, systems[name], n, n / rates[name], 2 * LEASE_SECONDS,
                random.Random(seed),
            )
        return go

    # One system at a time: the kills must land while its own drain is under way.
    seeds = {name: run_.rng.randrange(2**32) for name in systems}
    for name in systems:
        kill_run(name, seeds[name])()
    phase("kills")
    return results


def summarise(out: dict[str, Any]) -> dict[str, Any]:
    s = out["systems"]
    mb = s["sekali_micro_batch"]["jobs_per_s_runs"]

    def over(peer: str) -> Spread | None:
        if peer not in s:
            return None
        return Interleaved(tuple(s[peer]["jobs_per_s_runs"]), tuple(mb)).ratio

    spreads = {"peers_sekali_micro_batch_over_celery": over("celery"),
               "peers_sekali_micro_batch_over_procrastinate": over("procrastinate")}
    out["headline"] = {
        **{k: None if v is None else round(v.median, 3) for k, v in spreads.items()},
        "peers_duplicates_under_kills": {
            name: {"duplicates": r["kills"]["duplicates"], "lost": r["kills"]["lost"]}
            for name, r in s.items()
        },
        "peers_latency_p50_ms": {name: r["latency"]["p50_ms"] for name, r in s.items()},
    }
    out["headline_spread"] = {k: v.as_dict() for k, v in spreads.items() if v is not None}
    rows = []
    for name, r in s.items():
        base = s.get("celery", {}).get("jobs_per_s")
        rows.append({"metric": f"{name}: send_email over a backlog", "value": r["jobs_per_s"],
                     "unit": "jobs/s", "baseline": f"celery {base}/s" if base else None,
                     "ratio": round(r["jobs_per_s"] / base, 3) if base else None,
                     "target": 1.0 if name == "sekali_micro_batch" and base else None,
                     "ok": r["jobs_per_s"] >= base if name == "sekali_micro_batch" and base
                     else None})
        lat = r["latency"]
        rows.append({"metric": f"{name}: enqueue to mail at {lat['offered_per_s']}/s, p50 "
                     f"(p99 {lat['p99_ms']} ms)", "value": lat["p50_ms"], "unit": "ms",
                     "baseline": None, "ratio": None, "target": None, "ok": None})
        k = r["kills"]
        sekali = name.startswith("sekali")
        rows.append({"metric": f"{name}: {len(k['kills'])} SIGKILLs over {k['jobs']} jobs: "
                     f"duplicates / lost", "value": f"{k['duplicates']} / {k['lost']}",
                     "unit": "mails", "baseline": f"{k['mails']} mails", "ratio": None,
                     "target": "0 / 0" if sekali else None,
                     "ok": (k["duplicates"] == 0 and k["lost"] == 0) if sekali else None})
    out["summary"] = rows
    return out


def render(results: dict[str, Any]) -> None:
    print(f"send_email side by side, {results['workers']} worker processes each")
    print(f"{'system':20}{'jobs/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'kills':>6}{'mails':>7}"
          f"{'dup':>5}{'lost':>5}")
    for name, r in results["systems"].items():
        k, lat = r["kills"], r["latency"]
        print(f"{name:20}{r['jobs_per_s']:>9.1f}{lat['p50_ms'] or 0:>9.1f}"
              f"{lat['p99_ms'] or 0:>9.1f}{len(k['kills']):>6}{k['mails']:>7}"
              f"{k['duplicates']:>5}{k['lost']:>5}")
    for name, spread in results["headline_spread"].items():
        print(f"{name}: median {spread['median']} (min {spread['min']}, max {spread['max']})")


def main() -> None:
    module_main(__doc__, run, render)


if __name__ == "__main__":
    main()
