"""``sekali requests list | show | cancel``: the job requests producers sent, and what became
of them.

- ``list [--status S] [--job-type T] [--limit N] [--json] [--out PATH]`` (also ``sekali
  requests`` alone): newest first (50 by default): what happened (``state``: the status, or
  ``dead_lettered`` / ``superseded`` for a failed request), job type, key, attempts, last
  change, run id, last error. Runs launched from the Launchpad have their record too
  (``source: launchpad``).
- ``show ID|KEY [--json] [--out PATH]``: one request with every field its record has (payload
  as JSON, personal fields masked), its attempts (time, number from 1 as the request's
  ``attempts`` counts them, outcome, error, run), the Dagster runs
  that served it, its outcome, the cancel (who, why, when, what it did), and the dead letters
  that keep it.
- ``cancel ID|KEY... --reason TEXT [--by WHO] [--json]``: cancel requests
  (:func:`engine.requests.cancel_requests`): one line per request, ``cancelled`` (it never
  runs), ``requested`` (running: it stops at its next cancel point) or ``refused`` with why.

Reads only through the owner stores (:class:`~engine.requests.RequestStore`,
:class:`~engine.attempts.AttemptRecorder`, the DLQ store). Times are ISO-8601 in the local
zone. Exit codes: 0 shown (every cancel cancelled or requested), 1 a cancel was refused or
not possible yet, 2 bad usage or no such request (one line on stderr).
"""

from __future__ import annotations

import argparse
import getpass
import socket
import sys
from typing import Any

from rich import box
from rich.table import Table

from cli.commands.arguments import app_database, count
from cli.commands.output import (
    add_output_arguments,
    console,
    emit,
    payload_text,
    printable,
    when,
)
from engine.attempts import AttemptRecorder
from engine.privacy import mask_text, request_view
from engine.requests import (
    JobRequest,
    RequestStatus,
    RequestStore,
    cancel_requests,
    cancel_view,
    state_of,
)
from resources.dlq import UNRESOLVED, DlqStore
from resources.errors import CancelUnavailable
from resources.telemetry.redact import redact

_ATTEMPT_FIELDS = ("started_at", "attempt", "outcome", "error_class", "error_reason", "run_id",
                   "step", "duration_seconds", "host", "pid")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("requests", help="job requests and what became of them; without a"
                            " subcommand, the newest 50 (as `requests list`)")
    actions = parser.add_subparsers(dest="requests_command")
    parser.set_defaults(func=_list, status=None, job_type=None, limit=50, url=None, json=False,
                        out=None)

    p_list = actions.add_parser("list", help="requests, newest first")
    p_list.add_argument("--status", action="append", choices=[str(s) for s in RequestStatus],
                        help="only this status (repeatable)")
    p_list.add_argument("--job-type", dest="job_type")
    p_list.add_argument("--limit", type=count, default=50, help="at most this many (50)")
    p_list.add_argument("--url", help="app database URL (default: DATABASE_URL or embedded)")
    add_output_arguments(p_list)
    p_list.set_defaults(func=_list)

    p_show = actions.add_parser("show", help="one request in full: fields, attempts, runs")
    p_show.add_argument("ref", metavar="ID|KEY", help="the request id or its idempotency key")
    p_show.add_argument("--url", help="app database URL (default: DATABASE_URL or embedded)")
    add_output_arguments(p_show)
    p_show.set_defaults(func=_show)

    p_cancel = actions.add_parser(
        "cancel", help="cancel requests: queued ones never run, running ones stop at their next"
        " cancel point, completed ones are refused")
    p_cancel.add_argument("refs", nargs="+", metavar="ID|KEY", help="request ids or keys")
    p_cancel.add_argument("--reason", required=True, help="why (kept on the request)")
    p_cancel.add_argument("--by", default=None,
                          help="who cancels (kept on the request; default user@host)")
    p_cancel.add_argument("--url", help="app database URL (default: DATABASE_URL or embedded)")
    add_output_arguments(p_cancel)
    p_cancel.set_defaults(func=_cancel)


def request_json(request: JobRequest) -> dict[str, Any]:
    """A request as the CLI prints it in JSON: every record field, masked, times in ISO-8601
    (``claim_rank`` too: it is the virtual arrival time the intake claims by)."""
    return {k: when(v) if (k.endswith("_at") or k == "claim_rank")
            and isinstance(v, (int, float)) else v
            for k, v in request_view(request).items()}


def _list(args: argparse.Namespace) -> int:
    store = RequestStore(app_database(args))
    found = store.find(status=args.status, job_type=args.job_type, limit=args.limit)
    states = store.states(found)
    views = [{**request_json(r), "state": states[r.id]} for r in found]

    def human() -> None:
        if not views:
            print("no requests match")
            return
        table = Table(box=box.SIMPLE_HEAD)
        for name in ("id", "state", "job type", "key", "tries", "updated", "run"):
            table.add_column(name, justify="right" if name in ("id", "tries") else "left",
                             overflow="fold")
        table.add_column("last error", ratio=1, overflow="ellipsis")
        for v in views:
            table.add_row(str(v["id"]), v["state"], printable(v["job_type"]), printable(v["key"]),
                          str(v["attempts"]), v["updated_at"], v["run_id"] or "",
                          printable(" ".join((v["last_error"] or "").split())))
        console().print(table)

    return emit(args, views, human)


