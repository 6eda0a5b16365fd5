"""Throughput across hosts: jobs/s end to end on ``sekali cluster`` with 1 and 2 worker hosts,
per intake mode, and what each job costs the shared servers.

For each worker count (1, 2) and intake mode (``per_request``, ``fan_out``, ``micro_batch``) a
fresh cluster is built (``Cluster.up``, the production Dagster instance, the worker hosts'
environment setting ``SEKALI_INTAKE_MODE``), then:

1. idle: counters over ``IDLE_SECONDS`` with nothing to do, half before the load and half after
   it (the daemon's sensors, schedules, heartbeats and run monitoring keep Postgres busy even
   then): the background rate;
2. load: ``n`` ``send_email`` requests are enqueued on the store host's database; the clock runs
   from the first enqueue until every request is ``completed`` (the intake sensors launch the
   runs on the worker hosts, the mails go to the provider host's SMTP sink);
3. per job: deltas of CPU seconds per host role (a cgroup per host: every process on it,
   ended run workers included), PostgreSQL statements (``pg_stat_statements`` calls, by database and
   statement kind; BEGIN/COMMIT included), commits and rows written (``pg_stat_database``), WAL
   bytes (``pg_stat_wal``), Redis commands (``INFO commandstats``), Dagster runs and event-log
   rows, each gross and net of the idle rate over the same time.

Batches are 25 requests (fan-out) and 50 (micro-batch); an intake tick claims at most two
batches (six requests per-request), so with two worker locations both intake sensors get work.
The production ``dagster.yaml`` launches runs from a thread pool (``dequeue_use_threads``); one
more cluster measures per-request with the run queue launching one run at a time (Dagster's
default), where each launch waits for the code server to start the run's process. Each run
reports enqueue-to-start latency per intake mode: from a request's enqueue to the start of the
first run that took it (intake tick, run queue and launch).

Once, on the first cluster, the store host's own capacity on this machine: ``pgbench`` (TPC-B
like without the teller/branch updates, ``-N``; and select-only ``-S``) and ``redis-benchmark``
(SET, GET, INCR, a one-key EVAL), run inside the store namespace against the private servers.

Needs root (network namespaces); without it the suite reports why and measures nothing.

    .venv/bin/python -m benchmarks.cluster [--quick] [--json]
"""

from __future__ import annotations

import csv
import io
import logging
import os
import re
import secrets
import shutil
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import redis

from benchmarks.suite import module_main
from engine import tags as tag
from engine.attempts import AttemptRecorder
from engine.intake import enqueue
from resources.storage.db import Database
from sandbox.hosts import Cluster

MODES = ("per_request", "fan_out", "micro_batch")
WORKER_COUNTS = (1, 2)
IDLE_SECONDS = 20.0
SIZES = {
    True: {"per_request": 6, "fan_out": 50, "micro_batch": 150},  # --quick
    False: {"per_request": 16, "fan_out": 100, "micro_batch": 400},
}
BATCH_SIZE = {"per_request": 1, "fan_out": 25, "micro_batch": 50}
PER_TICK = {"per_request": 6, "fan_out": 2 * BATCH_SIZE["fan_out"],
            "micro_batch": 2 * BATCH_SIZE["micro_batch"]}
"""Requests one intake tick may claim. Below the backlog, so with two worker locations both
intake sensors (competing consumers) get a share; above what the run queue drains per tick,
so intake is not what is measured."""
SERIAL_DEQUEUE = {"run_coordinator": {"config": {"dequeue_use_threads": False}}}
"""The variant measured beside the production instance: the run queue launches runs one after
another (Dagster's default; each launch waits for the code server to start the run's process)
instead of from the production profile's thread pool."""
CONFIGS: list[tuple[str, int, str, dict[str, Any]]] = [
    *[(f"{mode}/{w}", w, mode, {}) for w in WORKER_COUNTS for mode in MODES],
    ("per_request/2/serial_dequeue", 2, "per_request", SERIAL_DEQUEUE),
]

STATEMENT_KINDS = ("select", "insert", "update", "delete", "with", "other")


def _say(message: str) -> None:
    print(f"   cluster: {message}", flush=True)


