"""A job type that declares a resource exclusive, for the one-fence tests: ``exclusive_probe``
(key ``exclusive-probe:{n}``, exclusive on ``probe:{resource}``) notes when its handler
entered, waits ``hold`` seconds, may stop itself (``SEKALI_STOP_AT=exclusive_probe_write``),
then writes one ``probe_writes`` row through ``ctx.fenced_transaction()`` with the fence the
context gives it, and when it left.

``python -m tests.exclusive_jobs SPEC_JSON`` runs one request through the engine's step entry in
a process of its own (SPEC: ``db_url``, ``redis_url``, ``prefix``, ``ttl``, ``payload``), with a
Redis lock of TTL ``ttl`` as the services' ``locks``, and prints the outcome as one JSON line;
with ``payloads`` instead, one micro-batch through ``execute_batch`` (a resident worker's path),
one line per request.
Named in ``SEKALI_JOB_MODULES`` by those processes, nowhere else.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from sqlalchemy import text  # noqa: E402 - after the path is set

from engine import (  # noqa: E402
    Exclusive,
    JobContext,
    JobType,
    Keying,
    Queue,
    Running,
    formatted,
)

PROBE_DDL = (
    "CREATE TABLE IF NOT EXISTS probe_writes (key TEXT PRIMARY KEY, resource TEXT NOT NULL,"
    " scope TEXT NOT NULL, fence BIGINT NOT NULL, entered DOUBLE PRECISION NOT NULL,"
    " left_at DOUBLE PRECISION NOT NULL)"
)


def _handler(ctx: JobContext, p: dict[str, Any]) -> dict[str, Any]:
    entered = time.time()
    fence = ctx.write_fence
    time.sleep(float(p.get("hold", 0)))
    ctx.crash_point("exclusive_probe_write")
    with ctx.fenced_transaction("probe_write") as conn:
        conn.execute(
            text("INSERT INTO probe_writes (key, resource, scope, fence, entered, left_at)"
                 " VALUES (:k, :r, :s, :f, :e, :l)"),
            {"k": ctx.key, "r": p["resource"], "s": fence.scope, "f": fence.token,
             "e": entered, "l": time.time()},
        )
        ctx.complete({"fence": fence.token}, conn=conn)
    return {"fence": fence.token}


JOB_TYPE = JobType(
    name="exclusive_probe",
    queue=Queue.LIGHT,
    validate=dict,
    handler=_handler,
    side_effect=False,
    keying=Keying(key_for=lambda p: f"exclusive-probe:{p['n']}",
                  resource_id=lambda p: str(p["resource"])),
    running=Running(max_runtime_seconds=60,
                    exclusive=Exclusive(formatted("probe:{resource}"), wait=30.0)),
)


def main(argv: list[str]) -> int:
    from engine.attempts import AttemptRecorder
    from engine.runtime import BatchRequest, execute_batch, execute_request
    from engine.services import Services
    from resources.idempotency import IdempotencyStore
    from resources.locks import RedisLock
    from resources.storage.db import Database
    from resources.storage.redis import redis_client

    spec = json.loads(argv[0])
    db = Database.from_url(spec["db_url"])
    locks = functools.partial(RedisLock, redis_client(spec["redis_url"]), ttl=float(spec["ttl"]),
                              prefix=spec["prefix"])
    services = Services(db=db, store=IdempotencyStore(db, lease_seconds=60.0),
                        attempts=AttemptRecorder(db), locks=locks)
    if "payloads" in spec:
        batch = [BatchRequest("exclusive_probe", p) for p in spec["payloads"]]
        for got in execute_batch(batch, services=services):
            print(json.dumps({"status": getattr(got, "status", type(got).__name__)}), flush=True)
        return 0
    try:
        outcome = execute_request("exclusive_probe", spec["payload"], services=services)
    except Exception as exc:  # noqa: BLE001 - the test reads what the step raised
        print(json.dumps({"status": "raised", "error": type(exc).__name__}), flush=True)
        return 0
    print(json.dumps({"status": outcome.status, "fence": outcome.result["fence"]}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
