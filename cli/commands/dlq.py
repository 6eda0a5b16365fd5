"""``sekali dlq list | show | replay | discard``: the dead letter queue from the command line.

- ``list [--status S] [--job-type T] [--class C] [--fingerprint F] [--older-than 2h]
  [--newer-than 1d] [--json]``: unresolved records by default (open, replay_requested,
  replaying); ``--status all`` for every record.
- ``show ID [--trace] [--json]``: one record: its failure in one line (class, error type and
  message), its fields, failed runs and audit trail; the stack trace only for class
  ``unknown`` (a bug) or with ``--trace`` (``--json`` always carries it).
- ``replay [ID ...] [filters] [--limit N] [--pace 10/s] [--dry-run]``: ask for a replay of the
  selected open records (at most N, oldest first, at most the pace); the ``dlq_replay_sensor``
  launches them at its rate bound. Each selected record's idempotency key is reset from failed
  to retryable, and only those; a skipped record gets an audit line saying why. Without ids a
  filter is required. ``--dry-run`` changes nothing and says what would be replayed. ``--wait``
  then follows each replayed record to its end (:mod:`cli.commands.follow`; exit 1 when one
  is dead-lettered again or ``--timeout`` passes first); ``--json`` prints the decisions (and
  final states). Each record is listed with its verdict and evidence (``completed``: its key
  completed, a replay returns the stored result; ``effect_found``: the job type's lookup finds
  the effect at the downstream; ``unknown``: it cannot be asked or does not answer; ``safe``).
  A real replay refuses ``effect_found`` and ``unknown`` records unless ``--allow-repeat
  ID[,ID...]`` names them (exit 1 naming the refused ids; the others still replay).
  ``--canary N [--canary-timeout S]`` (:mod:`engine.canary`) replays N records first, follows
  them to their end (progress on stderr) and requests the rest only if every canary resolved;
  one that fails again, or has not ended after S seconds (600), leaves the rest open and exits
  1. Each record's ``outcome`` (``canary resolved``, ``canary failed again``, ``not replayed:
  canary failed``, ...) is printed and in ``--json``; a dry run names the would-be canaries.
- ``replay ID --patch JSON|@file [--dry-run] [--wait]``: amended replay (``pipelines/replay.py``):
  a new version of the request under ``key#vN`` with the patched payload, the record closed as
  superseded (``--wait`` follows the new request like ``sekali enqueue --wait``); refused
  (exit 1, saying why) when the key's effect may have happened.
- ``discard ID ... --reason R``: give up on records (kept, marked discarded, audited).

Times are ISO-8601 in the local zone, payloads JSON; ``--out PATH`` writes the JSON to a file.

Exit codes: 0 done, 1 nothing matched / nothing changed, 2 bad arguments or unknown record
(one line on stderr; ids are whole numbers from 1 to 2**63 - 1).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import time
from typing import Any

from rich import box
from rich.table import Table

from cli.commands.arguments import actor, age, app_database, count, id_list, pace, record_id
from cli.commands.follow import (
    add_wait_arguments,
    exit_code,
    follow,
    record_progress,
    request_progress,
    seconds,
)
from cli.commands.output import (
    add_output_arguments,
    console,
    emit,
    err_console,
    payload_text,
    printable,
    when,
)
from engine import canary as canaries
from engine.privacy import dlq_view
from engine.registry import MODULES_ENV
from engine.replay import (
    AmendRefused,
    BulkReplay,
    Selection,
    amend,
    amended_outcomes,
    bulk_replay,
    lookup_client,
)
from engine.requests import RequestStore
from resources.dlq import DlqRecordNotFound, DlqStore, FailureClass, failure_line
from resources.errors import ValidationError
from resources.telemetry.redact import redact_data

UNRESOLVED = ["open", "replay_requested", "replaying"]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("dlq", help="inspect, replay and discard dead letters")
    dlq_sub = parser.add_subparsers(dest="dlq_command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--url", help="app database URL (default: DATABASE_URL or embedded)")

    def filters(p: argparse.ArgumentParser) -> None:
        p.add_argument("--job-type", dest="job_type")
        p.add_argument(
            "--class", dest="error_class",
            choices=[str(c) for c in FailureClass],
        )
        p.add_argument("--fingerprint")
        p.add_argument("--older-than", dest="older_than", type=age,
                       help="last failure at least this old (90s, 15m, 2h, 3d, 1w)")
        p.add_argument("--newer-than", dest="newer_than", type=age,
                       help="last failure at most this old")

    p_list = dlq_sub.add_parser("list", help="list dead letters")
    filters(p_list)
    common(p_list)
    p_list.add_argument(
        "--status", action="append", help="status to show (repeatable); 'all' for every status"
    )
    add_output_arguments(p_list)
    p_list.set_defaults(func=_list)

    p_show = dlq_sub.add_parser("show", help="one dead letter in full")
    p_show.add_argument("id", type=record_id)
    p_show.add_argument(
        "--trace", action="store_true", help="print the stack trace of a classified failure too"
        " (always printed for class unknown; --json always carries it)",
    )
    add_output_arguments(p_show)
    common(p_show)
    p_show.set_defaults(func=_show)

    p_replay = dlq_sub.add_parser("replay", help="request replays (the replay sensor runs them)")
    p_replay.add_argument("ids", type=record_id, nargs="*")
    filters(p_replay)
    common(p_replay)
    p_replay.add_argument("--dry-run", action="store_true", dest="dry_run")
    p_replay.add_argument("--actor", default=None)
    p_replay.add_argument("--reason", default="")
    p_replay.add_argument(
        "--patch", help="amend: a JSON merge patch (or @file) for one record's payload; makes"
        " a new version of the request (key#vN) and closes the record as superseded",
    )
    p_replay.add_argument("--limit", type=int, help="at most this many records (oldest first)")
    p_replay.add_argument("--pace", type=pace,
                          help="at most this rate of replay requests, e.g. 10/s or 600/min")
    p_replay.add_argument(
        "--allow-repeat", type=id_list, action="extend", default=[], dest="allow_repeat",
        metavar="ID[,ID...]", help="replay these records even though their effect was found"
        " at the downstream or cannot be ruled out",
    )
    p_replay.add_argument(
        "--canary", type=count, metavar="N", help="replay N records first, follow them to their"
        " end, and replay the rest only if all of them resolved (exit 1 when one fails again"
        " or has not ended by --canary-timeout: the rest stay open)",
    )
    p_replay.add_argument(
        "--canary-timeout", type=seconds, dest="canary_timeout", metavar="SECONDS",
        help=f"with --canary: how long the canaries may take to end; one that has not ended by"
        f" then stops the rest too ({canaries.DEFAULT_TIMEOUT:g})",
    )
    add_output_arguments(p_replay)
    add_wait_arguments(p_replay)
    p_replay.set_defaults(func=_replay)

    p_discard = dlq_sub.add_parser("discard", help="give up on dead letters (kept, audited)")
    p_discard.add_argument("ids", type=record_id, nargs="+")
    p_discard.add_argument("--reason", required=True)
    p_discard.add_argument("--actor", default=None)
    add_output_arguments(p_discard)
    common(p_discard)
    p_discard.set_defaults(func=_discard)


def _store(args: argparse.Namespace) -> Any:
    return DlqStore(app_database(args))


def _selection(args: argparse.Namespace) -> Selection:
    """The filters of ``list`` and ``replay`` (``--limit`` only where the command has it)."""
    return Selection(
        job_type=args.job_type,
        error_class=args.error_class,
        fingerprint=args.fingerprint,
        older_than=args.older_than,
        newer_than=args.newer_than,
        ids=getattr(args, "ids", None) or None,
        limit=getattr(args, "limit", None),
    )


def error_text(record: Any, view: dict[str, Any]) -> str:
    """The record's error once, in one line (:func:`resources.dlq.failure_line`), from the
    masked view's message."""
    return failure_line(record.error_type, view["last_error"])


