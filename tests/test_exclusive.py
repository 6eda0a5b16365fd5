"""One fencing mechanism: a job type that declares a resource exclusive runs its handlers one
at a time on it across processes, and a holder whose lock expired under it has its write
rejected by the database, on real Redis and real SQLite / Postgres. The processes run
``tests.exclusive_jobs`` through the engine's step entry (``execute_request``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from engine import Exclusive, JobType, Keying, Queue, Running, Services, execute_request, formatted
from engine.attempts import AttemptRecorder
from engine.services import MissingLocks
from resources.idempotency import IdempotencyStore
from resources.locks import Fence, fence_status, fenced
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from tests.exclusive_jobs import PROBE_DDL

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "SEKALI_JOB_MODULES": "tests.exclusive_jobs"}
GUARD = 60.0


def _migrated(db_url: str) -> Database:
    db = Database.from_url(db_url)
    upgrade(db)
    with db.transaction() as conn:
        conn.execute(text(PROBE_DDL))
    return db


def _start(spec: dict[str, Any], *, stop_at: str = "") -> subprocess.Popen[str]:
    env = {**ENV, "SEKALI_STOP_AT": stop_at} if stop_at else ENV
    return subprocess.Popen([sys.executable, "-m", "tests.exclusive_jobs", json.dumps(spec)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)


def _outcome(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=GUARD)
    assert proc.returncode == 0, out
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _stopped(pid: int) -> bool:
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state == "T"


def _writes(db: Database) -> list[Any]:
    with db.statement() as conn:
        return list(conn.execute(text(
            "SELECT key, scope, fence, entered, left_at FROM probe_writes ORDER BY entered")))


def test_handlers_of_one_declared_resource_never_overlap_across_processes(
    db_url: str, redis_url: str, namespace: str
) -> None:
    """Catches: an engine that runs an exclusive job type's handler without its lock (four
    processes, four keys, one resource: their hold times overlap), a lock taken per key instead
    of per resource, and a write fence that is the claim's (every key's first claim is fence 1;
    the lock's fences grow with every grant)."""
    db = _migrated(db_url)
    spec = {"db_url": db_url, "redis_url": redis_url, "prefix": f"{namespace}:lock:",
            "ttl": 10.0}
    procs = [_start({**spec, "payload": {"n": f"s{i}", "resource": "r1", "hold": 0.4}})
             for i in range(4)]
    outcomes = [_outcome(p) for p in procs]
    assert [o["status"] for o in outcomes] == ["completed"] * 4, outcomes
    rows = _writes(db)
    assert len(rows) == 4 and {r.scope for r in rows} == {"probe:r1"}
    for before, after in zip(rows, rows[1:], strict=False):
        assert after.entered >= before.left_at, "two handlers held probe:r1 at once"
        assert after.fence > before.fence
    db.dispose()


def test_micro_batches_on_one_resource_take_turns_per_request(
    db_url: str, redis_url: str, namespace: str
) -> None:
    """Catches: the batch path (a resident worker's ``execute_batch``) running an exclusive
    type's handlers without the lock, while the per-request path takes it. Two processes, two
    requests each, one resource: no two handlers overlap, fences grow."""
    db = _migrated(db_url)
    spec = {"db_url": db_url, "redis_url": redis_url, "prefix": f"{namespace}:lock:",
            "ttl": 10.0}
    procs = [_start({**spec, "payloads": [{"n": f"m{i}{j}", "resource": "r3", "hold": 0.3}
                                          for j in range(2)]}) for i in range(2)]
    for proc in procs:
        out, _ = proc.communicate(timeout=GUARD)
        assert proc.returncode == 0 and out.count('"completed"') == 2, out
    rows = _writes(db)
    assert len(rows) == 4 and {r.scope for r in rows} == {"probe:r3"}
    for before, after in zip(rows, rows[1:], strict=False):
        assert after.entered >= before.left_at and after.fence > before.fence
    db.dispose()