@contextmanager
def cluster_of(
    workers: int, mode: str, root: Path, overrides: dict[str, Any] | None = None
) -> Iterator[Cluster]:
    cluster = Cluster(root / f"w{workers}-{mode}{'-tuned' if overrides else ''}")
    env = {
        "SEKALI_INTAKE_MODE": mode,
        "SEKALI_INTAKE_BATCH_SIZE": str(BATCH_SIZE[mode]),
        "SEKALI_INTAKE_MAX_PER_TICK": str(PER_TICK[mode]),
    }
    started = time.monotonic()
    try:
        cluster.up(workers, worker_env=env, timeout=300, instance_overrides=overrides)
        _say(f"{workers} worker host(s), {mode}{' ' + str(overrides) if overrides else ''}: "
             f"up in {time.monotonic() - started:.0f} s")
        yield cluster
    finally:
        cluster.down(purge=True)


# -- counters --------------------------------------------------------------------------------


def snapshot(cluster: Cluster) -> dict[str, Any]:
    """Every counter at once (the snapshot's own queries are subtracted by :func:`delta`)."""
    out: dict[str, Any] = {"at": time.monotonic()}
    with psycopg.connect(cluster.admin_conninfo(), autocommit=True) as conn:
        kinds: dict[str, dict[str, int]] = {}
        for datname, query, calls in conn.execute(
            # the superuser's statements are the measurement's own (snapshots, polling)
            "SELECT d.datname, s.query, s.calls FROM pg_stat_statements s "
            "JOIN pg_database d ON d.oid = s.dbid JOIN pg_roles r ON r.oid = s.userid "
            "WHERE d.datname IN ('sekali', 'dagster') AND r.rolname <> 'postgres'"
        ).fetchall():
            word = (query.lstrip().split(None, 1) or ["other"])[0].lower()
            kind = word if word in STATEMENT_KINDS else "other"
            db = kinds.setdefault(datname, dict.fromkeys(STATEMENT_KINDS, 0))
            db[kind] += int(calls)
        out["statements"] = kinds
        out["database"] = {
            name: {"commits": int(c), "rows_written": int(i) + int(u) + int(d)}
            for name, c, i, u, d in conn.execute(
                "SELECT datname, xact_commit, tup_inserted, tup_updated, tup_deleted "
                "FROM pg_stat_database WHERE datname IN ('sekali', 'dagster')"
            ).fetchall()
        }
        wal = conn.execute("SELECT wal_records, wal_bytes FROM pg_stat_wal").fetchone()
        out["wal"] = {"records": int(wal[0]), "bytes": int(wal[1])} if wal else {}
    with psycopg.connect(cluster.admin_conninfo("dagster"), autocommit=True) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM runs), (SELECT count(*) FROM event_logs), "
            "(SELECT count(*) FROM event_logs e JOIN run_tags t ON t.run_id = e.run_id "
            " AND t.key = 'sekali/intake')"
        ).fetchone()
        assert row is not None
        out["dagster"] = {"runs": int(row[0]), "events": int(row[1]),
                          "intake_run_events": int(row[2])}
        intake_runs = conn.execute(
            "SELECT count(*) FROM run_tags WHERE key = 'sekali/intake'"
        ).fetchone()
        out["dagster"]["intake_runs"] = int(intake_runs[0]) if intake_runs else 0
    out["cpu"] = cluster.cpu_seconds()
    out["roles"] = {h.name: h.role for h in cluster.hosts}
    out["redis_by_command"] = cluster.redis_commands()
    out["redis"] = sum(out["redis_by_command"].values())
    return out