def _list(args: argparse.Namespace) -> int:
    statuses = None if args.status and "all" in args.status else (args.status or UNRESOLVED)
    try:
        records = _selection(args).records(_store(args), statuses)
    except ValueError as exc:
        print(printable(f"error: {exc}"), file=sys.stderr)
        return 2
    outcomes = amended_outcomes(_store(args).db, records)
    views = [{**dlq_view(r, summary=True), **_outcome(outcomes, r.id)} for r in records]

    def human() -> None:
        if not records:
            print("no dead letters match")
            return
        table = Table(box=box.SIMPLE_HEAD)
        for name in ("id", "status", "job type", "class", "fingerprint", "fails", "replays",
                     "last failure"):
            table.add_column(name, justify="right" if name in ("id", "fails", "replays")
                             else "left", overflow="fold")
        table.add_column("error", ratio=1, min_width=30)  # wraps between words, never cut
        for r in records:
            table.add_row(
                str(r.id), "superseded" if r.id in outcomes else str(r.status),
                printable(r.job_type), printable(r.error_class), printable(r.fingerprint),
                str(r.failure_count), str(r.replay_count), when(r.last_failed_at),
                printable(outcomes.get(r.id) or textwrap.shorten(
                    error_text(r, dlq_view(r, summary=True)), 300, placeholder=" ...")),
            )
        console().print(table)
        missing = _missing_ids([r.id for r in records])
        if missing:
            print(f"ids not listed ({missing}): {ID_GAPS}")

    return emit(args, views, human)


