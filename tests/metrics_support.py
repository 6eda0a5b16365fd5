"""Shared by the metrics and diagnosis tests: a scripted world that writes real records through
the real stores (requests, idempotency ledger, attempt recorder, sandbox gateway), with an
injected clock so durations are exact and nothing sleeps; and module-level worker functions for
the multi-process tests (spawn context). No tests live here."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from engine.attempts import AttemptRecorder, Outcome
from engine.requests import RequestStore
from pipelines.domain.payments import HttpPaymentGateway
from resources.idempotency import Completed, IdempotencyStore
from resources.storage.db import Database


class FakeClock:
    """A clock that only moves when told; thread-safe."""

    def __init__(self, start: float | None = None) -> None:
        self.now = time.time() if start is None else start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.now

    def advance(self, seconds: float) -> float:
        with self._lock:
            self.now += seconds
            return self.now


@dataclass
class World:
    """Runs job-shaped work the way ``engine.runtime.execute_request`` does: attempt row
    first, claim, effect, complete (in order), finish the attempt."""

    db: Database
    clock: FakeClock
    lease_seconds: float = 60.0
    gateway: HttpPaymentGateway | None = None
    store: IdempotencyStore = field(init=False)
    attempts: AttemptRecorder = field(init=False)
    requests: RequestStore = field(init=False)

    def __post_init__(self) -> None:
        self.store = IdempotencyStore(self.db, lease_seconds=self.lease_seconds, clock=self.clock)
        self.attempts = AttemptRecorder(self.db, clock=self.clock)
        self.requests = RequestStore(self.db, clock=self.clock)

    def start(self, job_type: str, **fields: Any) -> Any:
        """Insert the attempt row (outcome ``started``) as the runtime does."""
        if hasattr(self.attempts, "new"):
            return self.attempts.start(self.attempts.new(job_type, **fields))
        return self.attempts.start(job_type, **fields)  # type: ignore[call-arg]

    def enqueue(self, job_type: str, key: str, *, correlation_id: str | None) -> int:
        payload = {"key": key}
        return self.requests.enqueue(
            job_type, key, payload, queue="light", correlation_id=correlation_id
        ).id

    def run(
        self,
        job_type: str,
        key: str,
        *,
        duration: float = 0.5,
        correlation_id: str | None = None,
        request_id: int | None = None,
        attempt: int = 0,
        charge: bool = False,
        lock_wait: float | None = None,
        critical: float | None = None,
        ack_before_complete: bool = False,
        skip_complete: bool = False,
        fail_with: BaseException | None = None,
        record_key: bool = True,
        reference: str | None = None,
    ) -> str:
        """One attempt; returns its outcome."""
        rec = self.start(
            job_type, attempt=attempt, idempotency_key=key if record_key else None,
            correlation_id=correlation_id, request_id=request_id,
        )
        claimed = self.store.begin(key, payload={"key": key})
        if isinstance(claimed, Completed):
            rec.status_before = rec.status_after = "completed"
            self.attempts.finish(rec, Outcome.DUPLICATE_SUPPRESSED)
            return Outcome.DUPLICATE_SUPPRESSED
        rec.fence = claimed.fence
        rec.takeover = claimed.takeover
        rec.status_before = "in_progress"
        if lock_wait is not None:
            rec.lock_wait_seconds = lock_wait
        self.clock.advance(duration)
        if critical is not None:
            rec.add_duration("transaction", critical)
        if fail_with is not None:
            self.store.fail(claimed, fail_with, "transient")
            self.attempts.finish(rec, Outcome.RETRIED, error=fail_with, error_kind="transient")
            return Outcome.RETRIED
        if charge and self.gateway is not None:
            self.gateway.charge(
                reference=reference or key, amount_cents=100, currency="EUR", idempotency_key=key,
                correlation_id=correlation_id,
            )
        rec.status_after = "completed"
        if ack_before_complete:
            self.attempts.finish(rec, Outcome.COMPLETED)
            self.clock.advance(2.0)
            if not skip_complete:
                self.store.complete(claimed, {"ok": True})
            return Outcome.COMPLETED
        self.store.complete(claimed, {"ok": True})
        self.attempts.finish(rec, Outcome.COMPLETED)
        return Outcome.COMPLETED


def record_attempts_worker(args: tuple[str, str, int, int, float]) -> dict[str, int]:
    """A spawned process: ``threads`` threads each run ``per_thread`` jobs on their own keys and
    then each job once more (a duplicate delivery). Returns what it did."""
    url, prefix, threads, per_thread, base = args
    db = Database.from_url(url)
    clock = FakeClock(base)
    world = World(db, clock)
    outcomes: dict[str, int] = {"completed": 0, "duplicate_suppressed": 0}
    lock = threading.Lock()

    def work(t: int) -> None:
        for i in range(per_thread):
            key = f"{prefix}:t{t}:{i}"
            for _ in range(2):
                outcome = world.run("send_email", key, duration=0.25, correlation_id=key)
                with lock:
                    outcomes[str(outcome)] += 1

    pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    db.dispose()
    return outcomes


def noop(_: Any) -> None:
    return None