def delta(after: dict[str, Any], before: dict[str, Any], polls: int = 0) -> dict[str, float]:
    """Flat counter deltas without the measurement's own work: statements of the superuser
    are not counted at all; commits are corrected for the ``before`` snapshot's two autocommit
    reads in ``dagster`` and the ``polls`` autocommit reads of ``job_requests``; Redis for the
    INFO."""
    flat: dict[str, float] = {"seconds": after["at"] - before["at"]}
    for db in ("sekali", "dagster"):
        for kind in STATEMENT_KINDS:
            flat[f"pg_{db}_{kind}"] = (after["statements"].get(db, {}).get(kind, 0)
                                       - before["statements"].get(db, {}).get(kind, 0))
        flat[f"pg_{db}_statements"] = sum(flat[f"pg_{db}_{k}"] for k in STATEMENT_KINDS)
        flat[f"pg_{db}_commits"] = (after["database"][db]["commits"]
                                    - before["database"][db]["commits"])
        flat[f"pg_{db}_rows_written"] = (after["database"][db]["rows_written"]
                                         - before["database"][db]["rows_written"])
    flat["pg_dagster_commits"] -= 2  # the before snapshot's reads of runs/event_logs/run_tags
    flat["pg_sekali_commits"] -= polls
    flat["pg_statements"] = flat["pg_sekali_statements"] + flat["pg_dagster_statements"]
    flat["pg_writes"] = sum(flat[f"pg_{db}_{k}"] for db in ("sekali", "dagster")
                            for k in ("insert", "update", "delete", "with"))
    flat["pg_commits"] = flat["pg_sekali_commits"] + flat["pg_dagster_commits"]
    flat["wal_bytes"] = after["wal"].get("bytes", 0) - before["wal"].get("bytes", 0)
    flat["redis_commands"] = after["redis"] - before["redis"] - 1  # the INFO itself
    for key in ("runs", "events", "intake_runs", "intake_run_events"):
        flat[f"dagster_{key}"] = after["dagster"][key] - before["dagster"][key]
    for role in ("worker", "control", "store", "provider"):  # CPU seconds, all hosts of a role
        hosts = [h for h, r in after["roles"].items() if r == role and h in after["cpu"]]
        flat[f"cpu_{role}_s"] = sum(after["cpu"][h] - before["cpu"].get(h, 0.0) for h in hosts)
    return flat


# -- one measurement -------------------------------------------------------------------------


def payloads(tag: str, n: int) -> list[dict[str, str]]:
    return [{"template": "welcome", "user_id": f"{tag}-{i}", "date": "2026-11-30",
             "to": f"u{i}@example.com"} for i in range(n)]


def measure(cluster: Cluster, mode: str, n: int) -> dict[str, Any]:
    time.sleep(5.0)  # first ticks of every sensor (cursors set) are not the idle rate
    idle_start = snapshot(cluster)
    time.sleep(IDLE_SECONDS / 2)
    idle_first = delta(snapshot(cluster), idle_start)
    db = Database.from_url(cluster.database_url, pool_size=2, max_overflow=2)
    # polling as the superuser, one autocommit read each: left out of the counts (see delta)
    poller = psycopg.connect(cluster.admin_conninfo("sekali"), autocommit=True)
    polls = 0
    try:
        before = snapshot(cluster)
        started = time.monotonic()
        for payload in payloads(uuid.uuid4().hex[:8], n):
            enqueue("send_email", payload, db=db)  # the producer's statements count
        # bounded, with room for a busy machine: per-request runs are launched one at a time
        deadline = started + 120.0 + (25.0 * n if mode == "per_request" else 2.0 * n)
        while True:
            polls += 1
            row = poller.execute(
                "SELECT count(*) FROM job_requests WHERE status = 'completed'"
            ).fetchone()
            if row is not None and row[0] >= n:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{mode}: {row} of {n} requests completed in time")
            time.sleep(0.5)
        elapsed = time.monotonic() - started
        after = snapshot(cluster)
        load = delta(after, before, polls)
        hosts = Counter(a["host"] for a in AttemptRecorder(db).all("send_email"))
        enqueued = {int(i): float(t) for i, t in poller.execute(
            "SELECT id, created_at FROM job_requests").fetchall()}
        timeline = run_timeline(cluster, enqueued)
    finally:
        poller.close()
        db.dispose()
    time.sleep(5.0)  # the last runs end and are reconciled
    idle_start = snapshot(cluster)
    time.sleep(IDLE_SECONDS / 2)
    idle_second = delta(snapshot(cluster), idle_start)
    # the background rate: two windows, before and after the load, weighed by their length
    idle = {k: idle_first[k] + idle_second[k] for k in idle_first}
    scale = load["seconds"] / idle["seconds"]
    gross = {k: v / n for k, v in load.items() if k != "seconds"}
    net = {k: (load[k] - idle[k] * scale) / n for k in load if k != "seconds"}
    redis_per_job = {
        cmd: round((calls - before["redis_by_command"].get(cmd, 0)) / n, 2)
        for cmd, calls in after["redis_by_command"].items()
        if calls - before["redis_by_command"].get(cmd, 0) > 0
    }
    return {
        "n": n,
        "seconds": round(elapsed, 2),
        "jobs_per_second": round(n / elapsed, 3),
        "per_job": {k: round(v, 2) for k, v in gross.items()},
        "per_job_net_of_idle": {k: round(v, 2) for k, v in net.items()},
        "idle_per_second": {k: round(v / idle["seconds"], 2) for k, v in idle.items()
                            if k != "seconds"},
        "redis_commands_per_job": redis_per_job,
        "events_per_intake_run": round(load["dagster_intake_run_events"]
                                       / max(1, load["dagster_intake_runs"]), 1),
        "attempts_by_host": dict(hosts),
        "runs": timeline,
        "loadavg_1m_at_end": round(os.getloadavg()[0], 2),  # the machine is shared
    }