ID_GAPS = (
    "records resolved or discarded (`--status all` lists them) or purged after their retention;"
    " an id is also spent by a failure two processes recorded at once, as database sequences do"
)
"""Why the ids ``dlq list`` shows have gaps (said under the table when they do)."""


def _missing_ids(ids: list[int], most: int = 8) -> str:
    """The ids below the highest one shown that are not shown, as ranges (``1, 4-6``; at most
    ``most`` ranges, then how many more)."""
    runs: list[str] = []
    previous = 0
    for n in sorted(set(ids)):
        if n > previous + 1:
            runs.append(str(previous + 1) if n == previous + 2 else f"{previous + 1}-{n - 1}")
        previous = n
    if len(runs) > most:
        runs = [*runs[:most], f"{len(runs) - most} more ranges"]
    return ", ".join(runs)


def _outcome(outcomes: dict[int, str], record_id: int) -> dict[str, str]:
    """``{"outcome": ...}`` for a record an amendment closed (what its newest version did)."""
    return {"outcome": outcomes[record_id]} if record_id in outcomes else {}


def _show(args: argparse.Namespace) -> int:
    store = _store(args)
    try:
        record = store.get(args.id)
    except DlqRecordNotFound as exc:
        print(printable(f"error: {exc}"), file=sys.stderr)
        return 2
    data = {
        **dlq_view(record),  # personal fields and e-mail addresses masked
        **_outcome(amended_outcomes(store.db, [record]), record.id),
        "dedupe_window": RequestStore(store.db).dedupe_of(
            record.request_id, record.idempotency_key
        ),
        "failed_runs": store.failures(record.id),
        "audit": redact_data(store.audit(record.id)),
    }

    def human() -> None:
        out = console()
        out.print(printable(f"dead letter {record.id} ({record.status}): {record.error_class}:"
                            f" {error_text(record, data)}"))
        grid = Table.grid(padding=(0, 2))
        grid.add_column(justify="right", style="bold")
        grid.add_column(overflow="fold")
        for name, value in data.items():
            if name in ("trace", "audit", "last_error"):
                continue
            if name.endswith("_at") and isinstance(value, (int, float)):
                value = when(value)
            elif isinstance(value, (dict, list)):
                value = payload_text(value)
            grid.add_row(name, "" if value is None else printable(str(value)))
        out.print(grid)
        out.print("audit:")
        for entry in data["audit"]:
            moved = (
                f"{entry['from_status'] or '-'} -> {entry['to_status'] or '-'} "
                if entry["from_status"] or entry["to_status"] else ""
            )
            out.print(printable(
                f"  {when(entry['at'])}  {entry['actor']}: {entry['action']} "
                f"{moved}{entry['detail'] or ''}"
            ))
        if args.trace or record.error_class == "unknown":
            out.print("trace:")
            out.print(printable(data["trace"] or "(none)"))
        elif data["trace"]:
            out.print(f"trace: not shown for a classified failure (sekali dlq show {record.id}"
                      " --trace)")

    return emit(args, data, human)


