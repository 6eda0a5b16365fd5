"""The job type of the adaptive benchmark (:mod:`benchmarks.adaptive`), found through
``SEKALI_JOB_MODULES=benchmarks.adaptive_jobs`` by every process the benchmark starts.

``adaptive_probe`` does its work, then writes one row to ``adaptive_effects`` and completes its
key in the same transaction (the lease is checked first, the completion is owner-conditioned:
a holder whose lease ran out writes nothing). Its work depends on the payload's ``phase``:

- ``fast``: 50 ms of waiting on a downstream (``time.sleep``);
- ``tail``: a heavy tail (Pareto, 50 ms minimum, p99 4 s, cut at 16 s), drawn from the
  request's number so every attempt of a request takes as long: the first 200 ms wait on a
  downstream, the rest is a **stall of the whole process** (a C call holding the GIL, as a
  driver or a compression library can: the lease keeper's heartbeats wait behind it). That is
  the case a lease must outlast: the holder is alive and cannot renew.

Rows of ``adaptive_effects`` count effects per key: two for one key is a duplicate.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

from sqlalchemy import text

from engine import JobContext, JobType, Keying, Presentation, Queue, Running

EFFECTS_DDL = ("CREATE TABLE IF NOT EXISTS adaptive_effects (key TEXT NOT NULL, fence BIGINT, "
               "at DOUBLE PRECISION NOT NULL)")
TAIL_ALPHA = 1.051
"""Pareto shape with a 50 ms minimum: p99 = 0.05 x 100 ** (1 / alpha) = 4 s."""
TAIL_CUT = 16.0
_NO_GIL_RELEASE = ctypes.PyDLL(None)  # libc, called WITHOUT releasing the GIL


def duration_of(phase: str, n: int) -> float:
    """Seconds of work of request ``n`` in ``phase`` (deterministic)."""
    if phase == "fast":
        return 0.05
    u = ((n * 2654435761) % 2**32 + 0.5) / 2**32
    return min(TAIL_CUT, 0.05 * (1 - u) ** (-1 / TAIL_ALPHA))


def stall(seconds: float) -> None:
    """Block the whole process (every thread) for ``seconds`` without using the CPU."""
    left = int(seconds * 1_000_000)
    while left > 0:
        step = min(left, 900_000)
        _NO_GIL_RELEASE.usleep(step)
        left -= step


def _work(payload: dict[str, Any]) -> None:
    seconds = duration_of(str(payload["phase"]), int(payload["n"]))
    time.sleep(min(seconds, 0.2))
    if seconds > 0.2:
        stall(seconds - 0.2)


def handler(ctx: JobContext, payload: dict[str, Any]) -> dict[str, Any]:
    _work(payload)
    with ctx.transaction("effect") as conn:
        conn.execute(text("INSERT INTO adaptive_effects (key, fence, at) VALUES (:k, :f, :t)"),
                     {"k": ctx.key, "f": ctx.fence, "t": time.time()})
        ctx.complete({"n": payload["n"]}, conn=conn)
    return {"n": payload["n"]}


JOB_TYPE = JobType(
    name="adaptive_probe",
    queue=Queue.LIGHT,
    validate=dict,
    handler=handler,
    side_effect=True,
    keying=Keying(key_for=lambda p: f"adaptive:{p['run']}:{p['n']}",
                  resource_id=lambda p: str(p["n"])),
    running=Running(max_runtime_seconds=60),
    presentation=Presentation(
        description="The adaptive benchmark's probe: fast or heavy-tailed work, then one effect "
                    "row."
    ),
)
