"""``sekali enqueue JOB_TYPE --payload JSON [--key KEY] [--correlation-id ID]``.

Prints the request id, key and status (``created`` or ``duplicate``). Exit codes: 0 accepted
(new or duplicate), 2 bad input (the field is named on stderr; the request is kept in
``job_rejections``), 3 key conflict (same key, another payload).
"""

from __future__ import annotations

import argparse
import sys

from pipelines.intake import enqueue
from resources.errors import IdempotencyConflict, ValidationError
from resources.storage.db import shared_database


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("enqueue", help="write a job request for the intake sensor")
    parser.add_argument("job_type", help="charge_payment, send_email, reserve_inventory, ...")
    parser.add_argument("--payload", required=True, help="the payload as a JSON object")
    parser.add_argument("--key", help="idempotency key (default: the job type's key)")
    parser.add_argument("--correlation-id", dest="correlation_id")
    parser.add_argument("--url", help="app database URL (default: DATABASE_URL or embedded)")
    parser.set_defaults(func=_enqueue)


def _enqueue(args: argparse.Namespace) -> int:

    db = shared_database(args.url) if args.url else None
    try:
        result = enqueue(
            args.job_type, args.payload, key=args.key, correlation_id=args.correlation_id, db=db
        )
    except ValidationError as exc:
        print(f"error: field {exc.field!r}: {exc} (kept in job_rejections)", file=sys.stderr)
        return 2
    except IdempotencyConflict as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    outcome = "created" if result.created else "duplicate"
    print(f"request {result.id} key={result.key} status={result.status} ({outcome})")
    return 0