def _replay(args: argparse.Namespace) -> int:
    if args.canary_timeout is not None and args.canary is None:
        print("error: --canary-timeout needs --canary N", file=sys.stderr)
        return 2
    if args.patch is not None:
        return _amend(args)
    if args.canary is not None:
        return _canary_replay(args)
    store = _store(args)
    try:
        result = bulk_replay(store, _selection(args), **_replay_options(args))
    except (ValidationError, ValueError) as exc:
        print(printable(f"error: {exc}"), file=sys.stderr)
        return 2
    if _missing(args, result):
        return 2
    say = sys.stderr if args.json else sys.stdout
    for d in result.decisions:
        verb = (("would replay" if d.replay else "would not replay") if args.dry_run
                else ("replay requested" if d.replay else "skipped"))
        reset = " (key reset)" if d.key_reset else ""
        judged = result.assessments[d.record.id]
        print(printable(
            f"{d.record.id:>5}  {verb}: {d.record.job_type} key={d.record.idempotency_key} "
            f"{'' if d.replay else d.reason}{reset}"), file=say
        )
        if (d.replay or args.dry_run) and d.record.id not in result.unregistered:
            print(printable(f"       {judged.verdict}: {judged.evidence}"), file=say)
    print(
        f"{result.chosen} of {len(result.decisions)} selected records "
        f"{'would be replayed (dry run)' if args.dry_run else 'requested for replay'}", file=say
    )
    _say_refused(result)
    data: dict[str, Any] = {"decisions": [
        {"id": d.record.id, "replay": d.replay, "reason": d.reason, "key_reset": d.key_reset,
         **result.assessments[d.record.id].as_dict()}
        for d in result.decisions], "refused": result.refused,
        "unregistered": result.unregistered, "fails_again": result.fails_again}
    code = 1 if result.refused or not result.chosen else 0
    code = 2 if result.unregistered else code
    if not (args.wait and result.chosen and not args.dry_run):
        return _finish(args, data, [], code)
    requests = RequestStore(store.db)
    return _finish(args, data, [record_progress(store, requests, d.record.id)
                                for d in result.decisions if d.replay]) or code


def _missing(args: argparse.Namespace, replay: BulkReplay) -> bool:
    """Whether ``--ids`` named records the store does not hold (said on stderr)."""
    missing = set(args.ids) - {d.record.id for d in replay.decisions}
    if missing:
        print(f"error: no DLQ record {sorted(missing)}", file=sys.stderr)
    return bool(missing)


def _say_refused(replay: BulkReplay) -> None:
    """One line each on stderr: the records refused by the guard, the ones whose job type
    this process does not know (exit 2), the ones certain to fail again."""
    if replay.refused:
        then = f"replay with --allow-repeat {','.join(map(str, replay.refused))}"
        print(replay.refused_line(then), file=sys.stderr)
    if replay.unregistered:
        print(f"error: not replayed {replay.unregistered}: their job types are not registered in"
              f" this process; set {MODULES_ENV} as the code location has it (`sekali dev`'s"
              f" shell), then replay again", file=sys.stderr)
    if replay.fails_again:
        print(f"warning: {replay.fails_again} will fail again the same way: their last failure"
              " was permanent and a replay runs the same payload; fix the cause first, or amend"
              " the payload (--patch)", file=sys.stderr)


def _replay_options(args: argparse.Namespace) -> dict[str, Any]:
    """What a replay of the selection takes from the command line, canaries or not."""
    return {"actor": actor(args), "reason": args.reason, "dry_run": args.dry_run,
            "pace": args.pace, "client": lookup_client(on_worker=False),
            "allow_repeat": args.allow_repeat}


