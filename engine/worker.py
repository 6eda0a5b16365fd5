"""Resident workers: the path of volume. A worker claims requests as they arrive and runs them
through the one step entry, in the process it already has: no run is launched per request.

A worker serves one queue (``heavy`` or ``light``: the job types of that queue delivered by
resident workers, :mod:`engine.delivery`). Its loop:

1. **Claim** up to ``batch_size`` requests in one statement
   (:meth:`engine.requests.RequestStore.claim_for_worker`: claim order, priorities, fair share
   between tenants, debounce groups, only requests available now), taken ``running`` under the
   worker's ``owner`` (its run id), each counting an attempt.
2. **Run** them together through :func:`engine.step.run_steps`: the same ledger claim, lease
   and fence, send bound, concurrency slots, rate limits, cancel points and failure path as
   every other path. A transient failure gives its request back (``pending``, claimable after
   the policy's delay, :class:`engine.step.Retry` ``REQUEUE``); a final one is dead-lettered
   where it is decided, in the same transaction as the request's ``failed``. The worker goes on.
3. **Wait** when the claim found nothing, or left nothing claimable behind its batch (the
   page says so: :class:`engine.requests.claims.ClaimedPage`, so a worker that keeps up with
   its queue makes one claim per wake-up, not a second, empty one after each batch): until a
   wake-up (:mod:`resources.wakeup`: the enqueue pushes one after its commit) or
   ``poll_seconds``, whichever comes first. One wake-up answers every wake-up pushed before
   it (the claim after it sees their requests), so a claim that comes back full pushes one
   for another worker of the queue: a backlog is shared, not drained by the one worker that
   was woken. Timeline of a request that arrives while its worker runs a batch::

       t0  the worker's claim reads the queue: empty behind the page (drained)
       t1  a producer commits request R, then pushes its wake-up
       t2  the batch ends; the worker waits: the wake-up of t1 is there, it claims R at once

4. **Tell** its run what it did (``on_progress``: a Dagster event of the worker run) at most
   every ``progress_seconds``, merged over the batches since it last told, and at its end: the
   run's event log grows with time, not with traffic. A worker idle with batches still untold
   tells them once their period has passed, without waiting for work.

The worker ends itself after ``lifetime_seconds`` or ``idle_seconds`` without work (so code
reloads and upgrades roll through: its supervisor starts the next one), and when ``stop`` is
set. It never holds a claim across a wait: a batch is claimed and run, then the worker looks at
its bounds and waits. A worker that dies holds what it claimed ``running`` under its owner: the
ledger's leases on those keys expire, and its supervisor gives the requests back
(:meth:`RequestStore.take_back`), claimable once the lease on each key has run out (a takeover
then, counted towards the crash-loop bound as today).

Every move a worker makes on a request names its owner, so a worker declared dead that comes
back (a long pause) changes nothing a newer owner holds; the ledger's fence keeps its late
writes out.

A handler that hangs is abandoned at its job type's ``max_runtime_seconds``
(:func:`engine.runtime.run_bounded`) and its request dead-lettered ``timed_out``; the rest of
its batch runs after it, each request bounded from its own start, so they wait at most that
bound. The hung thread cannot be stopped, and it may hold what the rest of the process needs:
a pooled connection, an open transaction with its row locks (on SQLite the database's one
write lock, which every other writer then waits for until its busy timeout and fails
transiently), a concurrency slot until its lease. So once the batch is settled the worker ends
itself (``WorkerStats.reason`` says why): its process exits with the thread, the operating
system closes the thread's connections (the database rolls its transaction back), and the
supervisor (:mod:`sensors.workers`) starts a fresh worker. Requests the worker holds are all in
that batch (it never holds a claim across a wait), so none is left behind.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from engine.delivery import DeliveryPolicy
from engine.requests import JobRequest, RequestStore
from engine.services import Services
from engine.step import (
    OnFailure,
    Retry,
    StepAttempt,
    StepRequest,
    StepResult,
    run_steps,
    summary,
)
from resources.errors import HandlerTimedOut
from resources.idempotency import IdempotencyStore
from resources.storage.settings import redis_url_from_env
from resources.wakeup import PollWakeup, RedisWakeup, Wakeup

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerPolicy:
    """How one resident worker runs. Env (read by :meth:`from_env`): ``SEKALI_WORKER_BATCH``,
    ``SEKALI_WORKER_LIFETIME``, ``SEKALI_WORKER_IDLE``, ``SEKALI_WORKER_POLL``,
    ``SEKALI_WORKER_PROGRESS``."""

    queue: str
    batch_size: int = 50
    """Requests claimed and run together at most: a busy queue's batches amortise the claim,
    the ledger's statements and the attempts' rows; an idle queue's are one request."""
    lifetime_seconds: float = 1800.0
    """The worker ends itself after this (its supervisor starts the next): new code and
    configuration reach workers within it."""
    idle_seconds: float = 600.0
    """The worker ends itself after this long without a request."""
    poll_seconds: float = 2.0
    """The longest wait between claims of an idle worker, wake-up or not."""
    relaunch_after: float = 120.0
    """A request ``launched`` this long ago by the intake sensor (a run per request whose tick
    failed before its run existed) may be claimed again."""
    progress_seconds: float = 1.0
    """Batches are told (:class:`WorkDone`) at most this often, merged: the run's
    event log grows with time, not with traffic."""

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if min(self.lifetime_seconds, self.idle_seconds, self.poll_seconds) <= 0:
            raise ValueError("lifetime, idle and poll must be > 0 seconds")

    @classmethod
    def from_env(cls, queue: str, env: dict[str, str] | None = None) -> WorkerPolicy:
        env = dict(os.environ) if env is None else env
        return cls(
            queue=queue,
            batch_size=int(env.get("SEKALI_WORKER_BATCH", cls.batch_size)),
            lifetime_seconds=float(env.get("SEKALI_WORKER_LIFETIME", cls.lifetime_seconds)),
            idle_seconds=float(env.get("SEKALI_WORKER_IDLE", cls.idle_seconds)),
            poll_seconds=float(env.get("SEKALI_WORKER_POLL", cls.poll_seconds)),
            progress_seconds=float(env.get("SEKALI_WORKER_PROGRESS", cls.progress_seconds)),
        )


