"""The chaos harness: break sekali the way production does, then check that it stayed right.

One run (:func:`run_chaos`) sets up its own world in a temporary folder: the app database
(a SQLite file, or a fresh Postgres schema dropped afterwards), a throw-away ``redis-server``
that can be restarted, the sandbox payment gateway and mail sink, each on a free port with its
own database. A coordinator plays an at-least-once broker for P worker processes
(:mod:`proof.chaos_worker`, talking JSON lines over pipes): every request is delivered K
times, copies close together so different workers get them at once; a delivery whose worker died
or passed the visibility timeout is delivered again. Each delivery runs through the step entry
the Dagster op calls (:func:`engine.step.run_step`); a failed one is retried after the delay its
failure path decided (the shipped :class:`RetryPolicy`, with this run's ``max_attempts`` and
short delays, and the shared retry budget) or dead-lettered with its reason when the path gave
up, as Dagster follows ``RetryRequested``/``Failure`` and the run-failure sensor records it.
Meanwhile the faults strike (``FAULTS``): SIGKILL at chosen points, SIGSTOP past the lease,
Redis restarted, Postgres restarted (only when asked, and only the private cluster the run
started for its own database), gateway answers dropped after the charge, poison payloads.

The verdict (:func:`check`) comes from the sandbox's own records and the stores, never from what
workers said: charges at the gateway and mails at the sink per request, stock per cart, the
idempotency records, ``job_attempts``, the DLQ. Invariants checked (docs/design.md 1, 2, 3, 5):

- at most one effect per key (one charge, one distinct Message-ID, one reservation);
- none lost: each request completed (with its effect), dead-lettered with a reason, or still
  in progress under a live lease;
- no stale fenced write: the business row's fence equals the fence of the completing claim and
  a key has at most one ``completed`` attempt;
- every poison payload in the DLQ as permanent, never retried.

``naive=True`` runs the same workload with the defences off (no claim, no
``Idempotency-Key``, ack before work) to show what they prevent.

``delivery="resident"`` (the CLI's default, as the platform delivers every built-in job type)
replaces the broker: the workload is enqueued and resident worker processes claim it
(:class:`ResidentCoordinator`, :mod:`proof.chaos_resident`; with ``dagster=True`` each worker is
a ``sekali_worker`` run the supervisor asked for, :mod:`proof.chaos_resident_dagster`).
"""

from __future__ import annotations

import contextlib
import heapq
import json
import logging
import math
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import dagster as dg
from sqlalchemy import create_engine, make_url, text
from sqlalchemy.pool import NullPool

from engine import tags as tag
from engine.attempts import Outcome
from engine.chaos import ChaosCase
from engine.context import SEND_BOUND
from engine.delivery import DeliveryPolicy
from engine.downstreams import ClientOptions
from engine.durations import LeaseBounds
from engine.intake import enqueue
from engine.registry import JOB_TYPES, get_job_type
from engine.requests import RequestStore
from engine.upkeep.reconciliation import Reconciler
from engine.worker import WorkerTargets, give_back
from pipelines.instance import prepare_dagster_home
from proof import chaos_outbox
from proof.chaos_mix import chaos_of, mix_types, pick, seed_world
from proof.chaos_truth import (
    RECORD,
    Calibration,
    GroundTruth,
    calibrate,
    check_send_bounds,
    unverified_note,
)
from proof.chaos_typed import (
    TYPED_FAULTS,
    Sandboxes,
    effect_counter,
    environment,
    job_types_of,
    typed_payloads,
)
from proof.chaos_worker import (
    CONFIG_ENV,
    CRASH_POINTS,
    STOP_POINTS,
    WorkerConfig,
    calls_out,
)
from resources.dlq import DlqStatus, DlqStore, FailureClass, FailureInfo, dedupe_key_for
from resources.egress import ALLOW_ENV, allow_list
from resources.errors import EvictingRedis, HandlerTimedOut, SekaliError, ValidationError
from resources.idempotency import IdempotencyStore
from resources.retry import BUDGET_UNAVAILABLE
from resources.storage.db import Database
from resources.storage.json_text import masked_digest
from resources.storage.migrations import upgrade
from resources.storage.redis import memory_policies, redis_client, require_no_eviction
from resources.storage.replication import ACCEPT_ENV
from resources.storage.settings import RedisTimeouts, Settings
from sandbox.gateway import GatewayServer
from sandbox.mailsink import MailSink
from sandbox.postgres_server import PostgresServer, PostgresUnavailable
from sandbox.redis_server import RedisServer, free_port
from sandbox.tcp_proxy import TcpProxy
from sensors.workers import IN_FLIGHT, WORKER_JOB, worker_run_requests
from sensors.workers import give_back as supervisor_give_back

logger = logging.getLogger(__name__)

FAULTS = ("kill", "stop", "redis-restart", "drop-response", "poison", "pg-restart",
          "redis-freeze", "redis-rollback", "redis-failover", "slow-provider", "drip-provider",
          "clock-skew", "retention-travel", "budget-redis-down", "crash-loop",
          "poison-outbox", "evicting-redis", "pg-failover")
DEFAULT_FAULTS = ("kill", "stop", "redis-restart", "drop-response", "poison")
# Faults that run one at a time on the coordinator's background thread, at planned dispatches.
BACKGROUND_FAULTS = ("redis-restart", "pg-restart", "redis-freeze", "redis-rollback",
                     "redis-failover", "slow-provider", "drip-provider", "budget-redis-down",
                     "evicting-redis", "pg-failover")
DELIVERIES = ("per_request", "resident")
DEFAULT_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/sekali_test"


class ChaosConfigError(SekaliError):
    """The chaos options do not make sense together (say which and how to fix them)."""

    permanent = True


def parse_faults(spec: str, *, backend: str, database_url: str | None,
                 typed: bool = False) -> tuple[tuple[str, ...], list[str]]:
    """``--faults`` text to fault names. ``all`` means every fault this run can strike: all of
    :data:`FAULTS` (``typed``: of :data:`proof.chaos_typed.TYPED_FAULTS`, a ``--job-type``
    run) but ``pg-restart`` on SQLite or when the run's database is a server it did not start
    (then the second value says so). None of the faults needs root: every signal goes to a
    process the run started itself."""
    names = [f.strip() for f in spec.split(",") if f.strip()]
    notes: list[str] = []
    if "all" not in names:
        return tuple(names), notes
    out = [f for f in (TYPED_FAULTS if typed else FAULTS) if f not in ("pg-restart",
                                                                       "pg-failover")]
    if not typed:
        notes.append("pg-failover left out: name it (a private primary and an asynchronous "
                     "replica, --backend postgres; it shows duplicates wherever a first send "
                     "does not look its effect up first)")
    given = database_url or os.environ.get("DATABASE_URL")
    if backend != "postgres":
        notes.append("pg-restart left out: it needs --backend postgres")
    elif given:
        notes.append("pg-restart left out: the run's database is on a server this run did not "
                     "start (--database-url/DATABASE_URL)")
    else:
        out.append("pg-restart")
    out += [f for f in names if f != "all" and f not in out]
    return tuple(out), notes


