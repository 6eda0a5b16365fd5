"""Worker code the cancel race test runs in spawned processes: intake workers that claim and
run requests the way the runs do, and cancellers. Module-level functions only."""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def intake_worker(spec: dict[str, Any]) -> dict[str, int]:
    """Claim requests (``claim_for_launch``) and run each claimed page, as a micro-batch run
    (``run_batch``) or request by request as the per-request op does (``mark_running``, the one
    execution path, the failure path), until nothing is left to claim; returns counts."""
    from engine.attempts import AttemptRecorder
    from engine.failures import FailurePath
    from engine.requests import RequestStore
    from engine.runtime import execute_request
    from engine.services import Services
    from engine.step import run_batch
    from pipelines.domain.mail import SmtpMailer
    from resources.idempotency import IdempotencyStore
    from resources.storage.db import Database

    db = Database.from_url(spec["db_url"])
    store = RequestStore(db)
    services = Services(
        db=db, store=IdempotencyStore(db), attempts=AttemptRecorder(db),
        clients={"smtp": SmtpMailer("127.0.0.1", spec["smtp_port"])},
    )
    counts = {"claimed": 0, "completed": 0, "not_run": 0, "failed": 0}
    time.sleep(max(0.0, spec["go"] - time.time()))
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            page = store.claim_for_launch(3, relaunch_after=3600)
            if not page:
                if not store.find(status=["pending", "launched"], limit=1):
                    break
                time.sleep(0.01)
                continue
            counts["claimed"] += len(page)
            if spec["batch"]:
                summary = run_batch(store, [r.id for r in page], services=services,
                                    run_id=f"batch-{spec['n']}")
                counts["completed"] += summary["completed"] + summary["duplicate"]
                counts["not_run"] += summary["skipped"]
                continue
            for request in page:
                if not store.mark_running(request.id, run_id=f"run-{spec['n']}"):
                    counts["not_run"] += 1
                    continue
                path = FailurePath(retries_here=False)
                try:
                    execute_request(request.job_type, request.payload, services=services,
                                    key=request.key, request_id=request.id, decide=path.outcome)
                except Exception as exc:  # noqa: BLE001 - cancelled (or failed): settled below
                    path.settle_request(store, request.id, exc, run_id=f"run-{spec['n']}")
                    counts["failed"] += 1
                    continue
                store.mark_completed(request.id, run_id=f"run-{spec['n']}")
                counts["completed"] += 1
    finally:
        db.dispose()
    return counts


def canceller(spec: dict[str, Any]) -> dict[str, int]:
    """Cancel ``spec["ids"]`` newest first, a random few tens of milliseconds apart once a
    worker started: the workers take the oldest first, so the cancels meet requests pending
    (however fast the workers are), then claimed, running and completed where the two meet."""
    from engine.requests import RequestStore
    from resources.storage.db import Database

    db = Database.from_url(spec["db_url"])
    store = RequestStore(db)
    ids = sorted(spec["ids"], reverse=True)
    pause = random.Random(spec["n"])
    counts: dict[str, int] = {}
    time.sleep(max(0.0, spec["go"] - time.time()))
    deadline = time.monotonic() + 60
    while not store.find(status=["running", "completed"], limit=1):  # the workers are at it
        if time.monotonic() > deadline:
            raise TimeoutError("no worker started")
        time.sleep(0.005)
    try:
        for request_id in ids:
            decision = store.cancel(request_id, by=f"canceller-{spec['n']}", reason="race")
            counts[str(decision.state)] = counts.get(str(decision.state), 0) + 1
            time.sleep(pause.uniform(0.0, spec.get("pause", 0.08)))
    finally:
        db.dispose()
    return counts
