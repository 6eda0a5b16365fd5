"""``sekali enqueue JOB_TYPE --payload JSON|@FILE|- [--key KEY] [--correlation-id ID]``.

``--payload`` takes the JSON text itself, ``@path`` for a file, or ``-`` for standard input
(bytes that are not UTF-8 reach the validation boundary as lone surrogates and are refused by
name). Prints the request id, key and status (``created`` or ``duplicate``); ``--json`` prints
the request as JSON instead (``--out PATH`` writes it to a file too).

``--wait`` then follows the request to its end (:mod:`cli.commands.follow`): one line on
stderr per change (queued -> claimed -> running -> completed / failed / dead-lettered, with
attempts and run id); with ``--json`` the final state is the JSON. Something must drive the
request (the intake sensor of ``sekali dev`` or a Dagster daemon).

Exit codes: 0 accepted (new or duplicate; with ``--wait``: completed), 1 the store failed (retry
later), or with ``--wait`` the request failed, was dead-lettered or had not ended by
``--timeout``; 2 bad input or usage (one line on stderr, ``field: what is wrong``; the request is
kept in ``job_rejections``, see ``sekali rejections``), or a job type this process does not
know (one line naming ``SEKALI_JOB_MODULES`` and the modules loaded; an operator's mistake, so
nothing is kept); 3 key conflict (same key, another payload).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from cli.commands.follow import add_wait_arguments, exit_code, follow, request_progress
from cli.commands.output import add_output_arguments, emit
from cli.commands.requests import request_json
from engine.intake import enqueue
from engine.registry import JobModuleError, UnknownJobType, require_job_type
from engine.requests import RequestStore
from engine.validation import admit
from resources.dlq import DlqStore
from resources.errors import IdempotencyConflict, SekaliError, ValidationError
from resources.storage.db import shared_database
from resources.storage.settings import Settings

EXIT_STATUSES = """exit status:
  0  accepted: a new request, or a duplicate of one (same key, same payload)
  1  the store failed (retry later); with --wait: the request did not complete
  2  bad usage or input (one line naming the field; the input is kept: sekali rejections),
     or a job type this process does not know (see SEKALI_JOB_MODULES; nothing is kept)
  3  conflict: the key is taken by a request with another payload (not a duplicate; choose
     another key, or send the same payload)"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "enqueue", help="write a job request for the intake sensor", epilog=EXIT_STATUSES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("job_type", help="charge_payment, send_email, reserve_inventory, ...")
    parser.add_argument(
        "--payload", required=True, help="the payload: JSON text, @FILE, or - for stdin"
    )
    parser.add_argument("--key", help="idempotency key (default: the job type's key)")
    parser.add_argument("--correlation-id", dest="correlation_id")
    parser.add_argument(
        "--priority", default="0", help="-10 (least) .. 10 (most urgent), default 0"
    )
    parser.add_argument("--url", help="app database URL (default: DATABASE_URL or embedded)")
    add_wait_arguments(parser)
    add_output_arguments(parser)
    parser.set_defaults(func=_enqueue)


def read_payload(value: str) -> str:
    """The payload text ``--payload`` names: itself, a file (``@path``) or stdin (``-``).
    Raises OSError when the file cannot be read."""
    if value == "-":
        data = sys.stdin.buffer.read()
    elif value.startswith("@"):
        data = Path(value[1:]).read_bytes()
    else:
        return value
    return data.decode("utf-8", "surrogateescape")


def _enqueue(args: argparse.Namespace) -> int:
    try:
        payload = read_payload(args.payload)
    except OSError as exc:
        print(f"error: --payload {args.payload}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    try:
        require_job_type(args.job_type)  # a name this process does not know: no rejection row
    except (UnknownJobType, JobModuleError) as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    db = shared_database(args.url) if args.url else None
    if not getattr(args, "verbose", False):
        # A refusal is this command's answer, printed once below, not also as a log line.
        logging.getLogger(admit.__module__).setLevel(logging.ERROR)
        logging.getLogger(enqueue.__module__).setLevel(logging.WARNING)
    try:
        result = enqueue(
            args.job_type,
            payload,
            key=args.key,
            correlation_id=args.correlation_id,
            db=db,
            source="cli",
            priority=_priority(getattr(args, "priority", "0")),  # a Namespace built by hand
        )
    except ValidationError as exc:
        kept = f"rejection {exc.rejection_id}" if exc.rejection_id else "job_rejections"
        print(f"error: {_one_line(exc)} (kept as {kept})", file=sys.stderr)
        return 2
    except IdempotencyConflict as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 3
    except SekaliError as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 1
    outcome = "created" if result.created else "duplicate"
    made = {"id": result.id, "key": result.key, "status": str(result.status),
            "created": result.created, "job_type": result.request.job_type}
    if not args.wait:
        return emit(args, made, lambda: print(
            f"request {result.id} key={result.key} status={result.status} ({outcome})"))
    print(f"request {result.id} key={result.key} ({outcome}); following it", file=sys.stderr)
    if db is None:
        db = shared_database(Settings.from_env().database_url)
    requests = RequestStore(db)
    states, timed_out = follow(
        [request_progress(requests, DlqStore(db), result.id)], timeout=args.timeout
    )
    code = exit_code(states, timed_out, args.timeout)
    final = states[0]
    request = requests.get(result.id)  # nosec B113: the request store, not HTTP
    if request is not None:
        made["status"] = str(request.status)
    data = {**made, "state": final.state, "ok": final.ok, "timed_out": timed_out,
            "attempts": final.attempts, "run_id": final.run_id, "detail": final.detail,
            "request": None if request is None else request_json(request)}
    written = emit(args, data, lambda: print(
        f"request {result.id} key={result.key} {final.state}"
        + (f" run {final.run_id}" if final.run_id else "")))
    return written or code


def _priority(value: str) -> int | str:
    """An integer as an int; anything else as given, for the boundary to refuse and keep."""
    try:
        return int(value)
    except ValueError:
        return value


def _one_line(exc: BaseException | str) -> str:
    return " ".join(str(exc).split()).encode("utf-8", "backslashreplace").decode("utf-8")