@dataclass
class WorkDone:
    """What a worker did since it last told: counts per outcome, the requests by id, the
    dead letters written, and the time it took."""

    batches: int = 0
    requests: list[int] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    dead_letters: list[int] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def add(self, results: list[StepResult], seconds: float) -> None:
        self.batches += 1
        self.seconds += seconds
        self.requests += [r.request.request_id for r in results
                          if r.request is not None and r.request.request_id is not None]
        done = summary(results)
        for name, value in done.items():
            if isinstance(value, int):
                self.counts[name] = self.counts.get(name, 0) + value
        self.dead_letters += done["dead_letters"]
        self.failures.update(done["failures"])

    @property
    def total(self) -> int:
        return len(self.requests)

    def line(self) -> str:
        counts = ", ".join(f"{v} {k}" for k, v in sorted(self.counts.items()) if v)
        ids = _ranges(self.requests)
        dead = (f"; dead-lettered as {', '.join(map(str, self.dead_letters))}"
                if self.dead_letters else "")
        return (f"{self.total} requests in {self.batches} batches ({counts or 'none'}) in "
                f"{self.seconds:.2f} s: {ids}{dead}")

    def as_dict(self) -> dict[str, Any]:
        return {"batches": self.batches, "requests": self.total, **self.counts,
                "request_ids": _ranges(self.requests), "dead_letters": self.dead_letters,
                "failures": self.failures, "seconds": round(self.seconds, 3)}


def _ranges(ids: list[int]) -> str:
    """``1-4, 9`` for ids 1, 2, 3, 4, 9 (at most 20 ranges, then how many more)."""
    spans: list[list[int]] = []
    for n in sorted(set(ids)):
        if spans and spans[-1][1] == n - 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    text = [f"{a}-{b}" if a != b else str(a) for a, b in spans]
    if len(text) > 20:
        return ", ".join(text[:20]) + f" and {len(text) - 20} more"
    return ", ".join(text)


@dataclass
class WorkerStats:
    """A worker's whole life: why it ended, and what it did."""

    reason: str = ""
    batches: int = 0
    requests: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    abandoned: int = 0
    """Handlers abandoned past their bound in the batch that ended the worker (0: none)."""


Deferral = Callable[[], Any]
"""A context manager factory: what a batch runs inside (the Dagster adapter defers the run's
termination to the end of the batch, so a batch is never cut between a send and its
record)."""