def run_timeline(cluster: Cluster, enqueued: dict[int, float]) -> dict[str, Any]:
    return timeline_of(cluster.graphql().runs(), enqueued)


def timeline_of(all_runs: list[dict[str, Any]], enqueued: dict[int, float]) -> dict[str, Any]:
    """Where a run's time goes: created -> started (queue and launch: the daemon dequeues, the
    code server starts a process) and started -> ended (imports, resources, the step); and per
    request (``enqueued``: request id -> enqueue time) enqueue -> start of the first run that
    took it (the intake tick's wait, the run queue and the launch). ``all_runs`` as
    ``GraphQL.runs`` returns them."""
    runs = [r for r in all_runs if tag.INTAKE in r["tags"] and r["startTime"] and r["endTime"]]
    if not runs:
        return {"count": 0}
    waits = sorted(r["startTime"] - r["creationTime"] for r in runs)
    spans = sorted(r["endTime"] - r["startTime"] for r in runs)
    started: dict[int, float] = {}
    for r in runs:
        ids = r["tags"].get(tag.REQUEST_IDS) or r["tags"].get(tag.REQUEST_ID) or ""
        for i in (int(x) for x in ids.split(",") if x):
            started[i] = min(started.get(i, r["startTime"]), r["startTime"])
    to_start = sorted(at - enqueued[i] for i, at in started.items() if i in enqueued)
    return {
        "count": len(runs),
        "created_to_started_median_s": round(waits[len(waits) // 2], 2),
        "created_to_started_max_s": round(waits[-1], 2),
        "started_to_ended_median_s": round(spans[len(spans) // 2], 2),
        "started_to_ended_max_s": round(spans[-1], 2),
        "enqueue_to_start_p50_s": _quantile(to_start, 0.5),
        "enqueue_to_start_p90_s": _quantile(to_start, 0.9),
        "enqueue_to_start_max_s": _quantile(to_start, 1.0),
        "by_location": dict(Counter(r["location"] for r in runs)),
    }


def _quantile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile of sorted ``values`` (nearest rank), rounded; None when empty."""
    if not values:
        return None
    return round(values[min(len(values) - 1, int(q * len(values)))], 2)


# -- the store host's capacity on this machine -------------------------------------------------


def capacity(cluster: Cluster, quick: bool) -> dict[str, Any]:
    """pgbench and redis-benchmark inside the store namespace, against its private servers."""
    pg_bin = Path(cluster.state["postgres_bin"])
    env = {"PGPASSWORD": cluster.state["secrets"]["postgres"], "PGHOST": "127.0.0.1",
           "PGUSER": "postgres"}
    seconds = 10 if quick else 20
    with psycopg.connect(cluster.admin_conninfo(), autocommit=True) as conn:
        conn.execute("CREATE DATABASE bench")
    init = [str(pg_bin / "pgbench"), "-i", "-q", "-s", "10", "bench"]
    cluster.exec_in("store", init, env=env, timeout=300, check=True)
    out: dict[str, Any] = {"pgbench_scale": 10, "pgbench_seconds": seconds}
    for name, flags in (("pgbench_simple_update_tps", ["-N"]), ("pgbench_select_only_tps", ["-S"])):
        argv = [str(pg_bin / "pgbench"), *flags, "-c", "8", "-j", "2", "-T", str(seconds), "bench"]
        text = cluster.exec_in("store", argv, env=env, timeout=seconds + 120, check=True).stdout
        match = re.search(r"tps = ([0-9.]+)", text)
        out[name] = float(match.group(1)) if match else None
    with psycopg.connect(cluster.admin_conninfo(), autocommit=True) as conn:
        conn.execute("DROP DATABASE bench")
    store_redis = redis.Redis.from_url(cluster.redis_url, socket_timeout=30,
                                       socket_connect_timeout=5)
    try:
        out.update(redis_capacity(
            store_redis,
            lambda argv: cluster.exec_in("store", argv, timeout=300, check=True).stdout,
            host="127.0.0.1", port=6379, requests=50000 if quick else 200000,
        ))
    finally:
        store_redis.close()
    out["cores"] = os.cpu_count()
    out["loadavg_1m_after"] = round(os.getloadavg()[0], 2)  # the machine is shared: say how busy
    return out


BENCH_KEYS = ("key:*", "counter:*", "bench:*")
"""The keys redis-benchmark's SET, GET, INCR and the EVAL below touch."""
BENCH_COMMANDS = ("ping", "set", "get", "incr", "eval")


def redis_capacity(
    admin: redis.Redis, run: Callable[[list[str]], str], *, host: str, port: int, requests: int
) -> dict[str, float]:
    """redis-benchmark's SET, GET, INCR and a one-key EVAL per second against the Redis that
    ``admin`` (authenticated with the server's password) reaches; ``run`` runs an argv where
    the server is ``host:port`` and returns its output.

    redis-benchmark takes a password only as ``-a`` (it reads no ``REDISCLI_AUTH``), and a
    command line is world-readable (``/proc/<pid>/cmdline``), so the server's password never
    goes there: the benchmark authenticates as a user made for this run with a password of its
    own, allowed :data:`BENCH_COMMANDS` on :data:`BENCH_KEYS` only, deleted when the run ends
    (whatever the ending)."""
    user, password = f"bench-{secrets.token_hex(4)}", secrets.token_hex(16)
    admin.acl_setuser(user, enabled=True, reset=True, passwords=[f"+{password}"],
                      keys=list(BENCH_KEYS), commands=[f"+{c}" for c in BENCH_COMMANDS])
    try:
        base = ["redis-benchmark", "-h", host, "-p", str(port), "--user", user, "-a", password,
                "-c", "20", "-n", str(requests), "--csv"]
        rows = run([*base, "-t", "set,get,incr"])
        lua = run([*base, "-r", "100000", "EVAL", "return redis.call('INCR', KEYS[1])", "1",
                   "bench:{__rand_int__}"])
    finally:
        admin.acl_deluser(user)
    out: dict[str, float] = {}
    for row in csv.reader(io.StringIO(rows + lua)):
        if len(row) >= 2 and row[0] != "test":
            key = "EVAL" if row[0].startswith("EVAL") else row[0].split()[0]
            out[f"redis_{key.lower()}_per_second"] = float(row[1])
    return out


# -- the suite ---------------------------------------------------------------------------------


def run(quick: bool = False) -> dict[str, Any]:
    for noisy in ("alembic", "engine.intake"):  # storage migrations, one line per enqueue
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if os.geteuid() != 0:
        reason = "skipped: sekali cluster needs root (network namespaces, veth pairs, a bridge)"
        return {"skipped": reason, "summary": [
            {"metric": "cluster throughput", "value": None, "unit": None, "baseline": reason}
        ]}
    sizes = SIZES[quick]
    results: dict[str, Any] = {"sizes": sizes, "batch_size": BATCH_SIZE, "per_tick": PER_TICK,
                               "idle_seconds": IDLE_SECONDS, "runs": {}}
    root = Path(tempfile.mkdtemp(prefix="sekali-bench-cluster-", dir="/tmp"))  # nosec B108: mkdtemp: a fresh 0700 folder
    root.chmod(0o755)  # the private PostgreSQL runs as user postgres
    try:
        for label, workers, mode, overrides in CONFIGS:
            try:
                with cluster_of(workers, mode, root, overrides) as cluster:
                    if "capacity" not in results:
                        results["capacity"] = capacity(cluster, quick)
                        _say(f"capacity: {results['capacity']}")
                    result = measure(cluster, mode, sizes[mode])
            except Exception as exc:  # noqa: BLE001 - one configuration must not hide the rest
                results["runs"][label] = {"error": f"{type(exc).__name__}: {exc}"}
                _say(f"{label}: ERROR {exc}")
                continue
            result["instance_overrides"] = overrides
            results["runs"][label] = result
            _say(f"{label}: {result['jobs_per_second']} jobs/s "
                 f"({result['attempts_by_host']}; runs {result['runs']})")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results["summary"] = summary(results)
    return results


def summary(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    runs = {k: v for k, v in results["runs"].items() if "error" not in v}
    for label, run in results["runs"].items():
        if "error" in run:
            rows.append({"metric": f"{label}: ERROR", "value": run["error"][:80]})
    pairs = [(f"{m}, 2 worker hosts, enqueue to completed", f"{m}/2", f"{m}/1", "1 worker host")
             for m in MODES]
    pairs.append(("per_request, 2 worker hosts, production yaml (dequeue_use_threads)",
                  "per_request/2", "per_request/2/serial_dequeue", "one launch at a time"))
    for metric, key, base, base_name in pairs:
        if key in runs and base in runs:
            value, baseline = runs[key]["jobs_per_second"], runs[base]["jobs_per_second"]
            rows.append({"metric": metric, "value": value, "unit": "jobs/s",
                         "baseline": f"{base_name} {baseline}/s",
                         "ratio": round(value / baseline, 2), "target": None, "ok": None})
    for mode in MODES:
        key = f"{mode}/2" if f"{mode}/2" in runs else f"{mode}/1"
        if key not in runs:
            continue
        timeline = runs[key]["runs"]
        rows.append({
            "metric": f"{key} enqueue to run start, p50 (p90 "
                      f"{timeline.get('enqueue_to_start_p90_s')} s)",
            "value": timeline.get("enqueue_to_start_p50_s"), "unit": "s",
            "baseline": f"created to started p50 {timeline.get('created_to_started_median_s')} s",
            "ratio": None, "target": None, "ok": None,
        })
        cost = runs[key]["per_job_net_of_idle"]
        rows.append({
            "metric": f"{key} per job: pg statements / redis cmds / dagster events",
            "value": cost["pg_statements"], "unit": "statements",
            "baseline": f"redis {cost['redis_commands']}, events {cost['dagster_events']}",
            "ratio": None, "target": None, "ok": None,
        })
    return rows


def render(results: dict[str, Any]) -> None:
    if results.get("skipped"):
        print(results["skipped"])
        return
    print("cluster throughput, enqueue -> completed (send_email; per job, net of the idle rate)")
    print(f"{'config':<32}{'n':>5}{'jobs/s':>8}{'cpu wk s':>9}{'cpu ct s':>9}{'pg stmt':>8}"
          f"{'pg wr':>7}{'commit':>7}{'redis':>6}{'events':>7}{'runs':>6}  attempts by host")
    for key, r in results["runs"].items():
        if "error" in r:
            print(f"{key:<32} ERROR {r['error']}")
            continue
        c = r["per_job_net_of_idle"]
        print(f"{key:<32}{r['n']:>5}{r['jobs_per_second']:>8.2f}{c.get('cpu_worker_s', 0):>9.3f}"
              f"{c.get('cpu_control_s', 0):>9.3f}{c['pg_statements']:>8.1f}{c['pg_writes']:>7.1f}"
              f"{c['pg_commits']:>7.1f}{c['redis_commands']:>6.1f}{c['dagster_events']:>7.1f}"
              f"{c['dagster_runs']:>6.2f}  {r['attempts_by_host']}")
    print(f"store host capacity on this machine: {results.get('capacity')}")


def main() -> None:
    module_main(__doc__, run, render)


if __name__ == "__main__":
    main()