@dataclass
class ChaosConfig:
    """One run's knobs. Defaults give a run of about a minute on a small machine."""

    requests: int = 300
    workers: int = 4
    threads: int = 2  # deliveries each worker process runs at once, on its own threads
    redelivery: int = 3
    faults: tuple[str, ...] = DEFAULT_FAULTS
    backend: str = "sqlite"
    database_url: str | None = None  # Postgres: a schema of its own is created here
    seed: int = 1
    naive: bool = False
    lease_seconds: float = 2.0
    adaptive: bool = False
    """False: every claim takes ``lease_seconds`` (the workers run with ``SEKALI_ADAPTIVE=0``),
    so the faults timed from it (stops past the lease, the stall bound) are what they say.
    True: the leases follow the observed durations as the platform's default does, up to each
    job type's ceiling, and the stall bound follows the longest ceiling."""
    timeout: float = 300.0
    max_attempts: int = 8
    kills: int | None = None  # default: about one per 40 requests, at least 3
    stops: int = 2
    redis_restarts: int = 2
    pg_restarts: int = 1
    redis_freezes: int = 1
    redis_rollbacks: int = 1
    redis_failovers: int = 1
    pg_failovers: int = 1  # pg-failover: the private primary killed, its lagging replica promoted
    provider_windows: int = 1  # per provider fault (slow-provider, drip-provider)
    budget_outages: int = 1  # budget-redis-down: the retry budget's own Redis killed, then back
    evicting_windows: int = 1  # evicting-redis: maxmemory-policy allkeys-lru, then back
    crash_loops: int = 1  # crash-loop: requests whose every run kills its worker
    crash_loop_limit: int = 2  # the workers' SEKALI_CRASH_LOOP_LIMIT (deaths before crash_loop)
    outbox_aggregates: int = 6  # poison-outbox: aggregates beside the poison one
    outbox_per_aggregate: int = 2  # poison-outbox: events per aggregate
    clock_skew: float | None = None  # seconds; default 0.4 x the lease (clocks agree within it)
    travel_days: float = 8.0  # retention-travel: how far after the run the purge runs
    travel_records: int = 4  # retention-travel: completed requests whose success report is lost
    settle: float | None = None  # the workers' settle window; default: see settle_seconds
    drop_rate: float = 0.05
    poison_rate: float = 0.04
    retry_base: float = 0.1
    retry_cap: float = 1.5
    progress: bool = False
    keep_state: bool = False
    job_types: tuple[str, ...] = ()  # --job-type: these job types, judged at their stand-ins
    # --job-type: the lookup's calibration before the fault run (proof/chaos_truth.py): this
    # many sends per key (0: none, and the verdict says the lookup is uncalibrated) for this
    # many keys of its own; require_record refuses a job type counted through its lookup
    calibration_runs: int = 3
    calibration_keys: int = 3
    require_record: bool = False
    dagster: bool = False  # --dagster: each delivery a real run of the per-request Dagster job
    # how requests reach their handler: "per_request" (a broker delivers each to the step entry
    # of the per-request op) or "resident" (enqueued; resident workers claim them)
    delivery: str = "per_request"
    batch_size: int = 4  # --delivery resident: the workers' batch

    def validate(self) -> None:
        unknown = sorted(set(self.faults) - set(FAULTS))
        if unknown:
            raise ChaosConfigError(
                f"unknown fault(s) {unknown}; choose from {', '.join(FAULTS)}, or all")
        if self.backend not in ("sqlite", "postgres"):
            raise ChaosConfigError("--backend must be sqlite or postgres")
        if self.delivery not in DELIVERIES:
            raise ChaosConfigError(f"--delivery must be one of {', '.join(DELIVERIES)}")
        if self.delivery == "resident":
            refused = [name for name, why in (
                ("--naive", self.naive), ("--job-type", bool(self.job_types)),
                ("pg-failover", "pg-failover" in self.faults)) if why]
            if refused:
                raise ChaosConfigError(
                    f"--delivery resident runs the built-in mix on resident worker processes "
                    f"(--dagster: as sekali_worker runs); {', '.join(refused)} run(s) with "
                    f"--delivery per_request")
            if self.batch_size < 1:
                raise ChaosConfigError("--batch must be >= 1")
        if self.dagster and not self.job_types and self.delivery != "resident":
            raise ChaosConfigError("--dagster runs the job types named by --job-type, or the "
                                   "built-in mix with --delivery resident")
        if self.job_types:
            job_types_of(self.job_types, ChaosConfigError)
            other = sorted(set(self.faults) - set(TYPED_FAULTS))
            if other:
                raise ChaosConfigError(
                    f"fault(s) {other} need the built-in mix (they strike the payment gateway "
                    f"or its mails); with --job-type choose from {', '.join(TYPED_FAULTS)}")
            if self.dagster and {"stop", "clock-skew"} & set(self.faults):
                raise ChaosConfigError("--dagster strikes kill, redis and Postgres faults, "
                                       "drop-response and poison; leave out stop and clock-skew")
            if self.naive:
                raise ChaosConfigError("--naive runs the built-in mix only (its effects are "
                                       "written per job type); leave out --job-type")
        if "pg-failover" in self.faults and (self.backend != "postgres" or self.database_url
                                             or os.environ.get("DATABASE_URL")):
            raise ChaosConfigError(
                "pg-failover needs --backend postgres and no --database-url/DATABASE_URL: it "
                "fails over a private primary to a replica this run starts itself")
        if "pg-restart" in self.faults:
            if self.backend != "postgres":
                raise ChaosConfigError("pg-restart needs --backend postgres (a private cluster)")
            given = self.database_url or os.environ.get("DATABASE_URL")
            if given:
                shown = make_url(given).render_as_string(hide_password=True)
                raise ChaosConfigError(
                    "pg-restart restarts only a private cluster this run starts itself (initdb "
                    f"on a free port, used as the run's database); the run's database {shown} "
                    "is on a server this run did not start, so nothing is restarted. Leave "
                    "--database-url and DATABASE_URL unset to run pg-restart."
                )
        if self.requests < 1 or self.workers < 1 or self.redelivery < 1:
            raise ChaosConfigError("--requests, --workers and --redelivery must be >= 1")
        if self.lease_seconds <= 0 or self.timeout <= 0:
            raise ChaosConfigError("--lease and --timeout must be positive")
        if self.calibration_runs < 0 or self.calibration_keys < 1:
            raise ChaosConfigError("--calibration-runs must be >= 0 and the calibration keys "
                                   ">= 1")

    @property
    def skew(self) -> float:
        if "clock-skew" not in self.faults:
            return 0.0
        return self.clock_skew if self.clock_skew is not None else 0.4 * self.lease_seconds

    @property
    def provider_faults(self) -> bool:
        return bool({"slow-provider", "drip-provider"} & set(self.faults))

    # the payment client's bounds and the provider's slowness when a provider fault is on: a
    # slow charge commits after the client's deadline, and the settle window outlasts it, the
    # latest a send written down may leave (0.4 of the lease) and the largest disagreement of
    # two workers' clocks
    GATEWAY_TIMEOUT = 1.0
    GATEWAY_DEADLINE = 2.0

    @property
    def charge_delay(self) -> float:
        return self.GATEWAY_DEADLINE + 0.5 if "slow-provider" in self.faults else 0.0

    @property
    def settle_seconds(self) -> float:
        if self.settle is not None:
            return self.settle
        return SEND_BOUND * self.lease_seconds + 0.2 + self.charge_delay + 2 * self.skew

    @property
    def kill_count(self) -> int:
        if "kill" not in self.faults:
            return 0
        return self.kills if self.kills is not None else max(3, self.requests // 40)


# -- workload ----------------------------------------------------------------------------------


@dataclass
class Request:
    """One job request of the workload and what the run saw of it."""

    id: int
    job_type: str
    payload: dict[str, Any]
    poison: bool = False
    faults: set[str] = field(default_factory=set)
    crash_loop: bool = False  # crash-loop: every run of its handler kills the worker
    struck: Counter[str] = field(default_factory=Counter)  # kill:/stop: point -> times
    deliveries: int = 0  # dispatches, redeliveries included

    @property
    def row_id(self) -> int:
        """The id the stores know it by: from 1, as ``job_requests`` ids (the op refuses 0)."""
        return self.id + 1


def build_workload(config: ChaosConfig) -> list[Request]:
    """The built-in mix (:mod:`proof.chaos_mix`: each request's type by its roll, its payload
    from the type's ``sample``); poison payloads when asked. With
    ``job_types``: those job types' examples, varied (:func:`proof.chaos_typed.typed_payloads`).
    """
    rng = random.Random(config.seed)
    poison_rate = config.poison_rate if "poison" in config.faults else 0.0
    if config.job_types:
        job_types = job_types_of(config.job_types, ChaosConfigError)
        try:
            made = typed_payloads(job_types, config.requests, seed=config.seed,
                                  poison_rate=poison_rate)
        except ValueError as exc:
            raise ChaosConfigError(str(exc)) from exc
        return _crash_loops(config, [Request(i, name, payload, poison)
                                     for i, (name, payload, poison) in enumerate(made)])
    out = []
    mix = mix_types()
    for i in range(config.requests):
        roll = rng.random()
        poison = rng.random() < poison_rate
        jt = pick(mix, roll)
        sample = chaos_of(jt).sample
        assert sample is not None  # ChaosProof refuses a band without one
        out.append(Request(i, jt.name, sample(i, poison), poison))
    return _crash_loops(config, out)


_REPLAYED_STAT = {"retention-travel": "travel_replayed", "evicting-redis": "eviction_replayed",
                  "crash-loop": "crash_loop_replayed"}
"""The stat that counts the records an operator's replay after ``fault`` claimed."""


def seed_stock(db: Database, requests: list[Request]) -> None:
    """What the built-in mix's valid requests need before the run (stock), as each job type
    seeds it (:func:`proof.chaos_mix.seed_world`)."""
    seed_world(db, [(r.job_type, r.payload, r.poison) for r in requests])


def _crash_loops(config: ChaosConfig, requests: list[Request]) -> list[Request]:
    """crash-loop: mark ``config.crash_loops`` valid requests whose effect goes through a
    hooked client (not one whose effect is a transaction of its own) as crashers."""
    if "crash-loop" not in config.faults:
        return requests
    able = [r for r in requests if not r.poison and calls_out(r.job_type)]
    for req in random.Random(config.seed + 5).sample(able, min(config.crash_loops, len(able))):
        req.crash_loop = True
    return requests


@dataclass
class Delivery:
    id: int
    request: int
    attempts: int = 0
    retries: int = 0  # requeued after a failure it reported (not after a death or timeout)
    waits: int = 0  # of those, waits for a payment's settle window (PaymentNotSettled)
    ready_at: float = 0.0
    tok: str | None = None  # the current dispatch
    settled: str | None = None  # "done" | "dead_lettered"
    history: list[str] = field(default_factory=list)


def delivery_order(requests: list[Request], redelivery: int, seed: int, workers: int) -> list[
    tuple[int, int]
]:
    """``(request, copy)`` pairs in queue order: copies of a request land close together, so
    different workers get them at the same time; a few copies come much later."""
    rng = random.Random(seed + 1)
    spread = max(2, workers)
    keyed = []
    for req in requests:
        for copy in range(redelivery):
            late = copy > 0 and rng.random() < 0.2
            pos = req.id + (rng.uniform(0, len(requests) * 0.5) if late else rng.uniform(0, spread))
            keyed.append((pos, req.id, copy))
    keyed.sort()
    return [(r, c) for _, r, c in keyed]


# -- the world a run needs ---------------------------------------------------------------------


class ChaosWorld:
    """Everything a run stands up, and takes down again: state dir, app DB, Redis, gateway,
    mail sink. Use as a context manager."""

    def __init__(self, config: ChaosConfig) -> None:
        self.config = config
        self.state = Path(tempfile.mkdtemp(prefix="sekali-chaos-"))
        self.schema: str | None = None
        self.base_pg_url: str | None = None
        self.pg: PostgresServer | None = None  # the private cluster, with pg-restart only
        self.pg_replica: PostgresServer | None = None  # pg-failover: the lagging standby
        self.pg_proxy: TcpProxy | None = None  # pg-failover: where workers reach Postgres
        self.pg_link: TcpProxy | None = None  # pg-failover: the replica's replication link
        self.pg_retired: list[PostgresServer] = []
        self.pg_failovers = 0
        self._accepted: str | None = None
        self.pg_start_times: list[Any] = []  # pg_postmaster_start_time() after start, restarts
        self.database_url = ""
        self.redis: Any = None  # the current Redis primary
        self.replica: Any = None  # with redis-failover: its replica, behind self.proxy
        self.proxy: TcpProxy | None = None
        self.retired: list[Any] = []  # failed-over primaries (stopped)
        self.failovers = 0
        self.gateway: Any = None
        self.sink: Any = None
        self.sandboxes: Sandboxes | None = None  # --job-type: the declared stand-ins
        self.budget_redis: Any = None  # budget-redis-down: the retry budget's own Redis
        self.outbox_events: list[str] = []  # poison-outbox: the business's events, in order
        self.evicting = False  # evicting-redis: the policy is allkeys-lru now
        self.eviction_refused = 0
        self.eviction_seen = 0
        self.db: Any = None

    def __enter__(self) -> ChaosWorld:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        cfg = self.config
        if cfg.backend == "postgres":
            self.base_pg_url = (cfg.database_url or os.environ.get("DATABASE_URL")
                                or os.environ.get("SEKALI_TEST_PG_URL") or DEFAULT_PG_URL)
            if "pg-restart" in cfg.faults or "pg-failover" in cfg.faults:
                self.base_pg_url = self._start_private_cluster()  # validate() refused a URL
            if "pg-failover" in cfg.faults:
                self.base_pg_url = self._start_pg_replica()
            self.schema = "chaos_" + uuid.uuid4().hex[:12]
            engine = create_engine(self.base_pg_url, isolation_level="AUTOCOMMIT")
            with engine.connect() as conn:
                conn.execute(text(f"CREATE SCHEMA {self.schema}"))
            engine.dispose()
            sep = "&" if "?" in self.base_pg_url else "?"
            self.database_url = f"{self.base_pg_url}{sep}options=-csearch_path%3D{self.schema}"
        else:
            self.database_url = f"sqlite:///{self.state / 'app.db'}"
        self.db = Database.from_url(self.database_url)
        upgrade(self.db)
        if "poison-outbox" in cfg.faults:
            self.outbox_events = chaos_outbox.write_events(
                self.db, aggregates=cfg.outbox_aggregates, per=cfg.outbox_per_aggregate)
        if self.pg is not None:
            self.pg_start_times.append(self.postmaster_start_time())
        self.redis = RedisServer(self.state / "redis", port=free_port()).start()
        if "budget-redis-down" in cfg.faults:
            self.budget_redis = RedisServer(self.state / "budget-redis", port=free_port()).start()
        if "redis-failover" in cfg.faults:
            self._start_replica()
            self.proxy = TcpProxy(self.redis.port).start()
        if cfg.job_types:
            types = job_types_of(cfg.job_types, ChaosConfigError)
            self.sandboxes = Sandboxes(types, self.state / "sandbox")
            (self.state / "sandbox").mkdir()
            self.sandboxes.start()
            if cfg.dagster:
                prepare_dagster_home(self.state / "dagster")
            return
        self.gateway = GatewayServer(
            f"sqlite:///{self.state / 'gateway.db'}",
            honour_idempotency_key=not cfg.naive,
            drop_after_charge_rate=cfg.drop_rate if "drop-response" in cfg.faults else 0.0,
            seed=cfg.seed,
        ).start()
        os.environ[ALLOW_ENV] = allow_list([self.gateway.url])  # the workers' and ours
        self.sink = MailSink(f"sqlite:///{(self.state / 'mailsink.db').resolve()}").start()
        if cfg.dagster:
            prepare_dagster_home(self.state / "dagster")

    @property
    def redis_url(self) -> str:
        """Where workers find Redis: the primary, or the proxy in front of it (failover)."""
        if self.proxy is not None:
            return f"redis://:{self.redis.password}@127.0.0.1:{self.proxy.port}/0"
        return str(self.redis.url)

    def _start_replica(self) -> None:
        self.replica = RedisServer(self.state / f"redis-replica-{self.failovers}",
                                   port=free_port(), replica_of=self.redis.port,
                                   password=self.redis.password).start()

    def _replica_in_sync(self, timeout: float = 10.0) -> bool:
        client = self.replica.client()
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                info = client.info("replication")
                if info.get("master_link_status") == "up" and not info.get(
                        "master_sync_in_progress"):
                    return True
                time.sleep(0.1)
            return False
        finally:
            client.close()

    def budget_outage(
        self, seconds: float, *, struck: Callable[[], bool] = lambda: True,
        longest: float | None = None,
    ) -> None:
        """budget-redis-down: SIGKILL the retry budget's Redis (every decision asking it now
        meets a refused connection or a reset mid-call), start it again ``seconds`` later, or,
        while no decision has met it yet (``struck``), up to ``longest`` seconds later."""
        self.budget_redis.process.kill()
        self.budget_redis.process.wait()
        began = time.monotonic()
        until = began + max(seconds, longest or seconds)
        while time.monotonic() < until and not (
                time.monotonic() - began >= seconds and struck()):
            time.sleep(0.1)
        self.budget_redis.start()

    def evicting_window(self, seconds: float) -> None:
        """evicting-redis: switch the Redis primary to ``allkeys-lru`` for ``seconds``, then
        back to ``noeviction``. Meanwhile a client's first use must refuse it (the shipped
        :func:`require_no_eviction`, as a worker started now would) and the doctor's reading
        (:func:`memory_policies`) must see it; counted in ``eviction_refused`` and
        ``eviction_seen``."""
        server = self.redis
        server.config_set("maxmemory-policy", "allkeys-lru")
        self.evicting = True
        try:
            client = redis_client(self.redis_url, timeouts=RedisTimeouts(socket=2.0, connect=1.0))
            try:
                self.eviction_seen += sum(1 for n in memory_policies(client) if n.evicts)
                try:
                    require_no_eviction(client, "locks")
                except EvictingRedis:
                    self.eviction_refused += 1
            finally:
                client.close()
            time.sleep(seconds)
        finally:
            server.config_set("maxmemory-policy", "noeviction")
            self.evicting = False

    def freeze_redis(self, seconds: float) -> None:
        """SIGSTOP the Redis primary for ``seconds``, then SIGCONT: a frozen server (a VM
        paused, a disk stall) that keeps its connections open and answers nothing."""
        pid = self.redis.process.pid
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            os.kill(pid, signal.SIGCONT)

    def rollback_redis(self, gap: float) -> None:
        """Snapshot Redis now, let the run go on for ``gap`` seconds, then restart Redis from
        that snapshot: every write of the gap (lock grants, fence counters, cache versions) is
        lost and what the snapshot held comes back."""
        snapshot = self.redis.snapshot(self.state / f"rollback-{uuid.uuid4().hex[:6]}.rdb")
        time.sleep(gap)
        self.redis.restart_from(snapshot)

    def failover_redis(self, lag: float) -> None:
        """Fail over to a replica that has not caught up: replication stops (the replica is
        frozen), the run writes to the primary for ``lag`` seconds, the primary dies with those
        writes, the replica is promoted and the proxy points every client at it (open
        connections are closed). A fresh replica of the new primary is started for the next."""
        if not self._replica_in_sync():
            raise RuntimeError("the Redis replica never caught up before the failover")
        old, new = self.redis, self.replica
        os.kill(new.process.pid, signal.SIGSTOP)
        try:
            time.sleep(lag)
            old.process.kill()
            old.process.wait()
        finally:
            os.kill(new.process.pid, signal.SIGCONT)
        new.promote()
        self.redis = new
        assert self.proxy is not None
        self.proxy.retarget(new.port)
        self.retired.append(old)
        self.failovers += 1
        self._start_replica()

    def provider_window(self, seconds: float, **faults: Any) -> int:
        """The gateway misbehaves as ``faults`` say for ``seconds``; returns the charges it
        took meanwhile (a slow one commits after its client gave up: counted after the delay)."""
        before = len(self.gateway.charges())
        old = self.gateway.faults_snapshot()
        self.gateway.set_faults(**faults)
        try:
            time.sleep(seconds)
        finally:
            self.gateway.set_faults(**{name: getattr(old, name) for name in faults})
        time.sleep(faults.get("charge_delay_ms", 0.0) / 1000)
        return len(self.gateway.charges()) - before

    def _start_pg_replica(self) -> str:
        """pg-failover: a streaming replica of the private cluster, and a TCP proxy every
        client reaches the primary through (so a failover moves them all); the workers accept
        the asynchronous replication they are run on (``SEKALI_ACCEPT_ASYNC_REPLICATION``)."""
        assert self.pg is not None
        self.pg_link = TcpProxy(self.pg.port).start()
        try:
            self.pg_replica = self.pg.replica(prefix="sekali-chaos-pg-replica-",
                                              through=self.pg_link.port)
        except PostgresUnavailable as exc:
            raise ChaosConfigError(f"pg-failover needs a streaming replica: {exc}") from exc
        self.pg_proxy = TcpProxy(self.pg.port).start()
        self._accepted = os.environ.get(ACCEPT_ENV)
        os.environ[ACCEPT_ENV] = "1"
        return self.pg.url().replace(f":{self.pg.port}/", f":{self.pg_proxy.port}/")

    def failover_postgres(self, lag: float) -> None:
        """The replica's replication link cut (it receives nothing more), ``lag`` seconds of the
        run writing to the primary alone (commits that return at once: asynchronous
        replication), the primary SIGKILLed, the replica promoted, the proxy pointed at it
        (open connections closed). Completed keys of those seconds are gone from the database;
        their effects at the gateway and the mail sink stay. From here the gateway ignores
        idempotency keys (a provider without key support), so only a first send that looks up
        first can find them.
        """
        assert self.pg is not None and self.pg_replica is not None and self.pg_proxy is not None
        assert self.pg_link is not None
        deadline = time.monotonic() + 30
        while self.pg.lag_bytes() is None and time.monotonic() < deadline:  # not streaming yet
            time.sleep(0.1)
        if self.gateway is not None:
            self.gateway.set_faults(honour_idempotency_key=False)
        old, new = self.pg, self.pg_replica
        self.pg_link.stop()
        time.sleep(lag)
        old.kill()
        new.promote()
        self.pg, self.pg_replica = new, None
        self.pg_proxy.retarget(new.port)
        self.pg_retired.append(old)
        self.pg_failovers += 1

    def _start_private_cluster(self) -> str:
        try:
            self.pg = PostgresServer(prefix="sekali-chaos-pg-").start()
        except PostgresUnavailable as exc:
            raise ChaosConfigError(f"pg-restart needs a private PostgreSQL cluster: {exc}") from exc
        return self.pg.url()

    def _ask_database(self, sql: str) -> Any:
        """One value from the run's own database, on a connection of its own."""
        engine = create_engine(self.database_url, poolclass=NullPool,
                               connect_args={"connect_timeout": 5})
        try:
            with engine.connect() as conn:
                return conn.execute(text(sql)).one()
        finally:
            engine.dispose()

    def postmaster_start_time(self) -> Any:
        """When the server behind the run's database last started, as that server says."""
        return self._ask_database("SELECT pg_postmaster_start_time()")[0]

    def restart_postgres(self) -> None:
        """Restart the private cluster, after proving it is the server of the run's database:
        the data directory and port that the run's database reports must be the cluster's."""
        if self.pg is None:
            raise ChaosConfigError("pg-restart without the run's private cluster: refused")
        data_dir, port = self._ask_database(
            "SELECT current_setting('data_directory'), inet_server_port()"
        )
        if (os.path.realpath(data_dir), port) != (os.path.realpath(self.pg.data_dir), self.pg.port):
            raise ChaosConfigError(
                f"the run's database is served from {data_dir} on port {port}, not by the run's "
                f"private cluster ({self.pg.data_dir}, port {self.pg.port}): not restarting it"
            )
        self.pg.restart()
        self.pg_start_times.append(self.postmaster_start_time())

    def pg_restarts_seen(self) -> int:
        """Restarts the run's database saw: how often its postmaster start time changed."""
        times = self.pg_start_times
        return sum(1 for before, after in zip(times, times[1:], strict=False) if after != before)

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        for link in (self.pg_proxy, self.pg_link):
            if link is not None:
                link.stop()
        for cluster in (self.pg_replica, *self.pg_retired):
            if cluster is not None:
                with contextlib.suppress(Exception):
                    cluster.stop()
        if self.pg_proxy is not None:
            if self._accepted is None:
                os.environ.pop(ACCEPT_ENV, None)
            else:
                os.environ[ACCEPT_ENV] = self._accepted
        if self.sandboxes is not None:
            self.sandboxes.stop()
        for part in (self.sink, self.gateway, self.redis, self.replica, self.budget_redis,
                     *self.retired):
            if part is not None:
                with contextlib.suppress(Exception):
                    part.stop()
        if self.db is not None:
            self.db.dispose()
        if self.pg is not None:  # the schema goes with the cluster
            self.pg.stop()
            self.pg = None
            self.schema = None
        if self.schema is not None and self.base_pg_url is not None:
            with contextlib.suppress(Exception):
                engine = create_engine(self.base_pg_url, isolation_level="AUTOCOMMIT")
                with engine.connect() as conn:
                    conn.execute(text(f"DROP SCHEMA IF EXISTS {self.schema} CASCADE"))
                engine.dispose()
            self.schema = None
        if not self.config.keep_state:
            shutil.rmtree(self.state, ignore_errors=True)

    def seed_stock(self, requests: list[Request]) -> None:
        if not self.config.job_types:
            seed_stock(self.db, requests)

    def worker_config(self, worker_id: int) -> WorkerConfig:
        cfg = self.config
        typed = self.sandboxes is not None
        return WorkerConfig(
            worker_id=worker_id,
            database_url=self.database_url,
            redis_url=self.redis_url,
            gateway_url="" if typed else self.gateway.url,
            smtp_host="" if typed else self.sink.host,
            smtp_port=0 if typed else self.sink.port,
            smtp_log_url="" if typed else self.sink.db_url,
            job_types=cfg.job_types,
            env={**(self.sandboxes.env if self.sandboxes is not None else {}),
                 "SEKALI_ADAPTIVE": "1" if cfg.adaptive else "0"},
            dagster_home=str((self.state / "dagster").resolve()) if cfg.dagster else "",
            budget_redis_url=str(self.budget_redis.url) if self.budget_redis is not None else "",
            crash_loop_limit=cfg.crash_loop_limit,
            outbox_relay="poison-outbox" in cfg.faults,
            lease_seconds=cfg.lease_seconds,
            naive=cfg.naive,
            max_attempts=cfg.max_attempts,
            retry_base=cfg.retry_base,
            retry_cap=cfg.retry_cap,
            threads=1 if cfg.dagster else cfg.threads,  # one run at a time per process
            settle_seconds=cfg.settle_seconds,
            gateway_timeout=cfg.GATEWAY_TIMEOUT if cfg.provider_faults else None,
            gateway_deadline=cfg.GATEWAY_DEADLINE if cfg.provider_faults else None,
            clock_offset=self.clock_offset(worker_id),
        )

    def clock_offset(self, worker_id: int) -> float:
        """clock-skew: worker 0's wall clock runs ahead, worker 1's behind, the others true."""
        return {0: self.config.skew, 1: -self.config.skew}.get(worker_id, 0.0)


# -- workers -----------------------------------------------------------------------------------


class WorkerProcess:
    """One ``proof.chaos_worker`` process and the thread that reads its reports."""

    def __init__(self, wid: int, generation: int, config: WorkerConfig, events: queue.Queue[Any],
                 log_dir: Path, module: str | None = None) -> None:
        self.wid = wid
        self.generation = generation
        self.state = "starting"  # starting | running | stopped | dead
        self.capacity = config.threads
        self.inflight: dict[str, float] = {}  # tok -> when sent (or when it last woke up)
        self.overdue: set[str] = set()  # past the visibility timeout, already redelivered
        self.cont_at = 0.0
        self.stopped_delivery: int | None = None
        self.stopped_fence = 0
        self.sent: list[str] = []
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("SEKALI_CRASH_AT", None)
        self.log = open(log_dir / f"worker-{wid}-{generation}.log", "wb")  # noqa: SIM115
        self.clock_offset = config.clock_offset
        skewed = ["-m", "proof.skewed_clock", repr(config.clock_offset)] if config.clock_offset \
            else ["-m"]
        module = module or ("proof.chaos_dagster" if config.dagster_home
                            else "proof.chaos_worker")
        self.proc = subprocess.Popen(
            [sys.executable, *skewed, module],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
            env={**env, CONFIG_ENV: config.to_json()},
        )
        self._reader = threading.Thread(target=self._read, args=(events,), daemon=True)
        self._reader.start()

    def _read(self, events: queue.Queue[Any]) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                events.put((self.wid, self.generation, json.loads(raw)))
            except ValueError:
                continue
        self.proc.wait()
        events.put((self.wid, self.generation, None))

    def send(self, msg: dict[str, Any]) -> bool:
        stdin: IO[bytes] | None = self.proc.stdin
        try:
            assert stdin is not None
            stdin.write((json.dumps(msg) + "\n").encode())
            stdin.flush()
            return True
        except (BrokenPipeError, OSError, ValueError):
            return False

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, sig)

    def close(self, timeout: float = 5.0) -> None:
        self.send({"t": "exit"})
        with contextlib.suppress(Exception):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# -- the broker --------------------------------------------------------------------------------


