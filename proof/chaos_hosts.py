"""``sekali chaos --topology hosts``: the chaos workload through the several-host deployment.

One run builds its own ``sekali cluster`` (:mod:`sandbox.hosts`: a store host with Postgres
and Redis, a control host with dagster-webserver and dagster-daemon, a provider host with the
sandbox gateway and mail sink, N worker hosts each with a code server), enqueues the workload of
:func:`proof.chaos.build_workload` on the store host's database (no poison: refusals at enqueue
are proven elsewhere), and lets the resident worker runs of every worker host (the default:
each location's ``worker_supervisor`` keeps them) claim it, the workload spread over the
nemesis; or, with another delivery, over ``enqueue_seconds`` with the intake sensors launching
the runs on the worker hosts. Meanwhile a nemesis, on a seeded schedule, one fault at a time:

- partitions (iptables ``DROP`` in both hosts' namespaces, never ``REJECT``: connects and open
  connections time out) between a worker host and the store, a worker host and the provider,
  and the control host and a worker host, each healed after ``partition_seconds``;
- SIGKILL of a run process on a worker host (a child of that host's code server);
- a restart of Redis on the store host.

A partition *struck* when a run was in flight on the cut worker host while it lasted (sampled
every half second); a kill struck when there was a run process to kill. After the last heal the
run waits until every request is settled (``completed``, or ``failed`` with its dead letter) and
no run is queued or in flight, for at most ``settle_bound`` seconds: the bound this run states and
checks. Then the verdict comes from the provider's own records (charges, mails by correlation id)
and the stores, through the same checker as the one-host harness (:func:`proof.chaos.judge`):
no duplicate effect, nothing lost, no stale write; plus every run ended (no stall outlives the
bound), no Dagster run left open at the end (the resident worker runs, which stay by design,
ended by the harness as an operator would: :func:`end_worker_runs`), and ``cluster down`` left
nothing behind.

Why the bound is what it is (defaults): run monitoring polls every 30 s and fails a run whose
process died; the run retry starts it again (up to 2); Postgres calls end within 35 s and Redis
calls within 7 s, a TCP connection that outlived a partition resumes at its next retransmission
(within ~30 s for the partitions here); an intake claim left ``launched`` is re-emitted after
``SEKALI_INTAKE_RELAUNCH_AFTER`` (60 s here), and the payment settle window is 20 s here (the
sandbox provider answers within milliseconds; production keeps 120 s). 300 s covers a chain of
the longest of these with room for the shared machine.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import text

from engine.intake import enqueue
from proof.chaos import (
    ChaosConfig,
    ChaosConfigError,
    Request,
    build_workload,
    fault_rows,
    gather_evidence,
    judge,
    seed_stock,
)
from resources.storage.db import Database
from sandbox.gateway import GatewayServer
from sandbox.hosts import Cluster, ClusterError, NotRoot, processes, require_root
from sandbox.mailsink import MailSink
from sensors.workers import WORKER_JOB

SUPERVISOR = "worker_supervisor"

logger = logging.getLogger(__name__)

PARTITION_KINDS = ("worker-store", "worker-provider", "control-worker")
HOSTS_DELIVERIES = ("resident", "per_request", "fan_out", "micro_batch")
CORRELATION_PREFIX = "chaos-hosts-"
RUN_DONE = ("SUCCESS", "FAILURE", "CANCELED")


@dataclass
class HostsConfig:
    """One hosts run's knobs; the defaults give a run of a few minutes on a small machine."""

    requests: int = 100
    worker_hosts: int = 2
    seed: int = 1
    partitions: int = 6  # cycles through PARTITION_KINDS
    partition_seconds: float = 12.0
    gap_seconds: float = 4.0
    kills: int = 2
    redis_restarts: int = 1
    enqueue_seconds: float = 60.0
    settle_bound: float = 300.0
    intake_mode: str = "resident"  # resident workers, or the intake's per_request/fan_out/...
    batch_size: int = 10
    workers_per_host: str = "light=1,heavy=1"  # resident: SEKALI_WORKERS of each worker host
    close_bound: float = 120.0  # resident: the worker runs end within this once told to
    up_timeout: float = 300.0
    keep: bool = False  # leave the cluster up (state folder printed) instead of `down`

    def validate(self) -> None:
        if self.requests < 1 or self.worker_hosts < 1:
            raise ChaosConfigError("--requests and --workers-hosts must be >= 1")
        if self.partitions < 0 or self.kills < 0 or self.redis_restarts < 0:
            raise ChaosConfigError("fault counts must be >= 0")
        if self.intake_mode not in HOSTS_DELIVERIES:
            raise ChaosConfigError(f"delivery: {', '.join(HOSTS_DELIVERIES)}")
        if self.partition_seconds <= 0 or self.settle_bound <= 0:
            raise ChaosConfigError("the partition seconds and the settle bound must be positive")

    @property
    def spread_seconds(self) -> float:
        """How long the workload is enqueued over: ``enqueue_seconds``, or with resident workers
        (which run each request within milliseconds) the nemesis's length, so that requests
        arrive while every fault strikes."""
        if not self.resident:
            return self.enqueue_seconds
        nemesis = (self.partitions * (self.partition_seconds + self.gap_seconds)
                   + (self.kills + self.redis_restarts) * self.gap_seconds)
        return max(self.enqueue_seconds, nemesis)

    @property
    def resident(self) -> bool:
        return self.intake_mode == "resident"

    def worker_env(self) -> dict[str, str]:
        if self.resident:
            return {
                "SEKALI_INTAKE_MODE": "resident",
                "SEKALI_WORKERS": self.workers_per_host,
                "SEKALI_WORKER_BATCH": str(self.batch_size),
                "SEKALI_GATEWAY_SETTLE_SECONDS": "20",
            }
        return {
            "SEKALI_INTAKE_MODE": self.intake_mode,
            "SEKALI_INTAKE_BATCH_SIZE": str(self.batch_size),
            # below the backlog, so both worker locations' intake sensors get batches
            "SEKALI_INTAKE_MAX_PER_TICK": str(2 * self.batch_size),
            "SEKALI_INTAKE_RELAUNCH_AFTER": "60",
            "SEKALI_GATEWAY_SETTLE_SECONDS": "20",
        }