def _canary_replay(args: argparse.Namespace) -> int:
    """``--canary``: the canaries first, followed to their end, then the rest (or not)."""
    store = _store(args)
    say = sys.stderr if args.json else sys.stdout
    progress = err_console()
    try:
        result = canaries.canary_replay(
            store,
            _selection(args),
            canary=args.canary,
            canary_timeout=args.canary_timeout or canaries.DEFAULT_TIMEOUT,
            **_replay_options(args),
            on_change=lambda now: progress.print(f"{when(time.time())}  {now.line()}"),
        )
    except (ValidationError, ValueError) as exc:
        print(printable(f"error: {exc}"), file=sys.stderr)
        return 2
    replay = result.replay
    if _missing(args, replay):
        return 2
    for d in replay.decisions:
        judged = replay.assessments.get(d.record.id)
        print(printable(f"{d.record.id:>5}  {result.outcomes[d.record.id]}: "
                        f"{d.record.job_type} key={d.record.idempotency_key}"), file=say)
        if (judged is not None and (d.replay or args.dry_run)
                and d.record.id not in replay.unregistered):
            print(printable(f"       {judged.verdict}: {judged.evidence}"), file=say)
    print(f"canaries: {result.canaries}", file=say)
    if result.stopped:
        print(f"stopped: {result.stopped}; not replayed: {result.held} (still open: fix the"
              " cause, then replay them)", file=sys.stderr)
    _say_refused(replay)
    data: dict[str, Any] = {
        "decisions": [
            {"id": d.record.id, "replay": d.replay, "reason": d.reason,
             "key_reset": d.key_reset, "outcome": result.outcomes[d.record.id],
             **(replay.assessments[d.record.id].as_dict()
                if d.record.id in replay.assessments else {})}
            for d in replay.decisions],
        "refused": replay.refused,
        "unregistered": replay.unregistered,
        "fails_again": replay.fails_again,
        "canary": result.as_dict(),
    }
    code = 1 if result.stopped or replay.refused or not replay.chosen else 0
    code = 2 if replay.unregistered else code
    rest = [d.record.id for d in replay.decisions
            if d.replay and d.record.id not in result.canaries]
    if not (args.wait and rest and not args.dry_run):
        return _finish(args, data, [], code)
    requests = RequestStore(store.db)
    return _finish(args, data, [record_progress(store, requests, i) for i in rest]) or code


def _amend(args: argparse.Namespace) -> int:
    if (len(args.ids) != 1 or args.limit is not None or args.pace is not None
            or args.canary is not None):
        print("error: --patch takes exactly one record id and no --limit/--pace/--canary",
              file=sys.stderr)
        return 2
    store = _store(args)
    try:
        done = amend(
            store, args.ids[0], args.patch, actor=actor(args), reason=args.reason,
            dry_run=args.dry_run,
        )
    except (ValidationError, DlqRecordNotFound) as exc:
        print(printable(f"error: {exc}"), file=sys.stderr)
        return 2
    except AmendRefused as exc:
        print(printable(f"refused: {exc}"), file=sys.stderr)
        return 1
    changes = ", ".join(f"{d['path']}: {d['from']!r} -> {d['to']!r}" for d in done.diff)
    print(printable(
        f"{'would make' if done.dry_run else 'made'} {done.key} (version {done.version}"
        f"{'' if done.request_id is None else f', request {done.request_id}'}) from record"
        f" {done.record_id}, superseding {done.previous_key}: {changes}"),
        file=sys.stderr if args.json else sys.stdout,
    )
    data: dict[str, Any] = {
        "key": done.key, "version": done.version, "request_id": done.request_id,
        "record_id": done.record_id, "previous_key": done.previous_key,
        "dry_run": done.dry_run, "diff": list(done.diff)}
    if not (args.wait and done.request_id is not None and not done.dry_run):
        return _finish(args, data, [], 0)
    return _finish(args, data, [request_progress(RequestStore(store.db), store, done.request_id)])


def _finish(args: argparse.Namespace, data: dict[str, Any], progress: list[Any],
            code: int = 0) -> int:
    """Follow ``progress`` to its end when there is any (``--wait``), adding the final states
    to ``data``; then print ``data`` as JSON when asked. Returns the exit code."""
    if progress:
        states, timed_out = follow(progress, timeout=args.timeout)
        code = exit_code(states, timed_out, args.timeout)
        data["final"] = [s.as_dict() for s in states]
        data["timed_out"] = timed_out
    if args.json or args.out:
        return emit(args, data, lambda: None) or code
    return code


def _discard(args: argparse.Namespace) -> int:
    store = _store(args)
    try:
        decisions = store.discard(args.ids, actor=actor(args), reason=args.reason)
    except (DlqRecordNotFound, ValueError) as exc:
        print(printable(f"error: {exc}"), file=sys.stderr)
        return 2
    say = sys.stderr if args.json else sys.stdout
    for d in decisions:
        print(printable(f"{d.record.id:>5}  {'discarded' if d.replay else 'skipped: ' + d.reason}"),
              file=say)
    code = 0 if any(d.replay for d in decisions) else 1
    if args.json or args.out:
        data = [{"id": d.record.id, "discarded": d.replay, "reason": d.reason}
                for d in decisions]
        return emit(args, data, lambda: None) or code
    return code