NO_ANSWER_HINT = "gave no answer"  # GatewayUnavailable after a dropped response


def _lane(fault: str) -> str:
    if fault == "budget-redis-down":
        return "budget"
    return "provider" if fault in ("slow-provider", "drip-provider") else "servers"


def adaptive_stall_bound(job_types: Iterable[str]) -> float:
    """With adaptive leases a dead holder's key is taken over once the lease in force runs
    out, which may be as long as its job type's ceiling (its declared one, else its
    ``max_runtime_seconds``): twice the longest ceiling of the run's job types, at least 60 s."""
    runs = [get_job_type(name).running for name in job_types]
    ceilings = [(run.lease or LeaseBounds()).ceiling_for(float(run.max_runtime_seconds))
                for run in runs]
    return max(60.0, 2 * max(ceilings, default=0.0))


class Coordinator:
    """An at-least-once broker for the workers, with the fault schedule. Single-threaded: every
    report arrives on one queue, so the state below needs no locks."""

    def __init__(self, config: ChaosConfig, world: ChaosWorld, requests: list[Request]) -> None:
        self.config = config
        self.world = world
        self.requests = requests
        self.dlq = DlqStore(world.db)
        self.rng = random.Random(config.seed + 2)
        self.events: queue.Queue[Any] = queue.Queue()
        order = delivery_order(requests, config.redelivery, config.seed, config.workers)
        self.deliveries = [Delivery(i, r) for i, (r, _copy) in enumerate(order)]
        # first deliveries in queue order; redeliveries by the time they become visible again,
        # served first once due (a broker's visibility timeout or delay, not the queue's tail)
        self.fresh: deque[int] = deque(range(len(order)))
        self.ready: list[tuple[float, int, int]] = []
        self.seq = len(order)
        self.by_tok: dict[str, Delivery] = {}
        self.done_requests: set[int] = set()
        self.workers: dict[int, WorkerProcess] = {}
        self.generation = 0
        self.stats: Counter[str] = Counter()
        self.late: list[dict[str, Any]] = []
        self.dispatches = 0
        self.t0 = time.monotonic()
        self.visibility = 4 * config.lease_seconds + 5.0
        if config.dagster:  # a run retries inside itself, and starting one takes seconds
            self.visibility += config.max_attempts * config.retry_cap + 20.0
        # every delivery must end (done or fail) within this, frozen workers aside: a worker
        # cut off from a server gives up within about one production lease (60 s)
        self.stall_bound = (adaptive_stall_bound({r.job_type for r in requests})
                            if config.adaptive else 60.0)
        self.longest = 0.0
        self.unbounded: list[str] = []
        # a plain read connection with a short timeout: on SQLite the app Database begins
        # every transaction IMMEDIATE (a write lock), which a read here must not wait for
        sqlite = world.database_url.startswith("sqlite")
        self.probe = create_engine(
            world.database_url, poolclass=NullPool,
            connect_args={"timeout": 2} if sqlite else {"connect_timeout": 2},
        )
        self._plan_faults()

    # fault schedule: fractions of the expected dispatches at which each fault strikes
    def _plan_faults(self) -> None:
        cfg = self.config
        total = self._plan_total()
        rng = self.rng
        self.kill_at = sorted(int(total * rng.uniform(0.05, 0.85)) for _ in range(cfg.kill_count))
        n_stops = cfg.stops if "stop" in cfg.faults else 0
        self.stop_at = sorted(int(total * rng.uniform(0.1, 0.7)) for _ in range(n_stops))
        counts = {"redis-restart": cfg.redis_restarts, "pg-restart": cfg.pg_restarts,
                  "redis-freeze": cfg.redis_freezes, "redis-rollback": cfg.redis_rollbacks,
                  "redis-failover": cfg.redis_failovers, "slow-provider": cfg.provider_windows,
                  "drip-provider": cfg.provider_windows,
                  "budget-redis-down": cfg.budget_outages, "pg-failover": cfg.pg_failovers,
                  "evicting-redis": cfg.evicting_windows}
        # each background fault at evenly spread points, the faults interleaved so that one
        # waiting for another (they run one at a time) still strikes well inside the run
        self.due: dict[str, list[int]] = {}
        active = [f for f in BACKGROUND_FAULTS if f in cfg.faults]
        for k, name in enumerate(active):
            n = counts[name] if name in cfg.faults else 0
            shift = (k + 0.5) / (len(active) + 1) - 0.5
            self.due[name] = sorted(
                int(total * min(0.85, max(0.05, (i + 1 + shift) / (n + 1)))) for i in range(n))
        self.redis_at = self.due.get("redis-restart", [])
        self.pg_at = self.due.get("pg-restart", [])
        self.scheduled = {"kills": len(self.kill_at), "stops": n_stops,
                          **{name: len(at) for name, at in self.due.items()}}
        if "clock-skew" in cfg.faults:
            self.scheduled["clock-skew"] = sum(
                1 for wid in range(cfg.workers) if self.world.clock_offset(wid))
        if "retention-travel" in cfg.faults:
            self.scheduled["retention-travel"] = 1
        self.scheduled["crash-loop"] = sum(1 for r in self.requests if r.crash_loop)
        self.scheduled["poison-outbox"] = int("poison-outbox" in cfg.faults)
        self.skew_struck: set[int] = set()  # skewed workers that finished a delivery
        self.replays: dict[int, int] = {}  # delivery -> DLQ record it replays (retention-travel)
        self.travelled: dict[str, Any] = {}  # the ledger just before the purge "days later"
        self.published_before_purge: set[str] = set()  # outbox events published by then
        self.pending_kills: list[str] = []
        self.untouched = sum(1 for r in self.requests if self._carries(r))
        """Requests that can carry a kill or a stop (:meth:`_carries`), never dispatched."""
        self.evicted: list[int] = []  # evicting-redis: requests refused, replayed once restored
        self.failovers_handled = 0  # pg-failover: failovers whose rolled-back work went again
        self.armed: dict[str, tuple[str, str]] = {}  # tok -> (crash | stop, point)
        self.stopped_toks: set[str] = set()
        self.stop_log: list[dict[str, Any]] = []
        self.pending_stops = 0
        self.restart_windows: list[tuple[str, float, float]] = []
        # background faults under way, per lane: the servers (Redis, Postgres) one at a time,
        # the provider beside them (name, thread)
        self._running: dict[str, tuple[str, threading.Thread]] = {}

    def _worker_count(self) -> int:
        return self.config.workers

    def _plan_total(self) -> int:
        """What the fault schedule counts in: dispatches."""
        return len(self.deliveries)

    def _row_of(self, req: Request) -> int:
        """The id the stores know ``req`` by."""
        return req.row_id

    # -- workers
    def _spawn(self, wid: int) -> None:
        self.generation += 1
        self.workers[wid] = WorkerProcess(
            wid, self.generation, self.world.worker_config(wid), self.events, self.world.state
        )

    def _dispatch(self, now: float) -> None:
        if self.evicted and not self.world.evicting:
            self._replay_evicted()
        if self.world.pg_failovers > self.failovers_handled:
            self._redeliver_rolled_back()
        for w in self.workers.values():
            # a crash-looping request runs alone in its process, as a run does in its own
            # (its deaths must not count against neighbours on the process's other threads)
            while (w.state == "running" and len(w.inflight) < w.capacity
                   and not any(self.armed.get(t, ("", ""))[0] == "loop" for t in w.inflight)):
                if self.ready and self.ready[0][0] <= now:
                    item = heapq.heappop(self.ready)
                    did = item[2]
                    if w.inflight and self._loops(did):
                        heapq.heappush(self.ready, item)
                        break
                elif self.fresh:
                    did = self.fresh.popleft()
                    if w.inflight and self._loops(did):
                        self.fresh.appendleft(did)
                        break
                else:
                    break
                self._dispatch_one(w, did, now)

    def _loops(self, did: int) -> bool:
        req = self.requests[self.deliveries[did].request]
        return req.crash_loop and req.id not in self.done_requests

    def _dispatch_one(self, w: WorkerProcess, did: int, now: float) -> None:
        d = self.deliveries[did]
        if d.settled is not None:
            return
        req = self.requests[d.request]
        self._arm_faults_due()
        self._deliver(req)
        d.attempts += 1
        d.tok = f"{d.id}.{d.attempts}"
        self.by_tok[d.tok] = d
        msg: dict[str, Any] = {
            "tok": d.tok, "req": req.id, "request_id": req.row_id, "job_type": req.job_type,
            "payload": req.payload, "attempt": d.attempts - 1,
        }
        fresh = req.id not in self.done_requests and not req.poison and not req.crash_loop
        if req.crash_loop and req.id not in self.done_requests:
            # its handler kills the worker every time it runs (os._exit, out of memory)
            msg["crash"] = "before_effect"
            self.armed[d.tok] = ("loop", msg["crash"])
        elif self.pending_kills and fresh and self._carries(req):
            msg["crash"] = self.pending_kills.pop()
            self.armed[d.tok] = ("crash", msg["crash"])
        elif self.pending_stops and fresh and not self._stop_under_way() and self._carries(req):
            self.pending_stops -= 1
            msg["stop"] = STOP_POINTS[self.stats["stops_armed"] % len(STOP_POINTS)]
            self.stats["stops_armed"] += 1
            self.armed[d.tok] = ("stop", msg["stop"])
        budget_down = "budget-redis-down" in self._active_faults(now)
        if (self.config.job_types and fresh and "crash" not in msg and (budget_down or (
                "drop-response" in self.config.faults
                and self.rng.random() < self.config.drop_rate))):
            # the effect call's answer is lost (struck: "dropped"); while the budget's Redis is
            # down every fresh delivery's is, so that retry decisions ask the dead budget
            msg["drop"] = True
        req.faults.update(self._active_faults(now))
        if w.clock_offset:
            req.faults.add("clock-skew")
        self.dispatches += 1
        w.inflight[d.tok] = now
        w.sent.append(d.tok)
        d.history.append(f"w{w.wid}@{now - self.t0:.1f}")
        if not w.send(msg):
            self._worker_gone(w)

    def _deliver(self, req: Request) -> None:
        """Count a delivery of ``req`` (a dispatch, a claim): its first one touches it."""
        if req.deliveries == 0 and self._carries(req):
            self.untouched -= 1
        req.deliveries += 1

    def _carry_margin(self) -> int:
        """Untouched requests kept for each kill or stop still to come (see
        :meth:`_arm_faults_due`)."""
        return 2

    def _carries(self, req: Request) -> bool:
        """Whether a kill or a stop armed on a delivery of ``req`` reaches its point: not on
        a poison or crash-looping request, nor on one whose effect is a transaction of its own
        with no downstream call to stop or kill around (:func:`calls_out`)."""
        return not req.poison and not req.crash_loop and bool(
            self.config.job_types or calls_out(req.job_type))

    def _stop_under_way(self) -> bool:
        """One stop at a time: a second frozen worker could hold the very redelivery that is
        to take the first one's key over."""
        return any(kind == "stop" for kind, _ in self.armed.values()) or any(
            w.state == "stopped" for w in self.workers.values())

    def _arm_faults_due(self) -> None:
        """Arm each kill and stop whose dispatch has come, or earlier once fewer than two
        untouched requests that could carry one are left for each still to come: a delivery
        that finds its request done (a duplicate) or its key held by a copy delivered beside it
        reaches no point, so a kill planned late in a small run could otherwise find only such
        deliveries and never strike (the second request is for a kill that found the first
        one's key held)."""
        n, margin = self.dispatches, self._carry_margin()
        while self.kill_at and (
                self.kill_at[0] <= n
                or self.untouched <= margin * (len(self.kill_at) + len(self.stop_at))):
            self.kill_at.pop(0)
            self.pending_kills.insert(0, CRASH_POINTS[self.stats["kills_planned"] % 3])
            self.stats["kills_planned"] += 1
        while self.stop_at and (self.stop_at[0] <= n
                                or self.untouched <= margin * len(self.stop_at)):
            self.stop_at.pop(0)
            self.pending_stops += 1
        self._start_due(n)

    def _start_due(self, upto: float, *, after_settle: bool = False) -> bool:
        """Start each background fault due by dispatch ``upto`` whose lane is free (one fault
        per lane at a time; ``after_settle`` counts it as ``<fault>_after_settle``). True when
        any background fault was still due."""
        pending = False
        for name, due in self.due.items():
            if not due:
                continue
            pending = True
            if due[0] <= upto and _lane(name) not in self._running:
                due.pop(0)
                if after_settle:
                    self.stats[f"{name}_after_settle"] += 1
                self._start_restart(name, self._background_action(name))
        return pending

    def _background_action(self, name: str) -> Callable[[], None]:
        cfg, world = self.config, self.world
        outage = 2 * cfg.lease_seconds + 1.0  # past every lease
        if name == "redis-restart":
            return lambda: world.redis.restart()
        if name == "budget-redis-down":
            return lambda: world.budget_outage(
                3 * cfg.lease_seconds, longest=12 * cfg.lease_seconds,
                struck=lambda: self.stats["budget_unavailable_decisions"] > 0)
        if name == "evicting-redis":
            return lambda: world.evicting_window(3 * cfg.lease_seconds)
        if name == "pg-restart":
            return world.restart_postgres
        if name == "redis-freeze":
            return lambda: world.freeze_redis(outage)
        if name == "redis-rollback":  # the writes of one lease are lost
            return lambda: world.rollback_redis(cfg.lease_seconds)
        if name == "redis-failover":  # the replica lags by one lease
            return lambda: world.failover_redis(cfg.lease_seconds)
        if name == "pg-failover":  # the replica misses 1.5 leases of commits
            return lambda: world.failover_postgres(1.5 * cfg.lease_seconds)
        faults: dict[str, Any] = (
            {"charge_delay_ms": cfg.charge_delay * 1000, "honour_idempotency_key": False}
            if name == "slow-provider" else {"drip_ms": 200.0})

        def window() -> None:
            self.stats[f"{name}_charges"] += world.provider_window(1.5 * cfg.lease_seconds,
                                                                   **faults)
        return window

    def _start_restart(self, name: str, action: Callable[[], None]) -> None:
        began = time.monotonic()

        def run() -> None:
            try:
                action()
            except Exception as exc:  # noqa: BLE001 - reported, the run goes on
                logger.error("%s failed: %s", name, exc)
                self.stats[f"{name}_failed"] += 1
            self.restart_windows.append((name, began, time.monotonic() + 0.5))
            self._running.pop(_lane(name), None)

        self.stats[name] += 1
        thread = threading.Thread(target=run, daemon=True)
        self._running[_lane(name)] = (name, thread)
        thread.start()

    def _active_faults(self, now: float) -> set[str]:
        """The background faults under way now, or ended less than half a second ago."""
        active = {name for name, _ in list(self._running.values())}
        for name, start, end in self.restart_windows:
            if start <= now <= end:
                active.add(name)
        return active

    # -- reports
    def _on_event(self, wid: int, gen: int, msg: dict[str, Any] | None) -> None:
        w = self.workers.get(wid)
        if w is None or w.generation != gen:
            return
        if msg is None:
            self._worker_gone(w)
            return
        kind = msg["t"]
        if kind == "ready":
            w.state = "running"
            return
        tok = msg.get("tok", "")
        d = self.by_tok.get(tok)
        if d is None:
            return
        current = d.tok == tok and d.settled is None
        if kind == "start":
            return
        if kind == "stopping":
            self.stats["stops"] += 1
            self.stopped_toks.add(tok)
            self.armed.pop(tok, None)
            self.requests[d.request].faults.add(f"stop:{msg.get('point')}")
            self.requests[d.request].struck[f"stop:{msg.get('point')}"] += 1
            w.state = "stopped"
            w.stopped_delivery = d.id
            w.stopped_fence = self._key_state(d.request)[0]
            now = time.monotonic()
            w.cont_at = now + 2 * self.config.lease_seconds + 0.5
            if current:  # the broker's visibility timeout, made to pass now
                self._requeue(d, now + self.config.lease_seconds + 0.1, "stopped")
            return
        if kind == "resumed":
            return
        if kind == "dropped":
            self.stats["drop-response"] += 1
            self.requests[d.request].faults.add("drop-response")
            return
        # done / fail: the worker is free again; a fault armed but not reached goes to the next
        unfired = None if self.config.naive else self.armed.pop(tok, None)  # naive acks first
        if unfired is not None and unfired[0] == "crash":
            self.pending_kills.append(unfired[1])
        elif unfired is not None and unfired[0] == "stop":
            self.pending_stops += 1
        sent = w.inflight.pop(tok, None)
        if sent is not None and tok not in self.stopped_toks:
            took = time.monotonic() - sent
            self.longest = max(self.longest, took)
        if w.clock_offset:
            self.skew_struck.add(wid)
        w.overdue.discard(tok)
        if not current:
            self._late_report(d, msg)
            return
        if kind == "done":
            self._settle(d, "done")
            if d.id in self.replays:
                self.dlq.resolve(self.replays[d.id], actor="chaos",
                                 detail="replayed after the retention purge")
            if msg.get("status") in ("completed", "duplicate", "acked_before_work"):
                self.done_requests.add(d.request)
            return
        self._on_failure(d, msg)

    def _late_report(self, d: Delivery, msg: dict[str, Any]) -> None:
        self.stats["late_reports"] += 1
        entry = {"delivery": d.id, "request": d.request, "report": msg.get("t"),
                 "error": msg.get("error"), "status": msg.get("status"), "tok": msg.get("tok"),
                 "stopped": msg.get("tok") in self.stopped_toks}
        if msg.get("error") in ("LeaseLost", "FencedWriteRejected", "LockLost"):
            self.stats["stale_writes_rejected"] += 1
        self.late.append(entry)

    def _on_failure(self, d: Delivery, msg: dict[str, Any]) -> None:
        req = self.requests[d.request]
        error, message = str(msg.get("error")), str(msg.get("message", ""))
        self.stats[f"error:{error}"] += 1
        if error == "StoreUnavailable" and "pg-restart" in self._active_faults(time.monotonic()):
            # the app database went away under this delivery, perhaps after its mail was
            # accepted and before the key completed: a window for one resend, as a kill there is
            req.struck["pg-restart:outage"] += 1
        if NO_ANSWER_HINT in message:
            req.faults.add("drop-response")
        if error in ("GatewayUnavailable", "PaymentNotSettled"):
            for name in ("slow-provider", "drip-provider"):
                if name in req.faults:  # dispatched while the provider misbehaved
                    self.stats[f"{name}_felt"] += 1
        if msg.get("run_id") is not None and msg.get("t") == "fail":
            # --dagster: the run failed; the run-failure sensor's path recorded it (or did not:
            # then the checker finds the request lost, which is the point)
            self.stats["dagster_runs_failed"] += 1
            self.stats["dagster_runs_dead_lettered"] += int(bool(msg.get("dead_lettered")))
            self._settle(d, "dead_lettered")
            return
        if error == "EvictingRedis":
            # a worker started while the policy could evict refused it at first use: dead-
            # lettered (permanent until the configuration changes), replayed once restored
            req.faults.add("evicting-redis")
            self.stats["eviction_dead_letters"] += 1
            self._dead_letter(d, msg, "permanent")
            if d.request not in self.evicted:
                self.evicted.append(d.request)
            return
        if (error == "StoredFailure" and "crash-loop" in self.config.faults
                and d.id not in self.replays and self.settled_as(d.request, "dead_lettered")):
            # a broker's copy of a message whose key already failed: its record is open and
            # holds that failure (a second write would count it twice); a replay's is its own
            self._settle(d, "dead_lettered")
            return
        if msg.get("kind") == "permanent" or self.config.naive:
            self._dead_letter(d, msg, str(msg.get("dlq_class") or "permanent")
                              if msg.get("kind") == "permanent" else "unknown")
            return
        if not msg.get("retry"):  # the step's failure path gave up: the DLQ takes it
            self._dead_letter(d, msg, "transient" if msg.get("kind") == "transient" else "unknown")
            return
        if BUDGET_UNAVAILABLE in str(msg.get("reason") or ""):
            self.stats["budget_unavailable_decisions"] += 1
            req.faults.add("budget-redis-down")
        if msg.get("error") == "PaymentNotSettled":
            d.waits += 1
        d.retries += 1
        self._requeue(d, time.monotonic() + float(msg.get("delay") or 0.0), f"retry:{error}")

    def settled_as(self, request: int, how: str) -> bool:
        return any(d.request == request and d.settled == how for d in self.deliveries)

    def _requeue(self, d: Delivery, ready_at: float, why: str) -> None:
        d.tok = None
        d.history.append(f"{why}@{time.monotonic() - self.t0:.1f}")
        self.seq += 1
        heapq.heappush(self.ready, (ready_at, self.seq, d.id))

    def _settle(self, d: Delivery, how: str) -> None:
        d.settled = how
        d.tok = None

    def _dead_letter(self, d: Delivery, msg: dict[str, Any], error_class: str,
                     dlq_id: int | None = None) -> None:
        """The run-failure sensor's record of a failed run (``dlq_id``: the record a replay
        run failed for, which goes back to ``open``; a replay delivery's own by default)."""
        req = self.requests[d.request]
        dlq_id = dlq_id if dlq_id is not None else self.replays.get(d.id)
        self.stats[f"gave_up:{msg.get('reason') or msg.get('outcome') or error_class}"] += 1
        info = FailureInfo(
            job_type=req.job_type,
            dedupe_key=dedupe_key_for(req.job_type, request_id=self._row_of(req),
                                      idempotency_key=None, run_id="", step=""),
            idempotency_key=self._key_for(req),
            error_type=str(msg.get("error")),
            message=str(msg.get("message", "")) or str(msg.get("error")),
            run_id=f"chaos-{msg.get('tok')}",
            error_class=FailureClass(error_class),
            step=f"{req.job_type}_op",
            request_id=self._row_of(req),
            payload=req.payload,
            correlation_id=f"chaos-req-{req.id}",
            tags={tag.CHAOS: "true", "attempts": str(d.attempts),
                  "decision": str(msg.get("reason") or msg.get("outcome") or "")},
            dlq_id=dlq_id,
        )
        for _ in range(20):  # the app DB may itself be restarting
            try:
                self.dlq.record_failure(info, actor="chaos")
                break
            except Exception as exc:  # noqa: BLE001
                logger.warning("DLQ write failed, retrying: %s", exc)
                time.sleep(0.5)
        self._settle(d, "dead_lettered")

    def _worker_gone(self, w: WorkerProcess) -> None:
        if w.state == "dead":
            return
        looped = [t for t in w.sent if self.armed.get(t, ("", ""))[0] == "loop"]
        for t in looped:
            self.armed.pop(t)
            self.requests[self.by_tok[t].request].faults.add("crash-loop")
            self.stats["crash-loop_deaths"] += 1
        for tok in w.inflight:  # a neighbour on another thread of the process died with it
            if tok not in looped:  # a dispatch past its visibility timeout may still hold its key
                self.requests[self.by_tok[tok].request].struck["died_with_worker"] += 1
        killed = [t for t in w.sent if self.armed.get(t, ("", ""))[0] == "crash"]
        for t in killed:
            point = self.armed.pop(t)[1]
            self.requests[self.by_tok[t].request].faults.add(f"kill:{point}")
            self.requests[self.by_tok[t].request].struck[f"kill:{point}"] += 1
            self.stats["kills"] += 1
        if not killed and not looped and w.state != "starting":
            self.stats["unplanned_deaths"] += 1
        for tok in w.inflight:  # a stop armed on a sibling thread's delivery never struck
            if self.armed.get(tok, ("", ""))[0] == "stop":
                self.armed.pop(tok)
                self.pending_stops += 1
        for tok in w.inflight:
            d = self.by_tok[tok]
            if d.tok == tok and d.settled is None:
                self._requeue(d, time.monotonic(), "worker_died")
        w.inflight.clear()
        w.state = "dead"
        w.close(timeout=1.0)
        self._spawn(w.wid)

    def _watch(self, now: float) -> None:
        for w in list(self.workers.values()):
            if w.state == "stopped":
                if now < w.cont_at:
                    continue
                d = self.deliveries[w.stopped_delivery] if w.stopped_delivery is not None else None
                waited_enough = now >= w.cont_at + 20.0
                if d is None or waited_enough or self._taken_over(d.request, w.stopped_fence):
                    self.stop_log.append({"delivery": d.id if d else None,
                                          "frozen_s": round(now - w.cont_at, 1),
                                          "taken_over": not waited_enough,
                                          "history": d.history if d else None})
                    w.signal(signal.SIGCONT)
                    w.state = "running"
                    for tok in w.inflight:  # the clock starts again for what it holds
                        w.inflight[tok] = max(w.inflight[tok], now - self.visibility / 2)
                continue
            for tok, sent in list(w.inflight.items()):
                if tok in w.overdue:
                    if now - sent > 2 * self.stall_bound:
                        self.unbounded.append(f"unbounded stall: delivery {tok} on worker "
                                              f"{w.wid} gave no answer for {now - sent:.0f}s")
                        w.signal(signal.SIGKILL)  # a worker that never answers is replaced
                    continue
                if now - sent > self.visibility:
                    d = self.by_tok[tok]
                    if d.tok == tok and d.settled is None:
                        self.stats["visibility_timeouts"] += 1
                        self._requeue(d, now, "visibility_timeout")
                    w.overdue.add(tok)

    def _by_row(self, row_id: int) -> Request:
        """The request the stores know by ``row_id`` (:attr:`Request.row_id`)."""
        return self.requests[row_id - 1]

    def _replayable(self, record: Any) -> bool:
        """Whether the operator replays ``record`` after the purge (every one here: a
        crash-looping request is delivered to a worker that crashes on it again)."""
        return True

    def _redeliver_many(self, items: list[tuple[int, int]]) -> None:
        """Deliver again each (workload request, DLQ record it replays)."""
        for request, record_id in items:
            self._redeliver(request, record_id)

    def _redeliver(self, request: int, record_id: int | None) -> None:
        """Deliver workload request ``request`` again (a replay of DLQ record ``record_id``,
        resolved once it is done)."""
        d = Delivery(len(self.deliveries), request)
        self.deliveries.append(d)
        if record_id is not None:
            self.replays[d.id] = record_id
        self.fresh.append(d.id)

    @staticmethod
    def _key_for(req: Request) -> str | None:
        jt = get_job_type(req.job_type)
        try:
            return str(jt.keying.key_for(jt.validate(dict(req.payload))))
        except ValidationError:
            return None

    def _ledger_has(self, key: str) -> bool:
        return bool(_rows(self.world.db, "SELECT 1 FROM idempotency_records WHERE key = :k",
                          k=key))

    def _key_state(self, request: int) -> tuple[int, str | None]:
        """``(fence, status)`` of the request's idempotency record (``(0, None)`` if none)."""

        req = self.requests[request]
        jt = get_job_type(req.job_type)
        try:
            key = jt.keying.key_for(jt.validate(dict(req.payload)))
            with self.probe.connect() as conn:
                rows = list(conn.execute(text(
                    "SELECT fence, status FROM idempotency_records WHERE key = :k"), {"k": key}))
        except Exception:  # noqa: BLE001 - no key, or the store is restarting: ask again later
            return 0, None
        return (int(rows[0].fence), rows[0].status) if rows else (0, None)

    def _taken_over(self, request: int, stale_fence: int) -> bool:
        """A newer claim finished the key while the stopped holder slept: now its late writes
        are stale ones, and the checker can see whether any was accepted."""
        if self.config.naive:
            return True
        fence, status = self._key_state(request)
        return fence > stale_fence and status in ("completed", "failed", "retryable")

    def unsettled(self) -> int:
        return sum(1 for d in self.deliveries if d.settled is None)

    def run(self, progress: Callable[[Coordinator], None] | None = None) -> bool:
        """Deliver everything; True if every delivery settled before the timeout."""
        for wid in range(self._worker_count()):
            self._spawn(wid)
        deadline = time.monotonic() + self.config.timeout
        try:
            finished = self._loop(deadline, progress)
            if finished and "retention-travel" in self.config.faults:
                self._time_travel()
                finished = self._loop(deadline, progress)
            if progress is not None:
                progress(self)
        finally:  # an exception mid-run must not leave workers stopped or a restart running
            self._shutdown()
        return finished

    _POLL = 0.02
    """How long one turn of the loop waits for a worker's event."""

    def _turn(self, now: float) -> None:
        """What one turn of the loop starts before reading events: deliveries due."""
        self._dispatch(now)

    def _loop(self, deadline: float, progress: Callable[[Coordinator], None] | None) -> bool:
        last_progress = 0.0
        while time.monotonic() < deadline:
            self._turn(time.monotonic())
            try:
                self._on_event(*self.events.get(timeout=self._POLL))
                while True:
                    self._on_event(*self.events.get_nowait())
            except queue.Empty:
                pass
            now = time.monotonic()
            self._watch(now)
            if progress is not None and now - last_progress > 1.0:
                progress(self)
                last_progress = now
            if self.unsettled() == 0 and self._quiet() and not self._strike_leftovers():
                return True
        return False

    def _strike_leftovers(self) -> bool:
        """Background faults still due when every delivery has settled (a run faster than its
        fault windows) strike now, so a fast machine skips none. True while any is left."""
        return self._start_due(math.inf, after_settle=True)

    def _time_travel(self) -> None:
        """retention-travel: the reconciliation run (retention purge included) runs
        ``travel_days`` after the run, by an injected clock, while DLQ records are open; then
        every open dead letter that is not poison is replayed, as an operator would on that
        day. Planted first: ``travel_records`` completed requests get a DLQ record as if their
        worker died after the key completed and before the step reported success (the window
        in which a replay after the purge would repeat the effect). Every second one carries no
        payload, as a record written by a sensor that could not read the run's config: nothing
        proves it the same intent, so it is not resolved, stays open, its key must survive the
        purge, and its replay must find the key completed. The checker then sees whether any
        effect happened twice."""
        cfg = self.config
        done = [r for r in self.requests if r.id in self.done_requests and not r.poison
                and self._key_state(r.id)[1] == "completed"]
        done.sort(key=lambda r: (not chaos_of(get_job_type(r.job_type)).retention_first, r.id))
        kept: list[str] = []
        for n, req in enumerate(done[:cfg.travel_records]):
            key = self._key_for(req)
            if n % 2 and key is not None:
                kept.append(key)
            self.dlq.record_failure(FailureInfo(
                job_type=req.job_type,
                dedupe_key=dedupe_key_for(req.job_type, request_id=self._row_of(req),
                                          idempotency_key=None, run_id="", step=""),
                error_type="WorkerLost",
                message="the worker died after the key completed, before the step reported"
                        " success (planted by retention-travel)",
                run_id=f"chaos-travel-{req.id}", error_class=FailureClass.TRANSIENT,
                step=f"{req.job_type}_op", idempotency_key=key, request_id=self._row_of(req),
                payload=None if n % 2 else req.payload, correlation_id=f"chaos-req-{req.id}",
                tags={tag.CHAOS: "true"},
            ), actor="chaos")
            req.faults.add("retention-travel")
            self.stats["travel_planted"] += 1
        offset = cfg.travel_days * 86400.0

        def later() -> float:
            return time.time() + offset

        self.travelled = {r.key: r for r in _rows(
            self.world.db, "SELECT key, status, fence, lease_expires_at FROM idempotency_records")}
        self.published_before_purge = {str(r[0]) for r in _rows(
            self.world.db, "SELECT event_id FROM outbox WHERE published_at IS NOT NULL")}
        open_before = self.dlq.list_records(status=[DlqStatus.OPEN])
        self.stats["travel_open_dead_letters"] = len(open_before)
        store = IdempotencyStore(self.world.db, lease_seconds=cfg.lease_seconds, clock=later)
        report = Reconciler(self.world.db, store=store,
                                dlq=DlqStore(self.world.db, clock=later), clock=later).run()
        self.stats["travel_resolved"] = len(report.resolved_dead_letters)
        self.stats["travel_purged_keys"] = int(report.purged.get("idempotency_records", 0))
        self.stats["travel_kept_keys"] = sum(1 for key in kept if self._ledger_has(key))
        if open_before:
            self.stats["retention-travel"] += 1
        replay = [r for r in self.dlq.list_records(status=[DlqStatus.OPEN])
                  if r.request_id is not None and not self._by_row(int(r.request_id)).poison
                  and self._replayable(r)]
        self.replay_records([r.id for r in replay], "retention-travel",
                            "retention-travel: replayed after the purge")

    def _redeliver_rolled_back(self) -> None:
        """pg-failover: the broker's own record of what it acknowledged lives in the database
        that failed over (as ``job_requests`` does for the intake), so a request settled in the
        lost seconds is pending again: every settled request whose key the promoted database
        does not hold completed, nor an open dead letter for, is delivered again."""
        self.failovers_handled = self.world.pg_failovers
        settled = {d.request for d in self.deliveries if d.settled is not None}
        pending = {d.request for d in self.deliveries if d.settled is None}
        with self.probe.connect() as conn:
            dead = {int(r[0]) for r in conn.execute(text(
                "SELECT request_id FROM dlq_records WHERE status = 'open'"
                " AND request_id IS NOT NULL"))}
        for rid in sorted(settled - pending):
            req = self.requests[rid]
            if req.row_id in dead or self._key_state(rid)[1] == "completed":
                continue
            self.done_requests.discard(rid)
            req.faults.add("pg-failover")
            d = Delivery(len(self.deliveries), rid)
            self.deliveries.append(d)
            self.fresh.append(d.id)
            self.stats["pg-failover_redelivered"] += 1

    def _replay_evicted(self) -> None:
        """evicting-redis: the policy is ``noeviction`` again; the operator replays what the
        refusal dead-lettered (``sekali dlq replay``: the key reset, the record replaying)."""
        wanted = {self._row_of(self.requests[r]) for r in self.evicted}
        self.evicted.clear()
        records = [r for r in self.dlq.list_records(status=[DlqStatus.OPEN])
                   if r.request_id is not None and int(r.request_id) in wanted]
        self.replay_records([r.id for r in records], "evicting-redis",
                            "evicting-redis: maxmemory-policy noeviction again")

    def replay_records(self, record_ids: list[int], fault: str, reason: str) -> int:
        """The operator's ``sekali dlq replay`` of open records ``record_ids`` (the key reset,
        each record ``replaying``), then each delivered again as the replay sensor's run would
        be. The replayed requests carry ``fault``; returns how many were claimed."""
        self.dlq.request_replay(record_ids, actor="chaos",
                                idempotency=IdempotencyStore(self.world.db), reason=reason)
        again: list[tuple[int, int]] = []
        for record in self.dlq.claim_for_replay(len(record_ids), actor="chaos"):
            assert record.request_id is not None
            req = self._by_row(int(record.request_id))
            req.faults.add(fault)
            again.append((req.id, record.id))
        self.stats[_REPLAYED_STAT[fault]] += len(again)
        self._redeliver_many(again)
        return len(again)

    def fault_counts(self) -> dict[str, int]:
        """Planned vs struck per fault: a fault still pending when the run settled never struck,
        and a run whose faults did not strike proves less than its options say."""
        armed = Counter(kind for kind, _ in self.armed.values())
        pending = {
            "kills": len(self.kill_at) + len(self.pending_kills) + armed["crash"],
            "stops": len(self.stop_at) + self.pending_stops + armed["stop"],
            **{name: len(due) for name, due in self.due.items()},
            "clock-skew": self.scheduled.get("clock-skew", 0) - len(self.skew_struck),
            "retention-travel": 1 - self.stats["retention-travel"],
            "crash-loop": self.scheduled["crash-loop"] - self.stats["crash-loop"],
            "poison-outbox": self.scheduled["poison-outbox"] - self.stats["poison-outbox"],
        }
        out: dict[str, int] = {}
        for name, planned in self.scheduled.items():
            if planned:
                out[f"{name}_scheduled"] = planned
                out[f"{name}_not_struck"] = pending[name]
        return out

    def _quiet(self) -> bool:
        """No worker still stopped or working on an old delivery, no restart under way: their
        late writes must happen inside the run, where the checker sees them."""
        return not self._running and not self.evicted and (
            self.world.pg_failovers == self.failovers_handled) and all(
            w.state != "stopped" and not w.inflight for w in self.workers.values()
        )

    def _shutdown(self) -> None:
        for w in self.workers.values():
            try:
                w.signal(signal.SIGCONT)
                w.close()
            except Exception:  # noqa: BLE001 - one worker must not keep the others alive
                logger.exception("closing worker %s failed", w.wid)
        self.probe.dispose()
        for _, thread in list(self._running.values()):  # joined before the world stops
            thread.join(timeout=60)