@dataclass
class HostsReport:
    config: dict[str, Any]
    seconds: float
    stats: dict[str, Any]
    rows: list[dict[str, Any]]
    violations: list[str]
    nemesis: list[dict[str, Any]] = field(default_factory=list)
    dead_letters: list[dict[str, Any]] = field(default_factory=list)
    state_dir: str | None = None

    @property
    def ok(self) -> bool:
        return not self.violations

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


# -- what runs where ---------------------------------------------------------------------------


def run_processes(cluster: Cluster, host: str) -> list[int]:
    """Pids of Dagster run processes on ``host`` now: the code server's ``StartRun`` spawns
    each run as a ``multiprocessing`` child (``spawn_main ... --multiprocessing-fork``)."""
    out = []
    for pid in cluster.pids(host):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in argv or b"execute_run" in argv:
            out.append(pid)
    return out


def in_flight_requests(db: Database) -> set[int]:
    with db.statement() as conn:
        rows = conn.execute(text(
            "SELECT id FROM job_requests WHERE status IN ('launched', 'running')"
        )).all()
    return {int(r[0]) for r in rows}


# -- the nemesis -------------------------------------------------------------------------------


@dataclass
class Strike:
    kind: str
    hosts: list[str]
    started_at: float
    ended_at: float | None = None
    struck: bool = False
    runs_seen: int = 0
    requests: list[int] = field(default_factory=list)  # in flight when it began
    wall: tuple[float, float | None] = (0.0, None)  # when it began and ended, wall clock


