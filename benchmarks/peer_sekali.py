"""The sekali side of ``sekali bench --only peers``: the shipped intake and jobs, with the parts
of a Dagster deployment that launch runs played by this harness.

What ships runs unchanged: producers call :func:`engine.intake.enqueue`; the real
``intake_sensor`` claims the requests and asks for runs (per request, or micro-batches of
``intake_micro_batch``); each run executes the job Dagster would run (``execute_in_process`` of
the same job, run config and tags: :func:`benchmarks.intake.execute_run`).

What the harness plays, in the parent process (:class:`IntakeDaemon`), is what Dagster's daemon
and run launcher do in a deployment:

- the sensor daemon: one tick every ``minimum_interval_seconds`` of the sensor (5 s);
- the run queue and launcher: runs go to ``workers`` long-lived run-worker processes
  (:func:`run_worker`), one run at a time each. Dagster starts a process per run (2.6-3.1
  CPU-seconds each, docs/scaling.md); that cost is left out, as in the intake suite;
- run monitoring and run retries for crashed workers (the production profile): when a worker
  dies its run is retried on another once the keys it held are free to take over (the ledger's
  lease, ``LEASE_SECONDS``, shortened from 60 s as procrastinate's heartbeat is), and a new
  worker replaces it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import dagster as dg

from benchmarks.intake import execute_run, intake_sensor, intake_tick, run_resources

LEASE_SECONDS = 6.0
"""The ledger's lease in this benchmark: a crashed run's keys can be taken over after it."""
TICK_SECONDS = float(intake_sensor().minimum_interval_seconds or 30)


def run_worker(conn: Connection, env: dict[str, str], db_url: str, smtp_port: int, tag: str
               ) -> None:
    """A run worker: takes runs from the daemon over ``conn``, executes each, says when done."""
    os.environ.update(env)
    with dg.DagsterInstance.ephemeral() as instance:
        resources = run_resources(db_url, smtp_port, tag, redis=env["REDIS_URL"],
                                  lease_seconds=LEASE_SECONDS)
        conn.send(("ready", None))
        while True:
            try:
                run = conn.recv()
            except EOFError:
                return
            if run is None:
                return
            conn.send(("done", execute_run(run, instance, resources)))


@dataclass
class _Worker:
    proc: Any
    conn: Connection
    ready: bool = False
    run: dict[str, Any] | None = None


@dataclass
class IntakeDaemon:
    """The sensor daemon, run queue, launcher and run monitoring of a deployment (see the
    module docstring), for ``workers`` run-worker processes."""

    workers: int
    db_url: str
    smtp_port: int
    tag: str
    env: dict[str, str]
    tick_seconds: float = TICK_SECONDS
    retries: int = 0
    _pool: list[_Worker] = field(default_factory=list)
    _queue: deque[tuple[float, dict[str, Any]]] = field(default_factory=deque)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _tick_now: threading.Event = field(default_factory=threading.Event)

    def start(self, timeout: float = 180.0) -> None:
        for _ in range(self.workers):
            self._pool.append(self._spawn())
        deadline = time.monotonic() + timeout
        while not all(w.ready for w in self._pool):
            if time.monotonic() > deadline:
                raise RuntimeError("sekali run workers did not start")
            self._receive(0.2)
        self._thread = threading.Thread(target=self._loop, name="intake-daemon", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
        for w in self._pool:
            with contextlib.suppress(OSError):
                w.conn.send(None)  # the worker's loop ends after the run it is in
        for w in self._pool:
            w.proc.join(timeout=30)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join()

    def tick_now(self) -> None:
        """Tick at the next turn of the loop instead of at the sensor's interval (a backlog
        whose drain is timed from its first mail need not wait for the interval)."""
        self._tick_now.set()

    def worker_pids(self) -> list[int]:
        with self._lock:
            return [w.proc.pid for w in self._pool if w.proc.is_alive()]

    def idle(self) -> bool:
        with self._lock:
            return not self._queue and all(w.run is None for w in self._pool)

    # -- the loop -----------------------------------------------------------------------------

    def _spawn(self) -> _Worker:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(
            target=run_worker, args=(child, self.env, self.db_url, self.smtp_port, self.tag),
            daemon=True,
        )
        proc.start()
        child.close()
        return _Worker(proc, parent)

    def _loop(self) -> None:
        instance = dg.DagsterInstance.ephemeral()
        resources = run_resources(self.db_url, self.smtp_port, self.tag,
                                  redis=self.env["REDIS_URL"])
        cursor: str | None = None
        next_tick = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_tick or self._tick_now.is_set():
                self._tick_now.clear()
                cursor, runs = intake_tick(instance, resources, cursor)
                next_tick = now + self.tick_seconds
                with self._lock:
                    self._queue.extend((0.0, run) for run in runs)
            self._dispatch()
            self._receive(0.05)
        instance.dispose()

    def _dispatch(self) -> None:
        """Hand the oldest run that may start to each idle worker (a retry waits for its
        lease to run out; the runs behind it do not wait for it)."""
        now = time.monotonic()
        with self._lock:
            for w in self._pool:
                if not (w.ready and w.run is None):
                    continue
                due = next((item for item in self._queue if item[0] <= now), None)
                if due is None:
                    return
                self._queue.remove(due)
                w.run = due[1]
                w.conn.send(due[1])

    def _receive(self, timeout: float) -> None:
        with self._lock:
            conns = {w.conn: w for w in self._pool}
        for conn in wait(list(conns), timeout=timeout):
            w = conns[conn]  # type: ignore[index]
            try:
                kind, _ = conn.recv()  # type: ignore[union-attr]
            except (EOFError, OSError):
                self._replace(w)
                continue
            with self._lock:
                if kind == "ready":
                    w.ready = True
                else:
                    w.run = None
        with self._lock:
            dead = [w for w in self._pool if not w.proc.is_alive()]
        for w in dead:
            self._replace(w)

    def _replace(self, w: _Worker) -> None:
        """Run monitoring: the worker died. Its run is retried once its keys can be taken over
        (the lease has run out), and a new worker takes its place."""
        with self._lock:
            if w not in self._pool:
                return
            self._pool.remove(w)
            if w.run is not None:
                self.retries += 1
                self._queue.appendleft((time.monotonic() + LEASE_SECONDS, w.run))
        w.conn.close()
        w.proc.join(timeout=1)
        fresh = self._spawn()
        with self._lock:
            self._pool.append(fresh)


def wait_until(predicate: Callable[[], bool], timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(step)
    return True
