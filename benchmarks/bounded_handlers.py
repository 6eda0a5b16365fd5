"""What bounding handlers costs and how soon a hung one lets go: ``python -m
benchmarks.bounded_handlers [--json]``.

1. **Cost**: a trivial handler through the one execution path
   (:func:`engine.runtime.execute_request`) on a SQLite app database, 7 rounds of 300 fresh
   keys; the figure is the CPU time per request (``time.process_time``, so other processes on
   the machine do not count), min and median over the rounds. Each handler is handed to a
   thread of its own (:func:`engine.runtime.run_bounded`, a kept thread when one is idle): this
   is that hand-over's price, beside the lease keeper's thread every request already had.
   Compare with the code before bounded handlers:
   ``PYTHONPATH=<its checkout> python benchmarks/bounded_handlers.py --only cost``.
2. **Letting go**: one handler that never returns (it waits on an event nobody sets), bound
   ``--bound`` seconds, lease ``--lease`` seconds: when its request's step returned with
   ``timed_out`` (from the attempt's start), when the abandoned lease runs out (the key's
   recorded expiry, store time), and when a redelivery took the key over.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from engine import Keying, Queue, Running
from engine.attempts import AttemptRecorder
from engine.contract import JobType
from engine.registry import JOB_TYPES
from engine.runtime import execute_request
from engine.services import Services
from engine.step import StepAttempt, run_step
from resources.idempotency import IdempotencyStore
from resources.storage.db import Database
from resources.storage.migrations import upgrade

_NEVER = threading.Event()


def _hang_once(ctx: Any, p: dict[str, Any]) -> dict[str, Any]:
    if ctx.claim.attempt == 1:
        _NEVER.wait()
    return {"n": p["n"], "takeover": ctx.claim.takeover}


def _services(folder: Path, lease: float) -> Services:
    db = Database.from_url(f"sqlite:///{folder / 'bench.db'}")
    upgrade(db)
    return Services(db=db, store=IdempotencyStore(db, lease_seconds=lease),
                    attempts=AttemptRecorder(db))


def cost(folder: Path, rounds: int = 7, per_round: int = 300) -> dict[str, Any]:
    JOB_TYPES["bench_noop"] = JobType(
        name="bench_noop",
        queue=Queue.LIGHT,
        validate=dict,
        handler=lambda c, p: {"n": p["n"]},
        side_effect=False,
        keying=Keying(key_for=lambda p: f"noop:{p['n']}", resource_id=lambda p: str(p["n"])),
        running=Running(max_runtime_seconds=60),
    )
    services = _services(folder, 30.0)
    runs = []
    for r in range(rounds):
        started = time.process_time()
        for i in range(per_round):
            execute_request("bench_noop", {"n": f"{r}-{i}"}, services=services)
        runs.append((time.process_time() - started) / per_round * 1000)
    return {"cpu_ms_per_request_min": round(min(runs), 3),
            "cpu_ms_per_request_median": round(statistics.median(runs), 3),
            "rounds": rounds, "per_round": per_round}


def letting_go(folder: Path, bound: float, lease: float) -> dict[str, Any]:
    JOB_TYPES["bench_hang"] = JobType(
        name="bench_hang",
        queue=Queue.LIGHT,
        validate=dict,
        handler=_hang_once,
        side_effect=False,
        keying=Keying(key_for=lambda p: f"hang:{p['n']}", resource_id=lambda p: str(p["n"])),
        running=Running(max_runtime_seconds=bound),
    )
    services = _services(folder, lease)
    started = time.time()
    result = run_step(services, StepAttempt(run_id="bench", step="bench_hang"),
                      job_type="bench_hang", payload={"n": "1"})
    decided = time.time()
    record = services.store.get("hang:1")
    assert record is not None and record.lease_expires_at is not None
    time.sleep(max(0.0, record.lease_expires_at - time.time()) + 0.05)
    again = execute_request("bench_hang", {"n": "1"}, services=services)
    return {
        "bound_s": bound, "lease_s": lease,
        "error": type(result.error).__name__ if result.error else None,
        "timed_out_after_s": round(decided - started, 3),
        "lease_runs_out_after_s": round(record.lease_expires_at - started, 3),
        "taken_over_after_s": round(time.time() - started, 3),
        "takeover": bool(again.result["takeover"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--bound", type=float, default=2.0)
    parser.add_argument("--lease", type=float, default=2.0)
    parser.add_argument("--only", choices=["cost", "letting_go"],
                        help="one part (cost alone also runs on a release without bounds)")
    args = parser.parse_args(argv)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.only in (None, "cost"):
            (Path(tmp) / "a").mkdir()
            out["cost"] = cost(Path(tmp) / "a")
        if args.only in (None, "letting_go"):
            (Path(tmp) / "b").mkdir()
            out["letting_go"] = letting_go(Path(tmp) / "b", args.bound, args.lease)
    if args.json:
        print(json.dumps(out))
    else:
        for part, figures in out.items():
            print(part + ": " + ", ".join(f"{k} {v}" for k, v in figures.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
