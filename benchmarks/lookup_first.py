"""What a lookup before the first send costs: ``python -m benchmarks.lookup_first [--quick]
[--json]``.

``charge_payment`` and ``send_email`` run first sends (a fresh key each) through the one
execution path (:func:`engine.execute_request`) against the sandbox gateway and mail sink over
their real protocols, on a SQLite app database, with the first-send lookup off and on
(``SEKALI_LOOKUP_FIRST``), in interleaved rounds. The figure is the ratio of the median round's
time per request, on over off, per job type: what the guard against a failover's rollback
(docs/chaos.md, ``pg-failover``) costs on this machine, measured against itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from engine import execute_request
from engine.attempts import AttemptRecorder
from engine.contract import LOOKUP_FIRST_ENV
from engine.services import Services
from pipelines.domain.mail import SMTP, SmtpMailer
from pipelines.domain.payments import GATEWAY, HttpPaymentGateway
from resources.idempotency import IdempotencyStore
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from sandbox.gateway import GatewayServer
from sandbox.mailsink import MailSink

PAYLOADS = {
    "charge_payment": lambda n: {"order_id": f"bench-{n}", "amount_cents": 100 + n,
                                 "currency": "EUR"},
    "send_email": lambda n: {"template": "welcome", "user_id": f"bench-{n}",
                             "date": "2026-12-01", "to": f"u{n}@example.com"},
}


def _round(services: Services, job_type: str, n: int, tag: str) -> float:
    """Seconds per request over ``n`` first sends of ``job_type``."""
    started = time.perf_counter()
    for i in range(n):
        payload = PAYLOADS[job_type](i)
        if job_type == "charge_payment":
            payload["order_id"] = f"{tag}-{i}"
        else:
            payload["user_id"] = f"{tag}-{i}"
        execute_request(job_type, payload, services=services)
    return (time.perf_counter() - started) / n


def run(quick: bool = False) -> dict[str, Any]:
    rounds, per_round = (3, 20) if quick else (7, 60)
    folder = Path(tempfile.mkdtemp(prefix="sekali-bench-lookup-"))
    gateway = GatewayServer(f"sqlite:///{folder / 'gateway.db'}").start()
    sink = MailSink(f"sqlite:///{(folder / 'mailsink.db').resolve()}").start()
    db = Database.from_url(f"sqlite:///{folder / 'app.db'}")
    upgrade(db)
    services = Services(
        db=db, store=IdempotencyStore(db, lease_seconds=60), attempts=AttemptRecorder(db),
        clients={GATEWAY.name: HttpPaymentGateway(gateway.url),
                 SMTP.name: SmtpMailer(sink.host, sink.port, log_url=sink.db_url)},
    )
    saved = os.environ.get(LOOKUP_FIRST_ENV)
    seconds: dict[str, dict[str, list[float]]] = {jt: {"off": [], "on": []} for jt in PAYLOADS}
    try:
        for _ in range(rounds):
            for job_type in PAYLOADS:
                for mode in ("off", "on"):
                    flag = "1" if mode == "on" else "0"
                    os.environ[LOOKUP_FIRST_ENV] = f"{job_type}={flag}"
                    took = _round(services, job_type, per_round, uuid.uuid4().hex[:8])
                    seconds[job_type][mode].append(took)
    finally:
        if saved is None:
            os.environ.pop(LOOKUP_FIRST_ENV, None)
        else:
            os.environ[LOOKUP_FIRST_ENV] = saved
        db.dispose()
        gateway.stop()
        sink.stop()
    summary = []
    for job_type, by_mode in seconds.items():
        off, on = statistics.median(by_mode["off"]), statistics.median(by_mode["on"])
        summary.append({
            "metric": f"{job_type}: first send with lookup / without",
            "value": round(on * 1000, 2), "unit": "ms per request",
            "baseline": round(off * 1000, 2), "ratio": round(on / off, 3),
            "target": None, "ok": True,
        })
    return {"summary": summary, "rounds": rounds, "per_round": per_round,
            "seconds": {jt: {m: [round(x, 5) for x in v] for m, v in by_mode.items()}
                        for jt, by_mode in seconds.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lookup_first",
                                     description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report = run(quick=args.quick)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for row in report["summary"]:
        print(f"{row['metric']}: {row['value']} ms vs {row['baseline']} ms, "
              f"ratio {row['ratio']}", file=sys.stdout)


if __name__ == "__main__":
    main()