def _find(store: RequestStore, ref: str) -> JobRequest | None:
    if ref.isdigit() and len(ref) <= 19:
        found = store.get(int(ref))
        if found is not None:
            return found
    return store.get_by_key(ref)


def _show(args: argparse.Namespace) -> int:
    db = app_database(args)
    request = _find(RequestStore(db), args.ref)
    if request is None:
        shown = args.ref if len(args.ref) <= 60 else args.ref[:60] + "..."
        print(f"error: no request with id or key {shown!r}; see `sekali requests list`",
              file=sys.stderr)
        return 2
    attempts: list[dict[str, Any]] = [
        {k: (when(a[k]) if k == "started_at" else a[k]) for k in _ATTEMPT_FIELDS}
        for a in AttemptRecorder(db).for_key(request.key)
    ]
    for a in attempts:
        a["attempt"] = int(a["attempt"]) + 1  # stored from 0 (Dagster's retry number)
    for a in attempts:
        if a["error_reason"]:
            a["error_reason"] = mask_text(a["error_reason"], request.job_type, request.payload)
    runs = list(dict.fromkeys(
        [a["run_id"] for a in attempts if a["run_id"]] + ([request.run_id] if request.run_id
                                                         else [])))
    letters = [{"id": r.id, "status": str(r.status), "error_class": r.error_class,
                "last_failed_at": when(r.last_failed_at),
                "last_error": redact(" ".join((r.last_error or "").split())[:200])}
               for r in DlqStore(db).list_records(request_id=request.id)]
    data = {
        "request": request_json(request),
        "outcome": _outcome(request, attempts, letters),
        "runs": runs,
        "attempts": attempts,
        "dead_letters": letters,
    }
    return emit(args, data, lambda: _print_show(data))


def _outcome(request: JobRequest, attempts: list[dict[str, Any]],
             letters: list[dict[str, Any]]) -> str:
    """The request's end in one word (:func:`engine.requests.state_of`), followed by the last
    attempt's outcome."""
    status = state_of(request, dead_lettered=any(
        d["status"] in UNRESOLVED for d in letters))
    last = attempts[-1]["outcome"] if attempts else None
    return f"{status} (last attempt: {last})" if last else status


def _cancel(args: argparse.Namespace) -> int:
    if not args.reason.strip():
        print("error: --reason: a cancel needs a reason", file=sys.stderr)
        return 2
    by = args.by or f"{getpass.getuser()}@{socket.gethostname()} (cli)"
    try:
        decided = cancel_requests(RequestStore(app_database(args)), args.refs, by=by,
                                  reason=args.reason)
    except CancelUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    views = [cancel_view(ref, d) for ref, d in zip(args.refs, decided, strict=True)]

    def human() -> None:
        for v in views:
            if v["cancel"] == "unknown":
                print(printable(f"error: no request with id or key {v['ref']!r}; see `sekali"
                                " requests list`"), file=sys.stderr)
            else:
                print(printable(f"{v['ref']}: {v['cancel']}: {v['detail']}"))

    code = emit(args, views, human)
    if code:
        return code
    if any(v["cancel"] == "unknown" for v in views):
        return 2
    return 1 if any(v["cancel"] == "refused" for v in views) else 0


def _print_show(data: dict[str, Any]) -> None:
    out = console()
    grid = Table.grid(padding=(0, 2))
    grid.add_column(justify="right", style="bold")
    grid.add_column(overflow="fold")
    for name, value in data["request"].items():
        if name == "payload" or isinstance(value, (dict, list)):
            value = payload_text(value)
        grid.add_row(name, "" if value is None else printable(str(value)))
    grid.add_row("outcome", printable(data["outcome"]))
    grid.add_row("runs", ", ".join(data["runs"]) or "(none yet)")
    out.print(grid)
    if data["attempts"]:
        table = Table(title="attempts", box=box.SIMPLE_HEAD, title_justify="left")
        for name in ("started", "#", "outcome", "class", "run", "seconds"):
            table.add_column(name, overflow="fold")
        table.add_column("error", ratio=1, overflow="fold")
        for a in data["attempts"]:
            seconds = a["duration_seconds"]
            table.add_row(a["started_at"], str(a["attempt"]), a["outcome"],
                          printable(a["error_class"] or ""),
                          a["run_id"] or "", "" if seconds is None else f"{seconds:.3f}",
                          printable(a["error_reason"] or ""))
        out.print(table)
    else:
        out.print("attempts: none yet")
    for d in data["dead_letters"]:
        out.print(printable(
            f"dead letter {d['id']} ({d['status']}, {d['error_class']}, last failed "
            f"{d['last_failed_at']}): {d['last_error']}  -> sekali dlq show {d['id']}"))
