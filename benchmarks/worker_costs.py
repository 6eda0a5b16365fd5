"""What one ``send_email`` costs a resident worker, counted, not timed: the SQL statements,
commits and pre-pings on the app database, the statements on the mail provider's record (the
lookup before a send), the Redis commands, and the worker's CPU per job.

Two measurements, each on a database of its own (a SQLite file, or a fresh Postgres schema), a
private ``redis-server`` and the sandbox mail sink in a process of its own (its record is the
provider's, read by the lookup):

- batches (the default): the worker that ships (:class:`engine.worker.ResidentWorker`,
  ``run_once``: one claim and its batch through :func:`engine.step.run_steps`) in this
  process, ``--batches`` batches of ``--batch`` requests enqueued beforehand, after a warm-up
  batch (connections, caches). Redis: the commands clients sent (``redis_calls``, a script is
  one) and those the server ran (``redis_commands``, its ``commandstats``: a script's own
  calls included). CPU: ``time.process_time`` over the measured batches (this process only:
  the worker and its lease keeper's thread). ``--profile`` prints their CPU profile, by
  cumulative and own time, with the handlers run inline instead of in their bounded thread
  so that the profile sees them.
- ``--steady RATE``: ``--workers`` workers (threads here) woken through Redis, fed ``RATE``
  requests a second for ``--seconds``, each enqueued in its own transaction with its wake-up:
  the claims (empty ones included), statements, commits, pings and Redis calls per request, and the
  enqueue-to-completed times (wall clock: noisy on a shared machine).

Statements are counted at the driver, where the hot path runs (:class:`SqlCounter`). Counts
do not depend on the machine's load; CPU and times do.

    .venv/bin/python -m benchmarks.worker_costs --db sqlite|postgres [--batch 50] [--json]
    .venv/bin/python -m benchmarks.worker_costs --db postgres --steady 50 [--workers 2]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event, text
from sqlalchemy.pool import Pool

from engine import runtime
from engine.attempts import AttemptRecorder
from engine.intake import enqueue
from engine.requests import RequestStatus, RequestStore
from engine.services import Services
from engine.worker import ResidentWorker, WorkerPolicy, notify_workers
from pipelines.domain.mail import SmtpMailer
from resources.flow import ConcurrencyLimits
from resources.idempotency import IdempotencyStore
from resources.retry import RetryBudget, RetryPolicy
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from resources.storage.redis import redis_client
from resources.wakeup import PollWakeup
from sandbox.mailsink import MailSink
from sandbox.redis_server import RedisServer, free_port

PG_URL = os.environ.get("SEKALI_TEST_PG_URL",
                        "postgresql+psycopg://postgres@127.0.0.1:5432/sekali_test")


class SqlCounter:
    """Statements and transactions per database, counted at the driver (the hot path runs on
    DBAPI connections, :mod:`resources.storage.driver`, where SQLAlchemy's events do not see
    it): ``sqlite3``'s trace callback on every new connection, psycopg's ``Cursor.execute`` /
    ``executemany`` and ``Connection.commit`` wrapped. A transaction is a ``COMMIT`` (or
    psycopg's ``commit()``), or a statement run in autocommit; ``BEGIN`` / ``COMMIT`` /
    ``ROLLBACK`` are not counted as statements, the pool's pre-ping of a checkout (Postgres:
    ``;``) is counted apart, as ``pings``."""

    def __init__(self) -> None:
        self.statements: Counter[str] = Counter()
        self.commits: Counter[str] = Counter()
        self.pings: Counter[str] = Counter()
        self.texts: Counter[str] = Counter()
        self.claims = 0
        self.redis_calls = 0
        self._open: set[int] = set()
        self._skip: int | None = None
        event.listen(Pool, "connect", self._connected)
        import psycopg  # noqa: PLC0415 - only when counting, and only its classes
        import redis  # noqa: PLC0415 - the same
        import redis.client  # noqa: PLC0415 - the same

        counter = self
        execute, executemany = psycopg.Cursor.execute, psycopg.Cursor.executemany
        commit = psycopg.Connection.commit

        def counted_execute(cursor: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
            counter._postgres(cursor.connection, str(query))
            return execute(cursor, query, *args, **kwargs)

        def counted_many(cursor: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
            counter._postgres(cursor.connection, str(query))
            return executemany(cursor, query, *args, **kwargs)

        def counted_commit(conn: Any) -> Any:
            if counter._counts():
                counter.commits["app"] += 1
            return commit(conn)

        sent: Any = redis.Redis.execute_command
        piped: Any = redis.client.Pipeline.execute

        def counted_command(client: Any, *args: Any, **kwargs: Any) -> Any:
            if counter._counts():
                counter.redis_calls += 1
            return sent(client, *args, **kwargs)

        def counted_pipeline(pipe: Any, *args: Any, **kwargs: Any) -> Any:
            if counter._counts():
                counter.redis_calls += 1
            return piped(pipe, *args, **kwargs)

        redis.Redis.execute_command = counted_command  # type: ignore[method-assign,assignment]
        redis.client.Pipeline.execute = counted_pipeline  # type: ignore[method-assign,assignment]
        psycopg.Cursor.execute = counted_execute  # type: ignore[method-assign,assignment]
        psycopg.Cursor.executemany = counted_many  # type: ignore[method-assign,assignment]
        psycopg.Connection.commit = counted_commit  # type: ignore[method-assign,assignment]

    def _postgres(self, conn: Any, statement: str) -> None:
        words = statement.split()
        head = words[0].upper() if words else ""
        if head in ("BEGIN", "COMMIT", "ROLLBACK"):
            return
        if not self._counts():
            return
        if head == ";":  # the pool's pre-ping of a checkout
            self.pings["app"] += 1
            return
        self._statement("app", words)
        if conn.autocommit:
            self.commits["app"] += 1

    def _connected(self, dbapi: Any, _record: Any) -> None:
        if not isinstance(dbapi, sqlite3.Connection):
            return
        files = [row[2] for row in dbapi.execute("PRAGMA database_list")]
        where = "mail" if any("mail" in f for f in files) else "app"
        ident = id(dbapi)

        def trace(statement: str) -> None:
            if not self._counts():
                return
            words = statement.split()
            head = words[0].upper() if words else ""
            if head == "BEGIN":
                self._open.add(ident)
            elif head in ("COMMIT", "ROLLBACK", "END"):
                self._open.discard(ident)
                self.commits[where] += head != "ROLLBACK"
            else:
                self._statement(where, words)
                if ident not in self._open and not head.startswith("PRAGMA"):
                    self.commits[where] += 1

        dbapi.set_trace_callback(trace)

    def only_not(self, thread: int) -> None:
        """Leave out what ``thread`` runs (a producer beside the workers)."""
        self._skip = thread

    def _counts(self) -> bool:
        return threading.get_ident() != self._skip

    def _statement(self, where: str, words: list[str]) -> None:
        self.statements[where] += 1
        text = " ".join(words)
        self.texts[f"{where}: {text[:60]}"] += 1
        self.claims += text.startswith("UPDATE tenants SET updated_at")

    def reset(self) -> None:
        self.claims = self.redis_calls = 0
        self.statements.clear()
        self.pings.clear()
        self.commits.clear()
        self.texts.clear()


@contextlib.contextmanager
def _database(kind: str, folder: Path) -> Iterator[str]:
    if kind == "sqlite":
        yield f"sqlite:///{folder / 'app.db'}"
        return
    schema = "wc_" + uuid.uuid4().hex[:10]
    admin = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    try:
        sep = "&" if "?" in PG_URL else "?"
        yield f"{PG_URL}{sep}options=-csearch_path%3D{schema}"
    finally:
        with admin.connect() as conn:
            conn.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
        admin.dispose()


def _mail(i: int, tag: str) -> dict[str, Any]:
    return {"template": "welcome", "user_id": f"{tag}{i}", "date": "2026-12-01",
            "to": f"{tag}{i}@example.com"}


@dataclass
class Stage:
    """What a measurement runs on: the app database, its services, the private Redis and the
    mail sink's process, and the counter of statements."""

    db: Database
    services: Services
    redis: RedisServer
    counter: SqlCounter


