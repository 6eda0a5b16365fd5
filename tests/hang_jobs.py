"""A job type whose handler hangs, for the bounded-handler tests: ``hang_probe`` notes each
entry in ``{folder}/{n}`` (one line per entry: the pid and the time it entered) and, on the
first entry of ``n``, waits on an event nobody sets (a downstream that never answers, a
client without a timeout). Later entries (a redelivery that took the key over) go straight
on. Whatever gets past the wait confirms its lease before its "send" and notes the send in
``{folder}/{n}.sent``, or the refusal in ``{folder}/{n}.refused``: a hung thread released
after its bound must be refused.

Its bound is :data:`BOUND` seconds. ``python -m tests.hang_jobs SPEC_JSON`` runs one request
through the engine's step entry in a process of its own (SPEC: ``db_url``, ``lease``,
``request_id``, ``payload``) and prints what the step decided as one JSON line. Named in
``SEKALI_JOB_MODULES`` by that process, nowhere else.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine import JobContext, JobType, Keying, Queue, Running  # noqa: E402 - after the path is set

BOUND = 2.0
HOLDS: dict[str, threading.Event] = {}


def entered(folder: Path, n: str) -> float:
    """When the first handler of ``n`` entered (the clock the store's leases use)."""
    return float((folder / n).read_text().splitlines()[0].split()[1])

"""The events hung handlers of this process wait on, by ``n``: an in-process test sets one to
let its hung thread go on (late) once the engine abandoned it."""


def _handler(ctx: JobContext, p: dict[str, Any]) -> dict[str, Any]:
    folder, n = Path(p["folder"]), str(p["n"])
    first = not (folder / n).exists()
    with (folder / n).open("a") as entries:
        entries.write(f"{os.getpid()} {time.time():.6f}\n")
    if first and not p.get("quick"):
        HOLDS.setdefault(n, threading.Event()).wait()
    try:
        ctx.confirm_lease()
    except Exception as exc:
        (folder / f"{n}.refused").write_text(type(exc).__name__)
        raise
    with (folder / f"{n}.sent").open("a") as sent:
        sent.write(f"{os.getpid()}\n")
    return {"n": n, "takeover": ctx.claim.takeover}


JOB_TYPE = JobType(
    name="hang_probe",
    queue=Queue.LIGHT,
    validate=dict,
    handler=_handler,
    side_effect=True,
    keying=Keying(key_for=lambda p: f"hang-probe:{p['n']}", resource_id=lambda p: str(p["n"])),
    running=Running(max_runtime_seconds=BOUND),
)


def main(argv: list[str]) -> int:
    from engine.attempts import AttemptRecorder
    from engine.services import Services
    from engine.step import StepAttempt, run_step
    from resources.idempotency import IdempotencyStore
    from resources.retry import failure_class
    from resources.storage.db import Database

    spec = json.loads(argv[0])
    db = Database.from_url(spec["db_url"])
    services = Services(db=db, store=IdempotencyStore(db, lease_seconds=float(spec["lease"])),
                        attempts=AttemptRecorder(db))
    result = run_step(services, StepAttempt(run_id="engine-alone", step="hang_probe"),
                      job_type="hang_probe", payload=spec["payload"],
                      request_id=spec["request_id"])
    print(json.dumps({
        "ok": result.ok,
        "error": str(result.error),
        "error_class": str(failure_class(result.error)) if result.error is not None else None,
        "dead_letter": result.dead_letter.record_id if result.dead_letter else None,
    }), flush=True)
    return 0  # a hung handler's thread must not keep this process alive


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