def plan(config: HostsConfig, workers: list[str]) -> list[tuple[str, list[str]]]:
    """The nemesis's schedule: partitions cycling through the kinds, kills and Redis restarts
    spread between them; seeded."""
    rng = random.Random(config.seed)
    events: list[tuple[str, list[str]]] = []
    for i in range(config.partitions):
        kind = PARTITION_KINDS[i % len(PARTITION_KINDS)]
        worker = rng.choice(workers)
        other = {"worker-store": "store", "worker-provider": "provider",
                 "control-worker": "control"}[kind]
        events.append((f"partition:{kind}", [worker, other]))
    for _ in range(config.kills):
        events.insert(rng.randrange(len(events) + 1), ("kill", [rng.choice(workers)]))
    for _ in range(config.redis_restarts):
        events.insert(rng.randrange(1, len(events) + 1), ("redis-restart", ["store"]))
    return events


class Nemesis:
    """Runs the schedule against the cluster, one fault at a time, and records what struck."""

    def __init__(self, cluster: Cluster, db: Database, config: HostsConfig,
                 say: Callable[[str], None]) -> None:
        self.cluster = cluster
        self.db = db
        self.config = config
        self.say = say
        self.strikes: list[Strike] = []
        self.last_heal: float | None = None

    def run(self, events: list[tuple[str, list[str]]], started: float) -> None:
        for kind, hosts in events:
            began = time.time()
            if kind.startswith("partition:"):
                self._partition(kind, hosts)
            elif kind == "kill":
                self._kill(hosts[0])
            else:
                self._restart_redis()
            self.strikes[-1].wall = (began, time.time())
            time.sleep(self.config.gap_seconds)
        self.say(f"nemesis done after {time.monotonic() - started:.0f} s")

    def _partition(self, kind: str, hosts: list[str]) -> None:
        worker = hosts[0]
        strike = Strike(kind, hosts, time.monotonic(), requests=sorted(in_flight_requests(self.db)))
        self.strikes.append(strike)
        self.cluster.partition(hosts[0], hosts[1])
        self.say(f"partition {hosts[0]} <-> {hosts[1]} for {self.config.partition_seconds:.0f} s")
        try:
            end = time.monotonic() + self.config.partition_seconds
            seen: set[int] = set()
            while time.monotonic() < end:
                seen.update(run_processes(self.cluster, worker))
                time.sleep(0.5)
            strike.runs_seen = len(seen)
            strike.struck = bool(seen)
        finally:
            self.cluster.heal(hosts[0], hosts[1])
            strike.ended_at = self.last_heal = time.monotonic()

    def _kill(self, worker: str) -> None:
        strike = Strike("kill", [worker], time.monotonic())
        self.strikes.append(strike)
        deadline = time.monotonic() + 20.0  # wait a little for a run to be there
        while time.monotonic() < deadline:
            pids = run_processes(self.cluster, worker)
            if pids:
                strike.requests = sorted(in_flight_requests(self.db))
                with contextlib.suppress(ProcessLookupError):
                    os.kill(random.Random(self.config.seed + len(self.strikes)).choice(pids),
                            signal.SIGKILL)
                    strike.struck = True
                    strike.runs_seen = len(pids)
                    self.say(f"SIGKILL a run process on {worker}")
                break
            time.sleep(0.5)
        else:
            self.say(f"no run process on {worker} to kill within 20 s")
        strike.ended_at = time.monotonic()

    def _restart_redis(self) -> None:
        strike = Strike("redis-restart", ["store"], time.monotonic(),
                        requests=sorted(in_flight_requests(self.db)))
        self.strikes.append(strike)
        self.cluster.kill("store", "redis")  # SIGKILL: what it had not saved is gone
        processes.wait_gone([self.cluster.process("store", "redis")], timeout=10.0)
        self.cluster.start("store", "redis")
        strike.struck = bool(strike.requests)
        strike.ended_at = time.monotonic()
        self.say("Redis on the store host killed and started again")

    def stats(self) -> dict[str, int]:
        out: Counter[str] = Counter()
        for s in self.strikes:
            family = "partition" if s.kind.startswith("partition:") else s.kind
            out[f"{family}_planned"] += 1
            out[f"{family}_struck"] += int(s.struck)
            if family == "partition":
                name = s.kind.split(":", 1)[1].replace("-", "_")
                out[f"partition_{name}_planned"] += 1
                out[f"partition_{name}_struck"] += int(s.struck)
        return dict(out)