@contextlib.contextmanager
def _stage(kind: str) -> Iterator[Stage]:
    with tempfile.TemporaryDirectory(prefix="sekali-costs-") as tmp, \
            _database(kind, Path(tmp)) as url:
        folder = Path(tmp)
        server = RedisServer(folder, port=free_port()).start()
        mail_url, mail_port = f"sqlite:///{folder / 'mail.db'}", free_port()
        MailSink(mail_url)  # its table, before the sink's process and the lookups use it
        sink = subprocess.Popen(  # the provider in a process of its own: not this one's CPU
            [sys.executable, "-m", "sandbox.mailsink", "--port", str(mail_port),
             "--db-url", mail_url], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert sink.stdout is not None
        sink.stdout.readline()  # "listening": it serves
        counter = SqlCounter()
        db = Database.from_url(url)
        try:
            upgrade(db)
            redis = redis_client(server.url)
            services = Services(
                db=db, store=IdempotencyStore(db, lease_seconds=30.0),
                attempts=AttemptRecorder(db),
                clients={"smtp": SmtpMailer("127.0.0.1", mail_port, timeout=5, deadline=10,
                                            log_url=mail_url)},
                retry_policy=RetryPolicy(), retry_budget=RetryBudget(redis, namespace="wc"),
                concurrency=ConcurrencyLimits(redis, lease=30.0, prefix="wc:flow:limit:"),
            )
            yield Stage(db, services, server, counter)
        finally:
            db.dispose()
            sink.terminate()
            sink.wait()
            server.stop()


def measure(kind: str, batch: int, batches: int, profile: bool) -> dict[str, Any]:
    """``batches`` batches of ``batch`` requests each, enqueued beforehand (no wake-ups)."""
    os.environ["SEKALI_WAKEUP"] = "poll"  # the enqueue's wake-up is the producer's, not counted
    with _stage(kind) as stage:
        worker = ResidentWorker(stage.services, WorkerPolicy(queue="light", batch_size=batch),
                                owner="worker-costs", wakeup=PollWakeup())
        counter, stats = stage.counter, stage.redis.plain()
        rows: list[dict[str, Any]] = []
        cpu = 0.0
        profiler = cProfile.Profile(time.process_time)
        if profile:  # handlers inline, so the profile sees them (their bound is not tested)
            runtime.run_bounded = lambda fn, **_: fn()
        for n in range(batches + 1):
            enqueue_many_mails(stage.db, batch, f"b{n}-")
            counter.reset()
            stage.redis.admin("CONFIG", "RESETSTAT")
            started = time.process_time()
            if n and profile:
                profiler.enable()
            results, _ = worker.run_once()
            if n and profile:
                profiler.disable()
            took = time.process_time() - started
            calls = counter.redis_calls
            commands = _commands(stats)
            assert len(results) == batch and all(r.ok for r in results), results
            if n:  # the first batch warms up connections and caches
                cpu += took
                rows.append({"app_statements": counter.statements["app"],
                             "app_commits": counter.commits["app"],
                             "app_pings": counter.pings["app"],
                             "mail_statements": counter.statements["mail"],
                             "redis_calls": calls,
                             "redis_commands": sum(commands.values()),
                             "redis": dict(commands),
                             "texts": dict(counter.texts)})
        names = ("app_statements", "app_commits", "app_pings", "mail_statements",
                 "redis_calls", "redis_commands")
        out = {
            "db": kind, "batch": batch, "batches": batches,
            "per_job": {name: round(sum(r[name] for r in rows) / (batch * batches), 3)
                        for name in names},
            "per_batch": {name: [r[name] for r in rows] for name in names},
            "cpu_ms_per_job": round(1000 * cpu / (batch * batches), 3),
            "redis": rows[-1]["redis"],
            "statements": dict(sorted(rows[-1]["texts"].items(), key=lambda kv: -kv[1])),
        }
        if profile:
            buffer = io.StringIO()
            for sort in ("cumulative", "tottime"):
                pstats.Stats(profiler, stream=buffer).sort_stats(sort).print_stats(45)
            out["profile"] = buffer.getvalue()
        return out


def steady(kind: str, rate: float, seconds: float, workers: int) -> dict[str, Any]:
    """``workers`` resident workers (threads of this process, each its own owner) woken through
    Redis, fed ``rate`` requests a second for ``seconds``, each enqueued in its own transaction
    with its wake-up, as a producer does. Counted per request: the workers' claims (the
    scheduler's clock taken: one per claim, empty or not), statements, commits, pings and
    Redis calls (waits included).
    The enqueues' own statements are left out (the producer's thread; counted apart)."""
    os.environ["SEKALI_WAKEUP"] = "redis"
    with _stage(kind) as stage:
        os.environ["REDIS_URL"] = stage.redis.url
        os.environ["SEKALI_WAKEUP_NAMESPACE"] = f"wc{uuid.uuid4().hex[:6]}"
        stop = threading.Event()
        pool = [ResidentWorker(stage.services, WorkerPolicy(queue="light", poll_seconds=1.0),
                               owner=f"worker-{n}", stop=stop) for n in range(workers)]
        threads = [threading.Thread(target=w.run) for w in pool]
        for thread in threads:
            thread.start()
        time.sleep(1.0)  # every worker idle, waiting
        producer = threading.get_ident()
        stage.counter.only_not(producer)
        stage.counter.reset()
        total = int(rate * seconds)
        began = time.monotonic()
        for i in range(total):
            time.sleep(max(0.0, began + i / rate - time.monotonic()))
            enqueue("send_email", _mail(i, "s-"), db=stage.db)
        store = RequestStore(stage.db)
        while store.counts().get(RequestStatus.COMPLETED, 0) < total:
            time.sleep(0.05)
        time.sleep(0.5)  # the workers' last empty claims
        counts = {"claims": stage.counter.claims, "app_statements": stage.counter.statements["app"],
                  "app_commits": stage.counter.commits["app"],
                  "app_pings": stage.counter.pings["app"],
                  "redis_calls": stage.counter.redis_calls}
        stop.set()
        for _ in pool:
            notify_workers("light")
        for thread in threads:
            thread.join(30)
        with stage.db.statement() as conn:
            waits = sorted(float(r[0]) for r in conn.execute(text(
                "SELECT updated_at - created_at FROM job_requests WHERE status = 'completed'")))
        return {"db": kind, "rate": rate, "seconds": seconds, "workers": workers,
                "requests": total,
                "per_request": {k: round(v / total, 3) for k, v in counts.items()},
                "enqueue_to_completed_ms": {
                    "p50": round(1000 * waits[len(waits) // 2], 1),
                    "p99": round(1000 * waits[min(len(waits) - 1, int(len(waits) * 0.99))], 1)}}


def enqueue_many_mails(db: Database, count: int, tag: str) -> None:
    """``count`` mails in one transaction (a backlog)."""
    with db.transaction() as conn:
        for i in range(count):
            enqueue("send_email", _mail(i, tag), conn=conn)


def _commands(client: Any) -> Counter[str]:
    """The commands the server ran (``commandstats``: a script's own calls included)."""
    info = client.info("commandstats")
    counts: Counter[str] = Counter()
    for name, stat in info.items():
        command = name.removeprefix("cmdstat_")
        if command not in ("info", "config"):
            counts[command] = int(stat["calls"])
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--batch", type=int, default=50)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--steady", type=float, default=0.0, metavar="RATE",
                        help="requests a second offered to --workers woken workers instead")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    if args.steady:
        json.dump(steady(args.db, args.steady, args.seconds, args.workers), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    out = measure(args.db, args.batch, args.batches, args.profile)
    if args.json:
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print(f"{out['db']}, batches of {out['batch']}: {out['per_job']}, "
          f"CPU {out['cpu_ms_per_job']} ms/job")
    print("Redis:", out["redis"])
    for statement, calls in out["statements"].items():
        print(f"{calls:5d}  {statement}")
    if "profile" in out:
        print(out["profile"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