@contextmanager
def _no_deferral() -> Iterator[None]:
    yield


class ResidentWorker:
    """One resident worker (see the module docstring). ``owner``: the id every request it
    claims is held under (its Dagster run id). ``on_progress`` hears the merged
    :class:`WorkDone` at most every ``policy.progress_seconds``, and at the end;
    ``on_failure`` each failed attempt once its request is settled (retried later, or
    dead-lettered)."""

    def __init__(
        self,
        services: Services,
        policy: WorkerPolicy,
        *,
        owner: str,
        wakeup: Wakeup | None = None,
        delivery: DeliveryPolicy | None = None,
        stop: threading.Event | None = None,
        on_progress: Callable[[WorkDone], None] | None = None,
        on_failure: OnFailure | None = None,
        batch: Deferral = _no_deferral,
        step: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.services = services
        self.policy = policy
        self.owner = owner
        self.stop = stop or threading.Event()
        self.wakeup = wakeup or process_wakeup(self.stop)
        self.delivery = delivery or DeliveryPolicy.from_env()
        self.on_progress = on_progress
        self.on_failure = on_failure
        self.batch = batch
        self.step = step or f"worker[{policy.queue}]"
        self.clock = clock
        self.requests = RequestStore(services.db)
        self.stats = WorkerStats()
        self.drained = False
        """Whether the last claim left nothing claimable (:class:`engine.requests.claims.
        ClaimedPage`): the worker then waits for a wake-up instead of claiming again."""

    def job_types(self) -> list[str]:
        return self.delivery.resident(self.policy.queue)

    def run(self) -> WorkerStats:
        """Claim and run until a bound or ``stop`` ends the worker; returns its stats."""
        started = last_work = last_told = self.clock()
        done = WorkDone()
        types = self.job_types()
        while True:
            now = self.clock()
            if self.stop.is_set():
                self.stats.reason = "stopped"
                break
            if now - started >= self.policy.lifetime_seconds:
                self.stats.reason = f"lifetime of {self.policy.lifetime_seconds:.0f} s reached"
                break
            if now - last_work >= self.policy.idle_seconds:
                self.stats.reason = f"idle for {self.policy.idle_seconds:.0f} s"
                break
            with self.batch():
                results, took = self.run_once(types)
            idle = not results or self.drained
            if results:
                last_work = self.clock()
                done.add(results, took)
            hung = [r for r in results if isinstance(r.error, HandlerTimedOut)]
            if hung:
                self.stats.abandoned = len(hung)
                self.stats.reason = (
                    f"timed out: {len(hung)} handler(s) abandoned past their bound; ending so "
                    "their threads end with this process (the supervisor starts a fresh one)")
                log.error("%s worker %s: %s", self.policy.queue, self.owner, self.stats.reason)
                break
            if done.batches and self.clock() - last_told >= self.policy.progress_seconds:
                self._tell(done)
                done, last_told = WorkDone(), self.clock()
            due = last_told + self.policy.progress_seconds - self.clock()
            if idle and done.batches and due < self.policy.poll_seconds:
                # untold batches are told once their period has passed, work or no work
                if self.wakeup.wait(self.policy.queue, max(0.0, due)):
                    continue
                self._tell(done)
                done, last_told = WorkDone(), self.clock()
            if idle:
                self.wakeup.wait(self.policy.queue, self.policy.poll_seconds)
        if done.batches:
            self._tell(done)
        return self.stats

    def run_once(self, types: list[str] | None = None) -> tuple[list[StepResult], float]:
        """One claim and its batch: (the results, seconds it took); none when nothing was
        claimable."""
        types = self.job_types() if types is None else types
        self.drained = True
        if not types:
            return [], 0.0
        started = time.perf_counter()
        claimed = self.requests.claim_for_worker(
            self.policy.batch_size, owner=self.owner, job_types=types,
            relaunch_after=self.policy.relaunch_after,
        )
        self.drained = claimed.drained
        if not claimed:
            return [], 0.0
        if len(claimed) >= self.policy.batch_size:  # more may wait: another worker claims too
            self.wakeup.notify(self.policy.queue)
        results = run_steps(
            self.services, StepAttempt(run_id=self.owner, step=self.step),
            [StepRequest.of(r, claimed=True) for r in claimed],
            retry=Retry.REQUEUE, source="worker", owner=self.owner, on_failure=self.on_failure,
        )
        return results, time.perf_counter() - started

    def _tell(self, done: WorkDone) -> None:
        self.stats.batches += done.batches
        self.stats.requests += done.total
        for name, value in done.counts.items():
            self.stats.counts[name] = self.stats.counts.get(name, 0) + value
        if self.on_progress is not None:
            self.on_progress(done)


def give_back(requests: RequestStore, owners: Sequence[str]) -> list[JobRequest]:
    """What the ended worker runs ``owners`` held goes back to ``pending``
    (:meth:`RequestStore.take_back`), each ``running`` one claimable once the ledger's lease on
    its key has run out, so the next holder takes the key over instead of finding it held.
    The one way back for a dead worker's requests: the supervisor calls it for the worker runs
    Dagster has ended, the chaos harness for the worker processes it killed."""
    if not owners:
        return []
    ledger = IdempotencyStore(requests.db)

    def lease_end(key: str) -> float | None:
        record = ledger.get(key)
        return record.lease_expires_at if record is not None else None

    return requests.take_back(owners, lease_end)


_wakeups: dict[tuple[str, str], RedisWakeup] = {}
_wakeups_lock = threading.Lock()


def process_wakeup(stop: threading.Event | None = None) -> Wakeup:
    """This process's wake-ups (``SEKALI_WAKEUP``: ``redis``, the default, on ``REDIS_URL``
    under ``SEKALI_WAKEUP_NAMESPACE``, default ``sekali``; ``poll``: none, workers poll), built
    on first use and shared by the enqueues and workers of the process."""
    if os.environ.get("SEKALI_WAKEUP", "redis").strip().lower() == "poll":
        return PollWakeup(stop)
    url = redis_url_from_env()
    namespace = os.environ.get("SEKALI_WAKEUP_NAMESPACE", "sekali")
    with _wakeups_lock:
        if (url, namespace) not in _wakeups:
            _wakeups[url, namespace] = RedisWakeup(url, namespace=namespace)
        return _wakeups[url, namespace]


def notify_workers(queue: str) -> None:
    """Wake an idle worker of ``queue`` (best effort: a lost wake-up costs a poll)."""
    process_wakeup().notify(queue)


@dataclass(frozen=True)
class WorkerTargets:
    """How many resident worker runs each queue keeps alive: ``SEKALI_WORKERS`` (``light=2,
    heavy=1``; a queue it does not name keeps its default). By default a worker per core for
    ``light`` and one for ``heavy``: a worker is one process running one batch at a time, so
    light work uses the machine and a sick heavy downstream holds one worker, not all.

    ``light=1..8`` gives bounds instead of a count: the supervisor sizes the queue from its
    observed load between them (:mod:`engine.capacity`); ``light=2..`` a floor, with a ceiling
    of :data:`DEFAULT_CEILING`."""

    counts: dict[str, int]
    """The fixed count, or the floor of a sized queue."""
    ceilings: dict[str, int] = field(default_factory=dict)
    """The ceiling of each queue sized from its load."""

    def of(self, queue: str) -> int:
        return self.counts.get(queue, 1)

    def bounds(self, queue: str) -> tuple[int, int]:
        floor = self.of(queue)
        return floor, self.ceilings.get(queue, floor)

    def sized(self, queue: str) -> bool:
        return queue in self.ceilings

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> WorkerTargets:
        env = dict(os.environ) if env is None else env
        counts = {"light": max(1, os.cpu_count() or 1), "heavy": 1}
        ceilings: dict[str, int] = {}
        for item in env.get("SEKALI_WORKERS", "").split(","):
            if not item.strip():
                continue
            queue, _, raw = item.partition("=")
            low, dots, high = raw.partition("..")
            try:
                count = int(low)
                ceiling = (int(high) if high.strip() else DEFAULT_CEILING) if dots else count
            except ValueError:
                count = ceiling = -1
            if not queue.strip() or count < 0 or ceiling < max(count, 1 if dots else 0):
                raise ValueError(f"SEKALI_WORKERS: {item.strip()!r} is not QUEUE=COUNT or "
                                 "QUEUE=FLOOR..CEILING (e.g. light=1..8,heavy=1)")
            counts[queue.strip()] = count
            if dots:
                ceilings[queue.strip()] = ceiling
        return cls(counts, ceilings)


DEFAULT_CEILING = 16
"""The ceiling of a queue given only a floor (``light=2..``)."""