CHAOS_GENERATION = "sekali/chaos_generation"  # which worker process ran a worker run


# -- resident workers --------------------------------------------------------------------------


@dataclass
class _Resident:
    """What the coordinator knows of one resident worker process."""

    proc: WorkerProcess
    owner: str
    queue: str
    in_hand: list[str] = field(default_factory=list)  # correlation ids of the batch it holds
    batch_at: float = 0.0
    armed: tuple[str, str] | None = None  # (crash | stop, point) sent and not struck yet
    struck: str | None = None  # "kill" | "loop" | "failed": why it will die
    stopped_cid: str | None = None
    stopped_at: float = 0.0
    declared_dead: bool = False  # given back while frozen; it only finishes and ends now
    exiting: bool = False
    froze_in_batch: bool = False
    crash_cid: str | None = None


class ResidentCoordinator(Coordinator):
    """``--delivery resident``: the workload goes in through :func:`engine.intake.enqueue` (each
    request ``redelivery`` times, the copies in the broker's order: a producer that retries),
    and P resident worker processes (:mod:`proof.chaos_resident`, the shipped
    :class:`engine.worker.ResidentWorker`, heavy and light queues both served) claim and run it.
    The coordinator plays the supervisor: a worker that died (or was cut off by a stop past its
    lease and declared dead) has what it held given back through
    :func:`engine.worker.give_back` and a new worker under a new owner takes its slot; a stopped
    one is woken once its keys were taken over, and ends after the batch in hand, its late
    writes refused by the fences. Faults are armed on a worker (the next effect call reaching
    the point strikes), on the same schedule as the broker's; the background faults are the
    same. A request is settled when its row is ``completed``, or ``failed`` with an open dead
    letter; poison is refused at the enqueue and kept in ``job_rejections``."""

    def __init__(self, config: ChaosConfig, world: ChaosWorld, requests: list[Request]) -> None:
        super().__init__(config, world, requests)
        self.order = delivery_order(requests, config.redelivery, config.seed, config.workers)
        self.deliveries = []
        self.fresh.clear()
        self.ids: dict[int, int] = {}  # workload id -> job_requests id
        self.rejected: set[int] = set()
        self.by_cid = {f"chaos-req-{r.id}": r for r in requests}
        self.settled: set[int] = set()  # workload ids
        self.procs: dict[int, _Resident] = {}  # by generation
        self.slot: dict[int, int] = {}  # wid -> generation of its current worker
        self.respawn_at: dict[int, float] = {}
        self.give_back_due: set[str] = set()
        self.produced = threading.Event()
        self.namespace = f"chaos-{uuid.uuid4().hex[:10]}"
        self.store = RequestStore(world.db)
        self.queues = ["heavy" if wid % 2 else "light" for wid in range(max(2, config.workers))]
        self.instance: dg.DagsterInstance | None = None
        if config.dagster:  # the workers are sekali_worker runs the real supervisor asks for
            self.instance = dg.DagsterInstance.from_config(str(world.state / "dagster"))
            self.targets = WorkerTargets({q: self.queues.count(q) for q in ("light", "heavy")})
            self.generations: dict[str, int] = {}
            self.slots = [f"{q}/{self.queues[:i].count(q)}" for i, q in enumerate(self.queues)]
        self._last_poll = 0.0
        self._closing = False
        self.replaying: dict[int, int] = {}  # DLQ record -> workload request it replays
        self.replay_runs: Counter[int] = Counter()  # DLQ record -> its replays so far
        self.disarmed: set[str] = set()  # workers whose kill went to a replay instead
        self.replayer: WorkerProcess | None = None  # the per-request runs of DLQ replays
        self.replay_events: queue.Queue[Any] = queue.Queue()

    def _plan_total(self) -> int:
        return len(self.requests)

    def _carry_margin(self) -> int:
        """A fault goes to one worker of several (the others claim beside it): two untouched
        requests per worker for each still to come."""
        return 2 * len(self.queues)

    def _worker_count(self) -> int:
        return len(self.queues)  # at least one worker per queue

    def _stop_under_way(self) -> bool:
        return any((r.armed is not None and r.armed[0] == "stop") or r.proc.state == "stopped"
                   for r in self.procs.values())

    def _row_of(self, req: Request) -> int:
        return self.ids[req.id]

    def _by_row(self, row_id: int) -> Request:
        return self.requests[{v: k for k, v in self.ids.items()}[row_id]]

    # -- the producer
    def _produce(self) -> None:
        """Enqueue every copy in order; a store away is retried (the producer is at-least-once
        too); a refusal is kept by the enqueue (``job_rejections``), the request is poison."""
        for rid, _copy in self.order:
            req = self.requests[rid]
            for _ in range(240):
                try:
                    result = enqueue(req.job_type, dict(req.payload),
                                     correlation_id=f"chaos-req-{req.id}", db=self.world.db,
                                     source="chaos")
                    self.ids[req.id] = result.id
                    self.stats["enqueued" if result.created else "enqueue_duplicates"] += 1
                    break
                except ValidationError:
                    self.rejected.add(req.id)
                    break
                except Exception as exc:  # noqa: BLE001 - the store is away: try again
                    logger.warning("enqueue of request %s failed, retrying: %s", req.id, exc)
                    self.stats["enqueue_retries"] += 1
                    time.sleep(0.5)
        self.produced.set()

    # -- workers
    def _spawn(self, wid: int) -> None:
        if self.instance is not None:
            self._supervise()
            return
        self._start_worker(wid, f"chaos-w{wid}-g{self.generation + 1}-{self.namespace}")

    def _supervise(self) -> None:
        """--dagster: one tick of the workers' supervisor (:mod:`sensors.workers`): the runs
        it asks for (a slot whose run ended), each started as a process running that
        ``sekali_worker`` run; a slot whose process is still starting its run is left alone
        (Dagster would keep one run per run key)."""
        assert self.instance is not None
        launch, _surplus, self.generations = worker_run_requests(
            self.instance, WORKER_JOB, self.generations, delivery=DeliveryPolicy(),
            targets=self.targets)
        starting = {self.slots[r.proc.wid] for r in self.procs.values()
                    if r.proc.state != "dead" and not r.declared_dead}
        for request in launch:
            slot = request.tags[tag.WORKER]
            if slot in starting or slot not in self.slots:
                continue
            self._start_worker(self.slots.index(slot), "", run_config=request.run_config,
                               run_tags={**request.tags, CHAOS_GENERATION:
                                         str(self.generation + 1)})

    def _start_worker(self, wid: int, owner: str, **run: Any) -> None:
        self.generation += 1
        gen = self.generation
        queue_name = self.queues[wid % len(self.queues)]
        config = replace(
            self.world.worker_config(wid), queue=queue_name, owner=owner,
            batch_size=self.config.batch_size, wakeup_namespace=self.namespace, threads=1,
            crash_loops=tuple(f"chaos-req-{r.id}" for r in self.requests if r.crash_loop),
            **run)
        proc = WorkerProcess(wid, gen, config, self.events, self.world.state,
                             module="proof.chaos_resident_dagster" if self.instance is not None
                             else "proof.chaos_resident")
        self.procs[gen] = _Resident(proc, owner, queue_name)
        self.slot[wid] = gen
        self.workers[wid] = proc
        self.stats["worker_runs"] += 1

    def _current(self, r: _Resident) -> bool:
        return self.slot.get(r.proc.wid) == r.proc.generation and not r.declared_dead

    def _on_event(self, wid: int, gen: int, msg: dict[str, Any] | None) -> None:
        r = self.procs.get(gen)
        if r is None:
            return
        now = time.monotonic()
        if msg is None:
            self._gone(r, now)
            return
        kind = msg["t"]
        req = self.by_cid.get(str(msg.get("cid")))
        if kind == "ready":
            if r.proc.state == "starting":
                r.proc.state = "running"
        elif kind == "batch":
            r.owner = r.owner or str(msg.get("owner") or "")
            r.in_hand = [str(c) for c in msg.get("cids", [])]
            r.batch_at = now
            r.froze_in_batch = False
            self.dispatches += len(r.in_hand)
            active = self._active_faults(now)
            for cid in r.in_hand:
                held = self.by_cid.get(cid)
                if held is not None:
                    self._deliver(held)
                    held.faults.update(active)
                    if r.proc.clock_offset:
                        held.faults.add("clock-skew")
        elif kind == "batch_done":
            if not r.froze_in_batch:
                self.longest = max(self.longest, now - r.batch_at)
            r.in_hand = []
            if r.proc.clock_offset:
                self.skew_struck.add(wid)
        elif kind in ("killing", "loop"):
            r.struck = "kill" if kind == "killing" else "loop"
            r.crash_cid = str(msg.get("cid"))
            r.armed = None if kind == "killing" else r.armed
            if kind == "killing":
                if self.armed.pop(f"g{gen}", None) is None and f"g{gen}" in self.disarmed:
                    # it struck before its disarm arrived: the kill taken back is spent
                    self.disarmed.discard(f"g{gen}")
                    with contextlib.suppress(ValueError):
                        self.pending_kills.remove(str(msg.get("point")))
                self.stats["kills"] += 1
                point = f"kill:{msg.get('point')}"
            else:
                self.stats["crash-loop_deaths"] += 1
                point = "crash-loop"
            if req is not None:
                req.faults.add(point)
                if kind == "killing":
                    req.struck[point] += 1
        elif kind == "stopping":
            self.armed.pop(f"g{gen}", None)
            r.armed = None
            self.stats["stops"] += 1
            r.proc.state = "stopped"
            r.stopped_cid = str(msg.get("cid"))
            r.stopped_at = now
            r.froze_in_batch = True
            r.proc.stopped_fence = self._key_state(req.id)[0] if req is not None else 0
            r.proc.cont_at = now + 2 * self.config.lease_seconds + 0.5
            if req is not None:
                point = f"stop:{msg.get('point')}"
                req.faults.add(point)
                req.struck[point] += 1
        elif kind == "fail":
            self._on_fail(r, req, msg)
        elif kind == "worker_failed":
            r.struck = r.struck or "failed"
            self.stats[f"worker_failed:{msg.get('error')}"] += 1

    def _on_fail(self, r: _Resident, req: Request | None, msg: dict[str, Any]) -> None:
        error, message = str(msg.get("error")), str(msg.get("message", ""))
        self.stats[f"error:{error}"] += 1
        now = time.monotonic()
        if not self._current(r) or error in ("LeaseLost", "FencedWriteRejected", "LockLost"):
            self._late_report_of(r, req, msg)
        if req is None:
            return
        active = self._active_faults(now)
        if error == "StoreUnavailable" and "pg-restart" in active:
            req.struck["pg-restart:outage"] += 1
        if NO_ANSWER_HINT in message:
            req.faults.add("drop-response")
        if error in ("GatewayUnavailable", "PaymentNotSettled"):
            for name in ("slow-provider", "drip-provider"):
                if name in req.faults:
                    self.stats[f"{name}_felt"] += 1
        if BUDGET_UNAVAILABLE in str(msg.get("reason") or ""):
            self.stats["budget_unavailable_decisions"] += 1
            req.faults.add("budget-redis-down")
        if error == "EvictingRedis" and msg.get("dead_letter"):
            req.faults.add("evicting-redis")
            self.stats["eviction_dead_letters"] += 1
            if req.id not in self.evicted:
                self.evicted.append(req.id)
        if msg.get("retry"):
            self.stats[f"retried:{error}"] += 1
        elif msg.get("dead_letter"):
            self.stats[f"gave_up:{msg.get('reason') or msg.get('outcome')}"] += 1

    def _late_report_of(self, r: _Resident, req: Request | None, msg: dict[str, Any]) -> None:
        self.stats["late_reports"] += 1
        if msg.get("error") in ("LeaseLost", "FencedWriteRejected", "LockLost"):
            self.stats["stale_writes_rejected"] += 1
        self.late.append({"worker": r.owner, "request": req.id if req is not None else None,
                          "report": msg.get("t"), "error": msg.get("error"),
                          "stopped": r.stopped_cid is not None})

    def _gone(self, r: _Resident, now: float) -> None:
        if r.proc.state == "dead":
            return
        crasher = r.crash_cid if r.struck in ("kill", "loop") else None
        for cid in r.in_hand:
            held = self.by_cid.get(cid)
            if held is not None and cid != crasher and not (held.crash_loop and r.struck == "loop"):
                held.struck["died_with_worker"] += 1
        if r.struck == "failed":
            self.stats["worker_runs_failed"] += 1
        elif r.struck is None and not r.exiting and not r.declared_dead:
            self.stats["unplanned_deaths"] += 1
        if r.armed is not None and f"g{r.proc.generation}" in self.armed:
            kind, point = self.armed.pop(f"g{r.proc.generation}")
            if kind == "crash":
                self.pending_kills.append(point)
            else:
                self.pending_stops += 1
        r.proc.state = "dead"
        r.in_hand = []
        r.proc.close(timeout=1.0)
        self._run_ended(r, "its run worker died")
        self.give_back_due.add(r.owner)
        if self.slot.get(r.proc.wid) == r.proc.generation and not self._closing:
            # the supervisor's next tick: at once after a kill, a second after a failed run
            self.respawn_at[r.proc.wid] = now + (1.0 if r.struck == "failed" else 0.0)

    def _run_ended(self, r: _Resident, why: str) -> None:
        """--dagster: run monitoring's part: the run of a worker whose process died (or was
        declared dead) is marked failed, so the supervisor gives back what it held and fills
        its slot (a run that ended by itself is left as it ended)."""
        if self.instance is None:
            return
        gen = str(r.proc.generation)
        for run in self.instance.get_runs(dg.RunsFilter(tags={CHAOS_GENERATION: gen})):
            if run.status not in (dg.DagsterRunStatus.SUCCESS, dg.DagsterRunStatus.FAILURE,
                                  dg.DagsterRunStatus.CANCELED):
                self.instance.report_run_failed(run, message=f"chaos: {why}")
                self.stats["dagster_runs_failed_by_monitoring"] += 1

    def _give_back(self) -> None:
        if not self.give_back_due:
            return
        owners = sorted(self.give_back_due)
        try:
            if self.instance is not None:  # the supervisor's own step, over ended runs
                self.stats["given_back"] += supervisor_give_back(self.instance, self.store)
                self.give_back_due.clear()
                self._supervise()
                return
            moved = give_back(self.store, owners)
        except Exception as exc:  # noqa: BLE001 - the store is away: the next pass gives back
            logger.warning("give back of %s failed, retrying: %s", owners, exc)
            return
        self.give_back_due.clear()
        self.stats["given_back"] += len(moved)

    def _arm_workers(self) -> None:
        """Faults due go to a running worker each (seeded choice)."""
        while self.pending_kills or (self.pending_stops and not self._stop_under_way()):
            free = [r for r in self.procs.values()
                    if self._current(r) and r.proc.state == "running" and r.armed is None]
            if not free:
                return
            waiting = self._queues_with_untouched()  # where a fault can still find an effect
            free = [r for r in free if self.queues[r.proc.wid] in waiting] or free
            r = free[self.rng.randrange(len(free))]
            if self.pending_kills:
                r.armed = ("crash", self.pending_kills.pop())
                msg = {"t": "arm", "crash": r.armed[1]}
            else:
                self.pending_stops -= 1
                r.armed = ("stop", STOP_POINTS[self.stats["stops_armed"] % len(STOP_POINTS)])
                self.stats["stops_armed"] += 1
                msg = {"t": "arm", "stop": r.armed[1]}
            self.armed[f"g{r.proc.generation}"] = r.armed
            r.proc.send(msg)

    def _queues_with_untouched(self) -> set[str]:
        """The queues still holding a request no worker has claimed that can carry a fault."""
        return {get_job_type(r.job_type).queue for r in self.requests
                if r.deliveries == 0 and self._carries(r)}

    def _watch(self, now: float) -> None:
        for wid, at in list(self.respawn_at.items()):
            if now >= at:
                del self.respawn_at[wid]
                self._spawn(wid)
        for r in list(self.procs.values()):
            if r.proc.state == "stopped":
                if not r.declared_dead and now >= r.proc.cont_at:
                    # cut off past its lease: its run is declared dead, what it held given back
                    r.declared_dead = True
                    self._run_ended(r, "cut off past its lease (declared dead)")
                    self.give_back_due.add(r.owner)
                    self.stats["declared_dead"] += 1
                    self._spawn(r.proc.wid)
                elif r.declared_dead:
                    req = self.by_cid.get(str(r.stopped_cid))
                    waited = now >= r.proc.cont_at + 20.0
                    taken = req is not None and self._taken_over(req.id, r.proc.stopped_fence)
                    if waited or taken or req is None:
                        self.stop_log.append({"worker": r.owner, "request": req.id if req else None,
                                              "frozen_s": round(now - r.stopped_at, 1),
                                              "taken_over": taken})
                        r.proc.signal(signal.SIGCONT)
                        r.proc.state = "running"
                        r.exiting = True
                        r.proc.send({"t": "exit"})  # it finishes the batch in hand and ends
                continue
            if r.proc.state == "running" and r.in_hand and now - r.batch_at > 2 * self.stall_bound:
                self.unbounded.append(f"unbounded stall: worker {r.owner} held a batch for "
                                      f"{now - r.batch_at:.0f}s")
                r.batch_at = now
                r.proc.signal(signal.SIGKILL)
        self._give_back()
        if now - self._last_poll >= 0.5:
            self._last_poll = now
            self._poll_settled()
            self._resolve_replayed()

    def _poll_settled(self) -> None:
        try:
            with self.probe.connect() as conn:
                rows = conn.execute(text(
                    "SELECT r.id, r.status, (SELECT count(*) FROM dlq_records d"
                    " WHERE d.request_id = r.id AND d.status = 'open') AS dead"
                    " FROM job_requests r")).all()
        except Exception:  # noqa: BLE001 - the store is restarting: ask again later
            return
        status = {int(row.id): (row.status, int(row.dead)) for row in rows}
        for wid_, rid in list(self.ids.items()):
            st, dead = status.get(rid, (None, 0))
            if st == "completed" or (st == "failed" and dead):
                self.settled.add(wid_)
                if st == "completed":
                    self.done_requests.add(wid_)
            else:
                self.settled.discard(wid_)
                self.done_requests.discard(wid_)

    def unsettled(self) -> int:
        return sum(1 for r in self.requests
                   if r.id not in self.rejected and r.id not in self.settled)

    def _quiet(self) -> bool:
        return (self.produced.is_set() and not self._running and not self.evicted
                and not self.replaying and not self.give_back_due and not self.respawn_at
                and all(r.proc.state == "dead" or (
                    self._current(r) and r.proc.state == "running" and not r.in_hand)
                        for r in self.procs.values()))

    def _redeliver_many(self, items: list[tuple[int, int]]) -> None:
        """DLQ replays, as the replay sensor launches them for every job type, resident ones
        included: a per-request run each, here a delivery to a per-request worker process
        (:mod:`proof.chaos_worker`: the per-request op's step entry with ``replay_of``, its
        fault points, a crash-looping handler crashing it again; two at a time), retried in
        the step as Dagster would; one that fails for good is dead-lettered as the run-failure
        sensor records a failed run. Each record is resolved once its request completed."""
        due: list[tuple[float, int, int, int]] = []  # (when, request, record, attempt)
        for request, record_id in items:
            self.replaying[record_id] = request
            self.replay_runs[record_id] += 1
            self.settled.discard(request)
            due.append((0.0, request, record_id, 0))
        inflight: dict[str, tuple[int, int, int]] = {}
        killing: dict[str, str] = {}  # tok -> the crash point armed on that replay
        ends = time.monotonic() + self.stall_bound + 5.0 * len(items)
        while (due or inflight) and time.monotonic() < ends:
            if self.replayer is None or self.replayer.proc.poll() is not None:
                self.replayer = WorkerProcess(
                    len(self.queues), 0, replace(self.world.worker_config(len(self.queues)),
                                                 dagster_home=""),
                    self.replay_events, self.world.state, module="proof.chaos_worker")
            now = time.monotonic()
            ready = [d for d in due if d[0] <= now][:max(0, 2 - len(inflight))]
            looping = [d for d in ready if self.requests[d[1]].crash_loop]
            if looping or any(self.requests[r].crash_loop for r, _, _ in inflight.values()):
                # a crash-looping handler runs alone, as a run of its own would: its deaths
                # must not count against a neighbour
                ready = looping[:1] if not inflight else []
            for item in ready:
                due.remove(item)
                _, request, record_id, attempt = item
                req = self.requests[request]
                # a replay is a run of its own (Dagster's new run id): a second replay of the
                # record failing is a failure its record has not seen, so it opens it again
                tok = f"replay-{record_id}-{self.replay_runs[record_id]}.{attempt}"
                msg: dict[str, Any] = {
                    "tok": tok, "req": req.id, "request_id": self.ids[request],
                    "job_type": req.job_type, "payload": req.payload, "attempt": attempt,
                    "replay_of": record_id}
                if req.crash_loop:
                    msg["crash"] = "before_effect"
                elif self._kill_on_replay(req):
                    msg["crash"] = killing[tok] = self.pending_kills.pop()
                self._deliver(req)
                inflight[tok] = (request, record_id, attempt)
                self.replayer.send(msg)
            try:
                _wid, _gen, answer = self.replay_events.get(timeout=0.5)
            except queue.Empty:
                continue
            if answer is None:  # the process died (a crash loop, a kill): its replays go again
                self.stats["replay_worker_deaths"] += 1
                for tok, (request, _rec, _a) in inflight.items():
                    req = self.requests[request]
                    if tok in killing:
                        point = killing.pop(tok)
                        req.faults.add(f"kill:{point}")
                        req.struck[f"kill:{point}"] += 1
                        self.stats["kills"] += 1
                        self.stats["kills_on_replays"] += 1
                    elif not req.crash_loop:
                        req.struck["died_with_worker"] += 1
                self.replayer.close(timeout=1.0)
                self.replayer = None
                later = time.monotonic() + self.config.lease_seconds  # the dead lease runs out
                due += [(later, r, rec, a + 1) for r, rec, a in inflight.values()]
                inflight.clear()
                continue
            held = inflight.pop(str(answer.get("tok")), None)
            if held is None or answer["t"] not in ("done", "fail"):
                if held is not None:
                    inflight[str(answer.get("tok"))] = held
                continue
            if str(answer.get("tok")) in killing:  # it reached no point: the kill is still due
                self.pending_kills.append(killing.pop(str(answer.get("tok"))))
            request, record_id, attempt = held
            self.stats["replays_run"] += 1
            if answer["t"] == "fail" and answer.get("retry"):
                due.append((time.monotonic() + float(answer.get("delay") or 0.0), request,
                            record_id, attempt + 1))
            elif answer["t"] == "fail":  # the run fails: the run-failure sensor's record
                kind = answer.get("kind")
                self._dead_letter(Delivery(-1, request, attempts=attempt + 1), answer,
                                  str(answer.get("dlq_class") or "permanent")
                                  if kind == "permanent" else
                                  "transient" if kind == "transient" else "unknown",
                                  dlq_id=record_id)

    def _kill_on_replay(self, req: Request) -> bool:
        """Whether a kill still due goes to this replay: once no queue holds a request a
        worker's kill could strike (a wave of evictions dead-lettered them), the kills armed on
        workers are taken back and given to the replays, whose per-request runs are killed as
        a worker's process is. Otherwise they would never strike, and the run would prove
        less than its options say."""
        if not self._carries(req) or self._queues_with_untouched():
            return False
        for r in self.procs.values():
            gen = f"g{r.proc.generation}"
            if r.armed is not None and r.armed[0] == "crash" and gen in self.armed:
                if r.proc.state == "running":
                    r.proc.send({"t": "disarm"})
                self.pending_kills.append(self.armed.pop(gen)[1])
                self.disarmed.add(gen)
                r.armed = None
        return bool(self.pending_kills)

    def _resolve_replayed(self) -> None:
        for record_id, request in list(self.replaying.items()):
            if request in self.done_requests:
                self.dlq.resolve(record_id, actor="chaos", detail="replayed")
                del self.replaying[record_id]
            elif request in self.settled:  # dead-lettered again: its record is open
                del self.replaying[record_id]

    def run(self, progress: Callable[[Coordinator], None] | None = None) -> bool:
        with environment({"REDIS_URL": self.world.redis_url,
                          "SEKALI_WAKEUP_NAMESPACE": self.namespace}):
            producer = threading.Thread(target=self._produce, name="chaos-producer",
                                        daemon=True)
            producer.start()
            return super().run(progress)

    _POLL = 0.05

    def _turn(self, now: float) -> None:
        """Replays after an eviction window, faults due, and workers to (re)start."""
        if self.evicted and not self.world.evicting:
            self._replay_evicted()
        self._arm_faults_due()
        self._arm_workers()

    def _shutdown(self) -> None:
        """Every worker told to end (a stopped one woken first), what any still held given
        back; the background faults joined before the world stops."""
        self._closing = True
        for r in self.procs.values():
            if r.proc.state != "dead":
                r.exiting = True
                try:
                    r.proc.signal(signal.SIGCONT)
                    r.proc.close()
                except Exception:  # noqa: BLE001 - one worker must not keep the others alive
                    logger.exception("closing worker %s failed", r.owner)
                self.give_back_due.add(r.owner)
        self.stats["worker_processes"] = len(self.procs)
        if self.replayer is not None:
            self.replayer.close()
        if self.instance is not None:  # every worker run ended when the harness ends
            runs = self.instance.get_runs(dg.RunsFilter(job_name=WORKER_JOB))
            self.stats["dagster_worker_runs"] = len(runs)
            left = [run for run in runs if run.status in IN_FLIGHT]
            self.stats["dagster_runs_open_at_end"] = len(left)
            for run in left:
                self.unbounded.append(f"Dagster worker run {run.run_id} still "
                                      f"{run.status.value} at the end")
            for status in ("CANCELED", "FAILURE", "SUCCESS"):
                self.stats[f"dagster_worker_runs_{status.lower()}"] = sum(
                    1 for run in runs if run.status.value == status)
        self._give_back()
        self.probe.dispose()
        for _, thread in list(self._running.values()):
            thread.join(timeout=60)


