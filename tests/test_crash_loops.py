"""Crash loops: a key whose worker dies mid-run again and again is dead-lettered as
``crash_loop`` after a bounded number of deaths, with the evidence; in a micro-batch the
crasher is isolated and its neighbours complete, never counted against.

Real worker processes (``python tests/job_workers.py``) that SIGKILL themselves at the
``crash_probe`` crash point (``SEKALI_CRASH_AT``), real stores on SQLite and Postgres. The
ledger's counting itself is checked with an injected clock (leases expire without waiting).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from engine.attempts import AttemptRecorder
from engine.registry import JOB_TYPES
from engine.requests import RequestStatus, RequestStore
from resources.dlq import DlqStore, FailureClass
from resources.errors import CrashLoop, StoredFailure
from resources.idempotency import Claim, IdempotencyStore, Status
from resources.retry import failure_class
from resources.storage.db import Database
from sensors.dlq import dead_letter_failed_requests
from tests import crash_jobs

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "job_workers.py"
LIMIT = 1


@pytest.fixture(autouse=True)
def probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(JOB_TYPES, "crash_probe", crash_jobs.JOB_TYPE)


def worker(spec: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ, "PYTHONPATH": str(ROOT), "SEKALI_JOB_MODULES": "tests.crash_jobs",
        "SEKALI_CRASH_AT": "crash_probe", "SEKALI_CRASH_LOOP_LIMIT": str(LIMIT),
    }
    return subprocess.run(
        [sys.executable, str(WORKER), json.dumps(spec)], env=env, capture_output=True,
        text=True, timeout=180,
    )


def payload(folder: Path, n: str, crash: bool = False) -> dict[str, Any]:
    return {"folder": str(folder), "n": n, "crash": crash}


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def test_the_ledger_counts_deaths_of_solo_holders_only(db: Database) -> None:
    """Catches a crash count that misses a dead per-request holder, counts a batch's group
    death against every member, or survives the operator's reset."""
    clock = Clock()
    store = IdempotencyStore(db, lease_seconds=10, clock=clock)
    first = store.begin("k", payload={})
    assert isinstance(first, Claim) and first.crashes == 0
    clock.now += 11  # the holder died: its lease ran out
    second = store.begin("k", payload={})
    assert isinstance(second, Claim) and second.takeover and second.crashes == 1
    clock.now += 11
    grouped = store.begin_many([("k", {}), ("g", {})])
    assert [c.crashes for c in grouped if isinstance(c, Claim)] == [2, 0]
    clock.now += 11  # the group died: nobody's fault yet
    again = store.begin_many([("k", {}), ("g", {})])
    assert [(c.takeover, c.crashes) for c in again if isinstance(c, Claim)] == [
        (True, 2), (True, 0)
    ]
    alone = again[1]
    assert isinstance(alone, Claim)
    store.run_alone(alone)
    clock.now += 11
    suspect = store.begin("g", payload={})
    assert isinstance(suspect, Claim) and suspect.crashes == 1
    store.fail(suspect, CrashLoop("g", 1, 0, []), "permanent")
    with pytest.raises(StoredFailure):
        store.begin("g", payload={})
    assert store.reset("g")
    fixed = store.begin("g", payload={})
    assert isinstance(fixed, Claim) and fixed.crashes == 0