# -- the run -----------------------------------------------------------------------------------


def _enqueue_all(db: Database, requests: list[Request], seconds: float,
                 ids: dict[int, int], redis_url: str) -> None:
    """Enqueue the workload spread evenly over ``seconds``; ``ids`` gets workload id -> request
    id as each is written. Each enqueue wakes the resident workers through the cluster's Redis
    (the producer's ``REDIS_URL``)."""
    before = os.environ.get("REDIS_URL")
    os.environ["REDIS_URL"] = redis_url
    try:
        started = time.monotonic()
        for n, req in enumerate(requests):
            due = started + seconds * n / max(1, len(requests))
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            result = enqueue(req.job_type, dict(req.payload),
                             correlation_id=f"{CORRELATION_PREFIX}{req.id}", db=db,
                             source="chaos")
            ids[req.id] = result.id
    finally:
        if before is None:
            os.environ.pop("REDIS_URL", None)
        else:
            os.environ["REDIS_URL"] = before


def _settled(db: Database, ids: dict[int, int]) -> tuple[int, int]:
    """(settled requests, all): completed, or failed with a dead letter."""
    with db.statement() as conn:
        rows = conn.execute(text(
            "SELECT r.id, r.status, d.id AS dlq FROM job_requests r "
            "LEFT JOIN dlq_records d ON d.request_id = r.id"
        )).all()
    status = {int(r.id): (r.status, r.dlq) for r in rows}
    done = 0
    for rid in ids.values():
        st, dlq = status.get(rid, (None, None))
        if st == "completed" or (st == "failed" and dlq is not None):
            done += 1
    return done, len(ids)


def _runs_open(cluster: Cluster, *, workers: bool = True) -> list[dict[str, Any]]:
    """The runs not ended; without the resident worker runs (which stay by design) unless
    ``workers``."""
    return [r for r in cluster.graphql().runs(limit=2000) if r["status"] not in RUN_DONE
            and (workers or r["jobName"] != WORKER_JOB)]


RETERMINATE_SECONDS = 30.0
"""How long a worker run told to end may stay open before it is told again."""