# -- the checker -------------------------------------------------------------------------------


@dataclass
class RequestVerdict:
    id: int
    job_type: str
    poison: bool
    faults: list[str]
    deliveries: int
    effects: int
    resends: int
    status: str | None
    dead_lettered: bool
    dlq_class: str | None
    dlq_reason: str | None
    lost: bool


@dataclass
class ChaosReport:
    config: dict[str, Any]
    finished: bool
    seconds: float
    deliveries: int
    stats: dict[str, int]
    rows: list[dict[str, Any]]
    violations: list[str]
    late_reports: list[dict[str, Any]]
    state_dir: str | None = None  # kept only with keep_state (worker logs, databases)
    # every dead-lettered request that was not poison: id, job type, class, reason, faults
    dead_letters: list[dict[str, Any]] = field(default_factory=list)
    # --job-type: per job type, how its effects were counted ("record": the stand-in's own;
    # "lookup": through its lookup hook), each lookup's calibration, and what is unverified
    counting: dict[str, str] = field(default_factory=dict)
    calibration: list[dict[str, Any]] = field(default_factory=list)
    unverified: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def _rows(db: Any, sql: str, **params: Any) -> list[Any]:
    with db.statement() as conn:
        return list(conn.execute(text(sql), params).all())


@dataclass
class Evidence:
    """What the sandbox and the stores recorded, read once after a run: the checker's only
    source (never what workers said)."""

    arrivals: dict[str, list[dict[str, Any]]]  # what the stand-ins took, by correlation id
    records: dict[str, Any]  # idempotency records by key
    dlq: dict[int, Any]  # by request id
    attempts: dict[int, list[Any]]  # by request id
    own: dict[str, Any]  # each job type's business rows (ChaosProof.gather), by job type


