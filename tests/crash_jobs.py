"""A job type for the crash-loop tests: ``crash_probe`` notes each run of its handler in
``{folder}/{n}`` (one line per entry, with the pid) and, for a payload with ``crash`` set, then
reaches the crash point ``crash_probe`` (``SEKALI_CRASH_AT=crash_probe`` kills the worker
there); ``pause`` seconds after its checkpoint let a test freeze the worker mid-run. Named in
``SEKALI_JOB_MODULES`` by the worker processes, nowhere else."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from engine import JobContext, JobType, Keying, Queue, Running


def _handler(ctx: JobContext, p: dict[str, Any]) -> dict[str, Any]:
    with (Path(p["folder"]) / p["n"]).open("a") as runs:
        runs.write(f"{os.getpid()}\n")
    ctx.services.store.checkpoint(ctx.claim, "entered")
    time.sleep(float(p.get("pause", 0)))  # a window in which the test freezes the worker
    if p.get("crash"):
        ctx.crash_point("crash_probe")
    return {"n": p["n"]}


JOB_TYPE = JobType(
    name="crash_probe",
    queue=Queue.LIGHT,
    validate=dict,
    handler=_handler,
    side_effect=False,
    keying=Keying(key_for=lambda p: f"crash-probe:{p['n']}", resource_id=lambda p: str(p["n"])),
    running=Running(max_runtime_seconds=60),
)


def runs(folder: Path, n: str) -> int:
    """How many times the handler of request ``n`` was entered."""
    path = folder / n
    return len(path.read_text().splitlines()) if path.exists() else 0