def end_worker_runs(cluster: Cluster, bound: float, say: Callable[[str], None]
                    ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """End the deployment's resident workers as an operator does from the UI: every location's
    worker supervisor stopped (so nothing relaunches them), then every worker run terminated
    (it finishes its batch and ends CANCELED), each run launched meanwhile too. A termination
    the launcher could not deliver (``TerminateRunFailure``: the run's code server did not
    answer in time, as on a loaded host) is asked again on the next turn, and one delivered
    but not yet seen through every ``RETERMINATE_SECONDS``, as an operator clicks again.
    Returns the runs still open after ``bound`` seconds (none, when every run ended) and what
    it took."""
    gql = cluster.graphql()
    for worker in cluster.workers:
        assert worker.location is not None
        state = gql.instigators(worker.location).get(f"sensor:{SUPERVISOR}")
        if state is not None and state[1] == "RUNNING":
            gql.stop_instigator("sensor", state[0])
    started = time.monotonic()
    asked: dict[str, float] = {}  # run id -> when its termination was last delivered
    failed = 0
    while True:
        still = _runs_open(cluster)
        now = time.monotonic()
        for run in still:
            run_id = run["runId"]
            if run["jobName"] != WORKER_JOB or now - asked.get(run_id, -math.inf) < (
                    RETERMINATE_SECONDS):
                continue
            try:
                answer = gql.terminate_run(run_id)
            except ClusterError as exc:
                answer = f"{exc}"
            if answer == "TerminateRunSuccess":
                asked[run_id] = now
            else:
                failed += 1
                say(f"terminating worker run {run_id} not delivered ({answer}): asked again")
        if not still or time.monotonic() - started > bound:
            break
        time.sleep(2.0)
    say(f"{len(asked)} worker run(s) told to end; {len(still)} run(s) open after "
        f"{time.monotonic() - started:.0f} s")
    return still, {"worker_runs_terminated": len(asked), "terminations_not_delivered": failed,
                   "runs_closed_seconds": round(time.monotonic() - started, 1)}


def run_hosts_chaos(
    config: HostsConfig, say: Callable[[str], None] = lambda _m: None
) -> HostsReport:
    """One hosts chaos run, start to verdict (and ``cluster down``). Never raises for a
    violation: read ``report.ok``. Raises :class:`ChaosConfigError` without root."""
    config.validate()
    try:
        require_root()
    except NotRoot as exc:
        raise ChaosConfigError(f"--topology hosts {exc}") from exc
    started = time.monotonic()
    requests = build_workload(ChaosConfig(requests=config.requests, seed=config.seed, faults=()))
    root = Path(tempfile.mkdtemp(prefix="sekali-chaos-hosts-", dir="/tmp"))  # nosec B108: mkdtemp: a fresh 0700 folder
    root.chmod(0o755)  # the private PostgreSQL runs as user postgres
    cluster = Cluster(root / "cluster")
    violations: list[str] = []
    stats: dict[str, Any] = {"cluster_id": cluster.cluster_id}
    nemesis_log: list[dict[str, Any]] = []
    verdicts: list[Any] = []
    try:
        cluster.up(config.worker_hosts, worker_env=config.worker_env(),
                   timeout=config.up_timeout, progress=say)
        db = Database.from_url(cluster.database_url, pool_size=2, max_overflow=2)
        try:
            seed_stock(db, requests)
            ids: dict[int, int] = {}
            producer = threading.Thread(target=_enqueue_all, name="chaos-hosts-enqueue",
                                        args=(db, requests, config.spread_seconds, ids,
                                              cluster.redis_url),
                                        daemon=True)
            producer.start()
            nemesis = Nemesis(cluster, db, config, say)
            events = plan(config, [w.name for w in cluster.workers])
            time.sleep(min(10.0, config.enqueue_seconds / 4))  # the first runs get going
            nemesis.run(events, started)
            producer.join()
            heal_at = nemesis.last_heal or time.monotonic()
            cluster.heal_all()
            say(f"all {len(ids)} requests enqueued; waiting up to {config.settle_bound:.0f} s "
                "after the last heal for every request to settle")
            deadline = heal_at + config.settle_bound
            settled_at = None
            open_runs: list[dict[str, Any]] = []
            while True:
                done, total = _settled(db, ids)
                open_runs = (_runs_open(cluster, workers=not config.resident)
                             if done == total else [])
                if done == total and not open_runs:
                    settled_at = time.monotonic()
                    break
                if time.monotonic() > deadline:
                    break
                time.sleep(2.0)
            if settled_at is None:
                violations.append(
                    f"not settled within {config.settle_bound:.0f} s after the last heal: "
                    f"{total - done} of {total} requests unsettled, {len(open_runs)} runs open"
                )
            if config.resident:  # the worker runs stay by design: the harness ends them
                still, closing = end_worker_runs(cluster, config.close_bound, say)
                stats.update(closing)
            else:
                still = _runs_open(cluster)
            stats["runs_open_at_end"] = len(still)
            if still:
                violations.append(
                    f"{len(still)} Dagster run(s) still open at the end: " + ", ".join(
                        f"{r['runId']} ({r['jobName']} on {r['location']}, {r['status']})"
                        for r in still[:10]))
            held = in_flight_requests(db)
            if held:
                violations.append(f"requests still held by a run at the end: {sorted(held)[:20]}")
            provider = cluster.state_dir / "provider"
            charges = GatewayServer(db_url=f"sqlite:///{provider / 'gateway.db'}").charges()
            mails = MailSink(db_url=f"sqlite:///{provider / 'mailsink.db'}").messages()
            evidence = gather_evidence(db, [*charges, *mails])
            for req in requests:  # the table's "deliveries" column: attempts recorded here
                req.deliveries = len(evidence.attempts.get(ids.get(req.id, -1), []))
            takeovers: Counter[str] = Counter()
            verdicts, found = judge(requests, evidence, naive=False, retries=Counter(),
                                    stats=takeovers, request_ids=ids,
                                    correlation_prefix=CORRELATION_PREFIX)
            violations += found
            by_request = {rid: req for req, rid in ids.items()}
            touched: dict[int, set[str]] = {}
            attempts = _attempts(db)
            for s in nemesis.strikes:
                began, ended = s.wall
                hosts = {f"sekali-{h}" for h in s.hosts}
                during = {rid for rid, host, at in attempts if began <= at <= (ended or began)
                          and (s.kind == "redis-restart" or host in hosts)}
                for rid in set(s.requests) | during:
                    if rid in by_request:
                        touched.setdefault(by_request[rid], set()).add(s.kind)
            for v in verdicts:
                v.faults = sorted(touched.get(v.id, set()))
            runs = [r for r in cluster.graphql().runs(limit=2000)]
            spans = [r["endTime"] - r["startTime"] for r in runs
                     if r.get("startTime") and r.get("endTime")]
            stats.update(nemesis.stats())
            stats.update(
                requests=len(ids),
                completed=sum(1 for v in verdicts if v.status == "completed"),
                dead_lettered=sum(1 for v in verdicts if v.dead_lettered),
                gateway_charges=len(charges),
                mails=len(mails),
                takeovers_unplanned=takeovers["takeovers_unplanned"],
                runs=len(runs),
                runs_failed=sum(1 for r in runs if r["status"] == "FAILURE"),
                run_seconds_max=round(max(spans), 1) if spans else 0,
                settle_bound_seconds=config.settle_bound,
                settled_seconds_after_last_heal=(
                    round(settled_at - heal_at, 1) if settled_at is not None else None),
                attempts_by_host=dict(Counter(
                    str(r[0]) for r in _attempt_hosts(db))),
            )
            nemesis_log = [{**asdict(s), "started_at": round(s.started_at - started, 1),
                            "ended_at": round((s.ended_at or s.started_at) - started, 1),
                            "requests": len(s.requests)} for s in nemesis.strikes]
        finally:
            db.dispose()
    except ClusterError as exc:
        violations.insert(0, f"the cluster failed: {exc}")
    finally:
        if config.keep:
            say(f"cluster left up: sekali cluster down --state {cluster.state_dir}")
        else:
            try:
                cluster.down(purge=True)
                left = cluster.leftovers()
                stats["leftovers_after_down"] = sum(len(v) for v in left.values())
                if any(left.values()):
                    violations.append(f"cluster down left {left}")
            except ClusterError as exc:
                violations.append(f"cluster down failed: {exc}")
            shutil.rmtree(root, ignore_errors=True)
    if stats.get("partition_planned") and not stats.get("partition_struck"):
        violations.append("no partition struck (no run was in flight on a cut host)")
    return HostsReport(
        config=asdict(config),
        seconds=round(time.monotonic() - started, 1),
        stats=stats,
        rows=fault_rows(verdicts) if verdicts else [],
        violations=violations,
        nemesis=nemesis_log,
        dead_letters=[{"request": v.id, "job_type": v.job_type, "class": v.dlq_class,
                       "reason": v.dlq_reason, "faults": v.faults}
                      for v in verdicts if v.dead_lettered],
        state_dir=str(cluster.state_dir) if config.keep else None,
    )


def _attempts(db: Database) -> list[tuple[int, str, float]]:
    """(request id, host, start) of every attempt: which requests a strike met."""
    with db.statement() as conn:
        rows = conn.execute(text(
            "SELECT request_id, host, started_at FROM job_attempts WHERE request_id IS NOT NULL"
        )).all()
    return [(int(r[0]), str(r[1]), float(r[2])) for r in rows]


def _attempt_hosts(db: Database) -> list[Any]:
    with db.statement() as conn:
        return list(conn.execute(text("SELECT host FROM job_attempts")).all())