def gather_evidence(
    db: Any,
    arrivals: Iterable[dict[str, Any]],
    *,
    purged_records: Mapping[str, Any] | None = None,
) -> Evidence:
    """Read the stores of ``db`` once; ``arrivals`` are what the providers' stand-ins recorded
    (charges, messages), each with its ``correlation_id``. ``purged_records`` are ledger rows
    a retention purge removed "days later" (retention-travel): a key is judged by what the
    ledger held just before, completed then, with the effect the sandbox recorded."""
    by_request: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for arrival in arrivals:
        by_request[str(arrival.get("correlation_id"))].append(arrival)
    attempts: dict[int, list[Any]] = defaultdict(list)
    for a in _rows(db, "SELECT request_id, idempotency_key, outcome, fence, error_class"
                       " FROM job_attempts"):
        if a.request_id is not None:
            attempts[int(a.request_id)].append(a)
    own = {}
    for name, jt in JOB_TYPES.items():
        gather = chaos_of(jt).gather
        if gather is not None:
            own[name] = gather(db)
    return Evidence(
        arrivals=by_request,
        records={**(purged_records or {}), **{r.key: r for r in _rows(
            db, "SELECT key, status, fence, lease_expires_at FROM idempotency_records")}},
        dlq={int(r.request_id): r for r in _rows(
            db, "SELECT request_id, status, error_class, last_error, failure_count"
                " FROM dlq_records WHERE request_id IS NOT NULL")},
        attempts=attempts,
        own=own,
    )