def test_a_holder_whose_lock_expired_has_its_write_rejected_by_the_database(
    db_url: str, redis_url: str, namespace: str
) -> None:
    """Catches: a handler of an exclusive type writing with its claim's fence (A's key is
    claimed once: fence 1, never stale), a write check that is not in the business write's
    transaction (A's row would be written), and a rejection that is not counted.

    Timeline: A takes probe:r2 (lock fence f), stops before its write; the 1 s TTL runs out;
    B (another key) takes probe:r2 (fence f+1) and writes; A resumes and writes with f."""
    db = _migrated(db_url)
    spec = {"db_url": db_url, "redis_url": redis_url, "prefix": f"{namespace}:lock:",
            "ttl": 1.0}
    a = _start({**spec, "payload": {"n": "a", "resource": "r2"}},
               stop_at="exclusive_probe_write")
    try:
        deadline = time.monotonic() + GUARD
        while not _stopped(a.pid):
            assert a.poll() is None and time.monotonic() < deadline, "A never reached its write"
            time.sleep(0.05)
        time.sleep(1.5)  # past the lock's TTL: A's watchdog is stopped with it
        b = _outcome(_start({**spec, "payload": {"n": "b", "resource": "r2"}}))
        assert b["status"] == "completed"
    finally:
        os.kill(a.pid, signal.SIGCONT)
    a_out = _outcome(a)
    assert a_out == {"status": "raised", "error": "FencedWriteRejected"}
    rows = _writes(db)
    assert [r.key for r in rows] == ["exclusive-probe:b"]
    status = fence_status(db, "probe:r2")
    assert status is not None and status.highest_fence == b["fence"] and status.rejected == 1
    db.dispose()


def test_the_claim_and_the_lock_are_one_fence_check(db: Database) -> None:
    """Catches: two write checks that disagree. The same ``fenced`` accepts the current fence of
    a claim's scope and of a lock's, the same holder again, and rejects an older token or an
    equal one from another holder, whatever granted it."""
    for scope in ("payment:o-1", "report:stock_levels"):
        with fenced(db, Fence(scope, 3, "h3")):
            pass
        with fenced(db, Fence(scope, 3, "h3")):
            pass
        for stale in (Fence(scope, 2, "h2"), Fence(scope, 3, "other")):
            with pytest.raises(Exception, match="rejected"), fenced(db, stale):
                pass
        status = fence_status(db, scope)
        assert status is not None and (status.highest_fence, status.rejected) == (3, 2)


def test_an_exclusive_declaration_names_a_payload_field_and_needs_the_locks_resource() -> None:
    """Catches: a declaration over a field the payload lacks (every request would fail at run
    time), and a per-request op that is not given the ``locks`` resource."""
    from pydantic import BaseModel

    class Payload(BaseModel):
        report: str

    def handler(ctx: Any, p: Payload) -> None:
        return None

    def declare(on: str) -> JobType[Payload]:
        return JobType(
            name="probe", queue=Queue.LIGHT, payload=Payload, handler=handler,
            side_effect=False,
            keying=Keying(key_for=formatted("probe:{report}"), resource_id=formatted("{report}")),
            running=Running(max_runtime_seconds=5, exclusive=Exclusive(formatted(on))),
        )

    declared = declare("report:{report}")
    assert "locks" in declared.resource_keys
    assert declared.exclusive_on({"report": "x"}) == "report:x"
    with pytest.raises(ValueError, match="names no field 'account'"):
        declare("account:{account}")
    with pytest.raises(ValueError, match="handler_many"):
        replace(declared, running=replace(declared.running, handler_many=lambda pairs: []))


def test_an_exclusive_type_without_locks_fails_permanently_before_its_handler(
    db: Database,
) -> None:
    """Catches: an engine that runs an exclusive type's handler unlocked when the run has no
    lock factory (the built-in report rebuild, services without ``locks``): it must refuse,
    permanently, having written nothing."""
    services = Services(db=db, store=IdempotencyStore(db, lease_seconds=30.0),
                        attempts=AttemptRecorder(db))
    with pytest.raises(MissingLocks):
        execute_request("rebuild_report_cache",
                        {"report": "stock_levels", "as_of": "no-locks"}, services=services)
    with db.statement() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM report_snapshots")).scalar() == 0