def test_a_holder_that_stalled_past_its_lease_is_not_counted_as_a_crash(
    db: Database, db_url: str, redis_url: str, namespace: str, tmp_path: Path
) -> None:
    """Catches a freeze counted as a death: a worker stopped (SIGSTOP) past its lease is taken
    over, which counts a crash; when it wakes and learns it lost the key, the count is taken
    back, so a key whose workers only stall is never dead-lettered as a crash loop."""
    p = {**payload(tmp_path, "stall"), "pause": 3}
    spec = {"db_url": db_url, "redis_url": redis_url, "namespace": namespace,
            "job_type": "crash_probe", "payloads": [p], "lease_seconds": 1.0}
    env = {
        **os.environ, "PYTHONPATH": str(ROOT), "SEKALI_JOB_MODULES": "tests.crash_jobs",
        "SEKALI_CRASH_LOOP_LIMIT": str(LIMIT),
    }
    proc = subprocess.Popen([sys.executable, str(WORKER), json.dumps(spec)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    store = IdempotencyStore(db, lease_seconds=30)
    try:
        deadline = time.monotonic() + 120
        while crash_jobs.runs(tmp_path, "stall") == 0:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGSTOP)
        time.sleep(2.5)  # past the 1 s lease: the frozen holder cannot renew it
        taken = store.begin("crash-probe:stall", payload=p)
        assert isinstance(taken, Claim) and taken.takeover and taken.crashes == 1
    finally:
        proc.send_signal(signal.SIGCONT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    (answer,) = json.loads(out.strip().splitlines()[-1])
    assert answer["status"] == "LeaseLost", answer
    record = store.get("crash-probe:stall")
    assert record is not None and record.crashes == 0  # it woke: a stall, not a death
    store.complete(taken, {"n": "stall"})


def test_a_key_that_kills_its_worker_each_time_is_dead_lettered_as_crash_loop(
    db: Database, db_url: str, redis_url: str, namespace: str, tmp_path: Path
) -> None:
    """Catches a crash loop bounded only by whoever retries: the handler runs LIMIT + 1 times,
    each killing its worker; the next claim refuses to run it, stores the failure on the key
    (a later run gets it, not a new run) and says why, with the dead attempts."""
    p = payload(tmp_path, "loop", crash=True)
    spec = {"db_url": db_url, "redis_url": redis_url, "namespace": namespace,
            "job_type": "crash_probe", "payloads": [p], "lease_seconds": 1.0}
    for _ in range(LIMIT + 1):
        proc = worker(spec)
        assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:] + proc.stderr[-2000:]
    proc = worker(spec)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (answer,) = json.loads(proc.stdout.strip().splitlines()[-1])
    assert answer["status"] == "CrashLoop", answer
    assert f"crashed its worker {LIMIT + 1} times" in answer["result"]
    assert "last step reached: entered" in answer["result"]
    assert crash_jobs.runs(tmp_path, "loop") == LIMIT + 1
    record = IdempotencyStore(db).get("crash-probe:loop")
    assert record is not None and record.status is Status.FAILED
    assert record.error_class == "CrashLoop" and record.crashes == LIMIT + 1
    attempts = AttemptRecorder(db).for_key("crash-probe:loop")
    dead = [a for a in attempts if a["outcome"] == "started"]
    assert len(dead) == LIMIT + 1 and len({a["pid"] for a in dead}) == LIMIT + 1
    assert all(str(a["pid"]) in answer["result"] for a in dead)
    assert attempts[-1]["outcome"] == "failed_permanent"
    assert failure_class(CrashLoop("k", 2, 1, [])) is FailureClass.CRASH_LOOP


def test_a_batch_isolates_its_crasher_and_its_neighbours_complete_uncounted(
    db: Database, db_url: str, tmp_path: Path
) -> None:
    """Catches one request's crash taking its batch with it every time: after the first death
    every member is a suspect run alone; the innocent ones complete, never counted as
    crashers; the crasher dies alone until the bound, then its request is failed as
    ``crash_loop`` and dead-lettered with that class."""
    requests = RequestStore(db)
    names = ["a", "crash", "b", "c"]
    ids = [
        requests.enqueue(
            "crash_probe", f"crash-probe:{n}", payload(tmp_path, n, n == "crash"), queue="light"
        ).id
        for n in names
    ]
    spec = {"db_url": db_url, "request_ids": ids, "lease_seconds": 1.0}
    deaths = 0
    for _ in range(6):
        proc = worker(spec)
        if proc.returncode == 0:
            break
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
        deaths += 1
        for n in names:  # wait the dead batch's lease out
            record = IdempotencyStore(db).get(f"crash-probe:{n}")
            if record is not None and record.status is Status.IN_PROGRESS:
                assert record.lease_expires_at is not None
                time.sleep(max(0.0, record.lease_expires_at - time.time() + 0.2))
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["failed"] == 1 and "CrashLoop" in summary["failures"]["crash-probe:crash"]
    # the first death was the group's, then the crasher died alone LIMIT + 1 times
    assert deaths == LIMIT + 2
    assert crash_jobs.runs(tmp_path, "crash") == LIMIT + 2
    store = IdempotencyStore(db)
    for n in ("a", "b", "c"):
        record = store.get(f"crash-probe:{n}")
        assert record is not None and record.status is Status.COMPLETED and record.crashes == 0
        assert crash_jobs.runs(tmp_path, n) <= 2
    assert requests.counts()[RequestStatus.COMPLETED] == 3
    crasher = requests.get(ids[1])
    assert crasher is not None and crasher.error_class == "crash_loop"
    assert dead_letter_failed_requests(DlqStore(db)) == []  # written where it was decided
    (record,) = DlqStore(db).list_records()
    assert record.error_class == FailureClass.CRASH_LOOP
    assert record.idempotency_key == "crash-probe:crash" and record.request_id == ids[1]


def test_a_crash_loop_whose_dead_letter_was_lost_is_dead_lettered_as_crash_loop_later(
    db: Database
) -> None:
    """Catches a crash loop dead-lettered as ``permanent``: the decision stored the
    :class:`CrashLoop` on the key but its DLQ write failed (the database restarted between the
    two), so the next delivery finds the key failed before (:class:`StoredFailure`) and is the
    first to write the record: the record keeps the class the decision gave, ``crash_loop``."""
    from engine.dead_letters import Subject, dead_letter

    store = IdempotencyStore(db, lease_seconds=10)
    claim = store.begin("crash-probe:lost", payload={})
    assert isinstance(claim, Claim)
    store.fail(claim, CrashLoop("crash-probe:lost", 2, 1, []), "permanent")
    with pytest.raises(StoredFailure) as found:
        store.begin("crash-probe:lost", payload={})
    requests = RequestStore(db)
    request = requests.enqueue("crash_probe", "crash-probe:lost", {"n": "lost"}, queue="light")
    subject = Subject("crash_probe", {"n": "lost"}, key="crash-probe:lost",
                      request_id=request.id)
    written = dead_letter(requests, subject, found.value, run_id="run-2", step="worker")
    assert written is not None and written.error_class == "crash_loop"
    (record,) = DlqStore(db).list_records()
    assert record.error_class == FailureClass.CRASH_LOOP
    assert record.last_error is not None and "CrashLoop" in record.last_error
    again = requests.get(request.id)
    assert again is not None and again.error_class == "crash_loop"