def check(world: ChaosWorld, coordinator: Coordinator) -> tuple[list[RequestVerdict], list[str]]:
    """Judge the run from the stores and the sandbox's records. Returns verdicts, violations.
    A ``--job-type`` run counts each job type's effects by its stand-ins' own records where
    they declare one, else through its lookup hook, and checks every recorded arrival against
    the send bounds of its key's holders (:mod:`proof.chaos_truth`)."""
    retries: Counter[int] = Counter()
    for d in coordinator.deliveries:
        retries[d.request] += d.retries
    if world.sandboxes is not None:
        truth = GroundTruth(world.sandboxes)
        by_lookup = effect_counter(job_types_of(world.config.job_types, ChaosConfigError),
                                   world.sandboxes.clients())

        def count(job_type: str, payload: dict[str, Any]) -> int:
            recorded = truth.effects(job_type, payload)
            return by_lookup(job_type, payload) if recorded is None else len(recorded)

        evidence = gather_evidence(world.db, [], purged_records=coordinator.travelled)
        verdicts, violations = judge(
            coordinator.requests, evidence, naive=False, retries=retries,
            stats=coordinator.stats, count=count,
            crash_loop_limit=world.config.crash_loop_limit)
        late, bound_stats = check_send_bounds(
            coordinator.requests, truth, world.db, lease=world.config.lease_seconds,
            skew=world.config.skew)
        coordinator.stats.update(bound_stats)
        return verdicts, violations + late
    evidence = gather_evidence(world.db, [*world.gateway.charges(), *world.sink.messages()],
                               purged_records=coordinator.travelled)
    if isinstance(coordinator, ResidentCoordinator):
        return judge(coordinator.requests, evidence, naive=world.config.naive, retries=retries,
                     stats=coordinator.stats, crash_loop_limit=world.config.crash_loop_limit,
                     request_ids=coordinator.ids,
                     rejected=rejections(world.db, coordinator.requests, coordinator.rejected))
    return judge(coordinator.requests, evidence, naive=world.config.naive, retries=retries,
                 stats=coordinator.stats, crash_loop_limit=world.config.crash_loop_limit)


def rejections(db: Any, requests: list[Request], refused: set[int]) -> set[int]:
    """The workload ids among ``refused`` (their enqueue raised ``ValidationError``) whose
    refusal ``job_rejections`` kept: its job type and the sha256 of the whole payload, as the
    rejection stores it (no value of the payload is kept): refused, and not lost."""
    kept = {(str(r.job_type), str(r.payload_sha256)) for r in _rows(
        db, "SELECT job_type, payload_sha256 FROM job_rejections")}
    return {i for i in refused
            if (requests[i].job_type, masked_digest(requests[i].payload, 64).sha256) in kept}


def apparent_deaths(req: Request, attempts: Iterable[Any]) -> int:
    """The deaths of ``req``'s holders a claim of its key may have counted towards the
    crash-loop bound: a claim counts one for every takeover of a holder that ran alone, and
    cannot tell a dead holder from one stalled past its lease or cut off from the database.
    So: its workers killed (on it, or beside it on another thread); its holders stalled,
    either stopped or found taken over when they came back (an attempt ended ``lease_lost``: a
    lease run out by a skewed clock, a pause) or abandoned at their bound (a stopped holder
    that comes back finds its key taken over too: counted once); and its deliveries that met
    the database restarting (``pg-restart:outage``: a holder then can record neither its
    outcome nor its attempt's end, and its lease runs out as a dead one's). The holder's
    return takes a stall's crash back, but a claim in between may already have decided on it.
    An upper bound: an outage met before the claim held nothing."""
    died = sum(n for fault, n in req.struck.items()
               if fault.startswith(("kill:", "died_with_worker")))
    stopped = sum(n for fault, n in req.struck.items() if fault.startswith("stop:"))
    stalled = sum(1 for a in attempts
                  if a.outcome == Outcome.LEASE_LOST or a.error_class == HandlerTimedOut.__name__)
    return died + max(stopped, stalled) + req.struck["pg-restart:outage"]


def judge(
    requests: list[Request],
    evidence: Evidence,
    *,
    naive: bool,
    retries: Counter[int],
    stats: Counter[str],
    request_ids: dict[int, int] | None = None,
    correlation_prefix: str = "chaos-req-",
    now: float | None = None,
    count: Callable[[str, dict[str, Any]], int] | None = None,
    crash_loop_limit: int | None = None,
    rejected: set[int] | None = None,
) -> tuple[list[RequestVerdict], list[str]]:
    """The invariants over ``evidence``, per workload request: at most one effect, none lost,
    no stale write, poison permanent and never retried. ``request_ids`` maps a workload id to
    the request id the stores know it by (default: the same); the provider knows it by
    ``correlation_prefix`` + workload id. Unplanned takeovers are counted into ``stats``.
    ``count(job_type, payload)``, when given, is the effects the downstream holds for the
    request's intent (a ``--job-type`` run: through the job type's lookup hook), in place of
    the built-in mix's own counting. A crash-looping request must be dead-lettered as
    ``crash_loop`` with no effect; no other request may be, unless its workers died on it more
    than ``crash_loop_limit`` times as a claim sees it (:func:`apparent_deaths`). ``rejected``: the
    workload ids refused at the enqueue with the refusal kept (resident delivery: poison
    never becomes a request); a refused poison is kept, not lost, and a refused valid request
    is a violation."""
    now = time.time() if now is None else now
    violations: list[str] = []
    records, dlq, attempts_by_id = evidence.records, evidence.dlq, evidence.attempts
    verdicts = []
    for req in requests:
        rid = request_ids.get(req.id, -1) if request_ids is not None else req.row_id
        mine = attempts_by_id.get(rid, [])
        cid = f"{correlation_prefix}{req.id}"
        jt = get_job_type(req.job_type)
        try:
            key: str | None = jt.keying.key_for(jt.validate(dict(req.payload)))
        except ValidationError:
            key = None
        resends = allowed_resends = 0
        if count is not None:  # --job-type: what the downstream holds, through the lookup hook
            try:
                effects = count(req.job_type, req.payload)
            except Exception as exc:  # noqa: BLE001 - the verdict says it could not be asked
                effects = 0
                violations.append(f"lookup failed: request {req.id} ({req.job_type}): "
                                  f"{type(exc).__name__}: {exc}")
        else:  # the built-in mix: as the job type counts its arrivals and rows
            chaos = chaos_of(jt)
            arrivals = evidence.arrivals.get(cid, [])
            if chaos.count is None:
                effects = len(arrivals)
            else:
                counted = chaos.count(evidence.own.get(req.job_type), ChaosCase(
                    payload=req.payload, arrivals=arrivals, struck=req.struck,
                    takeovers=len({a.fence for a in mine if a.fence is not None}) - 1))
                effects, resends = counted.effects, counted.resends
                allowed_resends = counted.allowed_resends
                for stat, n in counted.stats.items():
                    stats[stat] += n
        record = records.get(key) if key else None
        status = record.status if record is not None else None
        dl = dlq.get(rid)
        in_dlq = dl is not None and dl.status == "open" and bool(dl.last_error)
        live = (status == "in_progress" and record is not None
                and (record.lease_expires_at or 0) > now)
        if naive:
            accounted = in_dlq or effects >= 1
        else:
            accounted = in_dlq or live or (status == "completed" and effects >= 1)
        refused = rejected is not None and req.id in rejected
        lost = not (accounted or refused)
        tag = f"request {req.id} ({req.job_type}, key {key})"
        if effects > 1:
            violations.append(f"duplicate effect: {tag} has {effects} effects")
        if resends > allowed_resends:
            violations.append(f"duplicate mail: {tag} sent {resends} resend(s) of one Message-ID"
                              f" but only {allowed_resends} after-effect fault(s) struck it")
        if dl is not None and dl.error_class == "unknown":
            violations.append(f"dead letter of class unknown (a worker or checker bug): {tag}:"
                              f" {dl.last_error}")
        if dl is not None and not dl.last_error:
            violations.append(f"dead letter without a reason: {tag}")
        if lost:
            violations.append(f"lost: {tag} neither completed with its effect, dead-lettered, "
                              f"nor live (status {status}, effects {effects})")
        if req.crash_loop:
            if dl is None or dl.error_class != "crash_loop" or effects:
                violations.append(f"crash loop not dead-lettered as crash_loop without an "
                                  f"effect: {tag} (class {dl and dl.error_class}, {effects})")
            else:
                stats["crash-loop"] += 1
        elif dl is not None and dl.error_class == "crash_loop":
            deaths = apparent_deaths(req, mine)
            if crash_loop_limit is None or deaths <= crash_loop_limit:
                violations.append(f"dead-lettered as crash_loop after {deaths} death(s), not "
                                  f"over the limit {crash_loop_limit}: {tag}")
        if refused and not req.poison:
            violations.append(f"refused at the enqueue though valid: {tag}")
        if req.poison and refused:
            stats["poison_refused_at_enqueue"] += 1
        elif req.poison:
            if dl is None or dl.error_class != "permanent":
                violations.append(f"poison not dead-lettered as permanent: {tag}")
            retried = [a for a in mine if a.outcome == "retried"]
            if retried or retries[req.id]:
                violations.append(f"poison retried: {tag}")
        if not naive and status == "completed" and record is not None:
            done = [a for a in mine if a.outcome == "completed"]
            if len(done) > 1:
                violations.append(f"stale write: {tag} has {len(done)} completed attempts")
            if any(int(a.fence) != int(record.fence) for a in done):
                violations.append(f"stale write: {tag} completed by fence "
                                  f"{[a.fence for a in done]}, record fence {record.fence}")
            fenced = chaos_of(jt).fenced
            if fenced is not None:
                found = fenced(evidence.own.get(req.job_type), req.payload, int(record.fence))
                if found is not None:
                    violations.append(f"stale write: {tag} {found}")
        verdicts.append(RequestVerdict(
            id=req.id, job_type=req.job_type, poison=req.poison,
            faults=sorted(req.faults | ({"poison"} if req.poison else set())),
            deliveries=req.deliveries, effects=effects, resends=resends, status=status,
            dead_lettered=dl is not None and dl.status != "resolved",
            dlq_class=dl.error_class if dl is not None else None,
            dlq_reason=(dl.last_error or "")[:200] if dl is not None else None,
            lost=lost,
        ))
    return verdicts, violations


def reconcile_double_charges(world: ChaosWorld) -> int:
    """The day's reconciliation run, with the payment checks, when the gateway holds more than
    one charge for one reference: what production's scheduled run does about a double charge.
    Returns the extra charges it marked for a refund."""
    per_reference = Counter(str(c.get("reference")) for c in world.gateway.charges())
    if not any(n > 1 for n in per_reference.values()):
        return 0
    # the run's orders are seconds old: no grace for in-flight work (every delivery settled),
    # and the workers' settle window
    # the gateway's client: the mix's downstream that dedupes by idempotency key
    at_gateway = ClientOptions(address=world.gateway.url)
    clients = {d.name: d.build(Settings.from_env(), at_gateway)
               for jt in mix_types() for d in jt.calls.clients if d.dedupes}
    report = Reconciler(world.db, store=IdempotencyStore(world.db), dlq=DlqStore(world.db),
                        clients=clients,
                        grace_seconds=0.0,
                        settle_seconds=world.config.settle_seconds).run()
    return int(report.fixed.get("double_charged", 0))


def fault_rows(verdicts: list[RequestVerdict]) -> list[dict[str, Any]]:
    """One row per fault (a request counts under every fault that touched it), then ``none``
    (untouched) and ``all``."""
    groups: dict[str, list[RequestVerdict]] = defaultdict(list)
    for v in verdicts:
        for f in v.faults or ["none"]:
            groups[f].append(v)
        groups["all"].append(v)
    order = sorted(k for k in groups if k not in ("none", "all")) + ["none", "all"]
    rows = []
    for name in order:
        vs = groups.get(name, [])
        if not vs:
            continue
        rows.append({
            "fault": name,
            "requests": len(vs),
            "deliveries": sum(v.deliveries for v in vs),
            "effects": sum(v.effects for v in vs),
            "duplicates": sum(max(0, v.effects - 1) for v in vs),
            "lost": sum(1 for v in vs if v.lost),
            "dead_lettered": sum(1 for v in vs if v.dead_lettered),
            "smtp_resends": sum(v.resends for v in vs),
        })
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    cols = ["fault", "requests", "deliveries", "effects", "duplicates", "lost", "dead_lettered",
            "smtp_resends"]
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in cols}
    lines = ["  ".join(c.ljust(widths[c]) for c in cols),
             "  ".join("-" * widths[c] for c in cols)]
    for r in rows:
        lines.append("  ".join(str(r[c]).ljust(widths[c]) for c in cols))
    return "\n".join(lines)


class ProgressBar:
    """A plain-text bar on stderr, redrawn in place."""

    def __init__(self, stream: IO[str] | None = None, width: int = 30) -> None:
        self.stream = stream or sys.stderr
        self.width = width

    def __call__(self, c: Coordinator) -> None:
        total = len(c.deliveries) or len(c.requests)  # resident: requests, not deliveries
        done = total - c.unsettled()
        filled = int(self.width * done / max(1, total))
        s = c.stats
        self.stream.write(
            f"\r[{'#' * filled}{'.' * (self.width - filled)}] {done}/{total} deliveries"
            f"  kills {s['kills']}  stops {s['stops']}  redis {s['redis-restart']}"
            f"  retries {sum(v for k, v in s.items() if k.startswith('error:'))}   "
        )
        self.stream.flush()

    def end(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


def run_chaos(config: ChaosConfig) -> ChaosReport:
    """One chaos run, start to verdict. Never raises for a violation: read ``report.ok``."""
    config.validate()
    started = time.monotonic()
    requests = build_workload(config)
    with ChaosWorld(config) as world:
        world.seed_stock(requests)
        counting, calibrations, unverified = _ground_truth(config, world)
        problems = [c.problem for c in calibrations if c.problem]
        if problems:  # nothing to judge with: the lookup the run would lean on is wrong
            cfg = asdict(config)
            cfg["faults"] = list(config.faults)
            return ChaosReport(
                config=cfg, finished=False, seconds=round(time.monotonic() - started, 1),
                deliveries=0, stats={"calibration_failed": len(problems)}, rows=[],
                violations=[*problems, "the fault run did not start: the lookup failed its "
                                       "calibration"],
                late_reports=[], counting=counting,
                calibration=[c.to_dict() for c in calibrations], unverified=unverified)
        driver = ResidentCoordinator if config.delivery == "resident" else Coordinator
        coordinator = driver(config, world, requests)
        bar = ProgressBar() if config.progress else None
        finished = coordinator.run(progress=bar)
        if bar is not None:
            bar.end()
        if not config.naive and "slow-provider" in config.faults:
            coordinator.stats["reconciled_double_charges"] = reconcile_double_charges(world)
        outbox_violations: list[str] = []
        if world.outbox_events:  # the relays' dead claims expire, then one more pass
            chaos_outbox.drain(world.db, config.lease_seconds,
                               time.monotonic() + 6 * config.lease_seconds + 10)
            outbox_stats, outbox_violations = chaos_outbox.judge_outbox(
                world.db, world.outbox_events, purged=coordinator.published_before_purge)
            coordinator.stats.update(outbox_stats)
        verdicts, violations = check(world, coordinator)
        violations.extend(outbox_violations)
        if not finished:
            violations.insert(0, f"the run did not settle within --timeout {config.timeout}s "
                                 f"({coordinator.unsettled()} deliveries unsettled)")
        stats = dict(coordinator.stats)
        stats["dispatches"] = coordinator.dispatches
        violations.extend(coordinator.unbounded)
        stats["longest_delivery_ms"] = int(coordinator.longest * 1000)
        stats["stall_bound_ms"] = int(coordinator.stall_bound * 1000)
        if coordinator.longest > coordinator.stall_bound:
            violations.append(f"unbounded stall: a delivery took {coordinator.longest:.0f}s, "
                              f"over the bound of {coordinator.stall_bound:.0f}s")
        if "clock-skew" in config.faults:
            stats["clock-skew"] = len(coordinator.skew_struck)
        if world.sandboxes is None:
            stats["gateway_charges"] = len(world.gateway.charges())
            stats["mails"] = len(world.sink.messages())
        if world.pg is not None:
            stats["pg_restarts_seen"] = world.pg_restarts_seen()
        if "evicting-redis" in config.faults:
            stats["eviction_refused"] = world.eviction_refused
            stats["eviction_seen"] = world.eviction_seen
            if world.eviction_refused < stats.get("evicting-redis", 0):
                violations.append("evicting-redis: a client's first use did not refuse the "
                                  "evicting Redis")
        stats.update(coordinator.fault_counts())
        # requests that should have exactly one effect: neither poison nor dead-lettered
        clean = [v for v in verdicts if not v.poison and not v.dead_lettered]
        stats["clean_requests"] = len(clean)
        stats["clean_effects"] = sum(v.effects for v in clean)
        unstruck = {k[:-len("_not_struck")]: n for k, n in stats.items()
                    if k.endswith("_not_struck") and n}
        if unstruck:
            logger.warning("faults planned but never struck (the run settled first): %s "
                           "of %s", unstruck,
                           {k: stats[f"{k}_scheduled"] for k in unstruck})
        cfg = asdict(config)
        cfg["faults"] = list(config.faults)
        return ChaosReport(
            config=cfg,
            finished=finished,
            seconds=round(time.monotonic() - started, 1),
            deliveries=(coordinator.dispatches if isinstance(coordinator, ResidentCoordinator)
                        else len(coordinator.deliveries)),
            stats=stats,
            rows=fault_rows(verdicts),
            violations=violations,
            late_reports=coordinator.late[:50] + coordinator.stop_log,
            state_dir=str(world.state) if config.keep_state else None,
            dead_letters=[
                {"request": v.id, "job_type": v.job_type, "class": v.dlq_class,
                 "reason": v.dlq_reason, "faults": v.faults, "effects": v.effects}
                for v in verdicts if v.dead_lettered and not v.poison
            ],
            counting=counting,
            calibration=[c.to_dict() for c in calibrations],
            unverified=unverified,
        )


def _ground_truth(config: ChaosConfig, world: ChaosWorld
                  ) -> tuple[dict[str, str], list[Calibration], list[str]]:
    """A ``--job-type`` run's counting per job type, its lookups' calibration (before any
    fault) and what stays unverified; nothing for the built-in mix, which counts at its own
    sandbox's records."""
    if world.sandboxes is None:
        return {}, [], []
    truth = GroundTruth(world.sandboxes)
    counting: dict[str, str] = {}
    calibrations: list[Calibration] = []
    unverified: list[str] = []
    for jt in job_types_of(config.job_types, ChaosConfigError):
        counting[jt.name] = truth.counted_by(jt)
        if counting[jt.name] != RECORD:
            if config.require_record:
                raise ChaosConfigError(unverified_note(jt) + "; --require-record refuses it")
            unverified.append(unverified_note(jt))
        if config.calibration_runs == 0:
            unverified.append(f"{jt.name}: its lookup was not calibrated (--calibration-runs 0)")
            continue
        done = calibrate(jt, world.sandboxes, world.state, runs=config.calibration_runs,
                         keys=config.calibration_keys, offset=config.requests + 1000,
                         lease=config.lease_seconds, settle=config.settle_seconds)
        calibrations.append(done)
        if done.note:
            unverified.append(done.note)
    return counting, calibrations, unverified
