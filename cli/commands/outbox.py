"""``sekali outbox dead | replay | discard``: the outbox's dead letters from the command line.

An outbox event whose publication failed ``max_failures`` times in a row (5) is dead-lettered
(:mod:`resources.outbox.dead_letters`); later events of its own aggregate wait behind it, events
of other aggregates do not.

- ``dead [--status open|replayed|discarded|all] [--after ID] [--limit N] [--json]``: dead
  letters, oldest first (open ones by default, 50 at most; ``--after`` pages on).
- ``replay ID ... [--json]``: put open dead letters back for publication (first of their
  aggregate again, failure count at zero).
- ``discard ID ... --reason R [--json]``: give up on open dead letters: their outbox rows go,
  the dead letters keep the events, and the later events of their aggregates go on.

``--json`` prints only JSON on stdout; times are ISO-8601 in the local zone. Exit codes: 0
done, 1 nothing changed (no id was an open dead letter), 2 bad usage (one line on stderr).
"""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

from rich import box
from rich.table import Table

from cli.commands.arguments import actor, app_database, count, record_id
from cli.commands.output import add_output_arguments, console, emit, payload_text, printable, when
from resources.outbox import DeadLetterStatus, OutboxDeadLetters
from resources.telemetry.redact import redact


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("outbox", help="dead outbox events: show, replay, discard")
    outbox_sub = parser.add_subparsers(dest="outbox_command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        add_output_arguments(p)
        p.add_argument("--url", help="app database URL (default: DATABASE_URL or embedded)")

    p_dead = outbox_sub.add_parser("dead", help="dead-lettered outbox events, oldest first")
    p_dead.add_argument(
        "--status", default="open", choices=[*(str(s) for s in DeadLetterStatus), "all"]
    )
    p_dead.add_argument("--after", type=int, default=0, help="only ids above this (paging)")
    p_dead.add_argument("--limit", type=count, default=50, help="at most this many (50)")
    common(p_dead)
    p_dead.set_defaults(func=_dead)

    p_replay = outbox_sub.add_parser("replay", help="publish dead events again")
    p_replay.add_argument("ids", nargs="+", type=record_id)
    common(p_replay)
    p_replay.set_defaults(func=_replay)

    p_discard = outbox_sub.add_parser("discard", help="give up on dead events (kept)")
    p_discard.add_argument("ids", nargs="+", type=record_id)
    p_discard.add_argument("--reason", required=True)
    common(p_discard)
    p_discard.set_defaults(func=_discard)


def _store(args: argparse.Namespace) -> OutboxDeadLetters:
    return OutboxDeadLetters(app_database(args))




def _view(data: dict[str, Any]) -> dict[str, Any]:
    return {
        **data,
        "last_error": redact(data["last_error"] or ""),
        "created_at": when(data["created_at"]),
        "updated_at": when(data["updated_at"]),
    }


def _dead(args: argparse.Namespace) -> int:
    status = None if args.status == "all" else DeadLetterStatus(args.status)
    views = [
        _view(d.view())
        for d in _store(args).page(status, after_id=args.after, limit=args.limit)
    ]
    return emit(args, views, lambda: _print(views))


def _print(views: list[dict[str, Any]]) -> None:
    if not views:
        print("no dead outbox events match")
        return
    table = Table(box=box.SIMPLE_HEAD)
    for name in ("id", "status", "event", "aggregate", "type", "failures", "since"):
        table.add_column(name, no_wrap=True)
    table.add_column("last error", ratio=1)
    for v in views:
        table.add_row(
            str(v["id"]), v["status"], printable(v["event_id"]),
            printable(f"{v['aggregate_type']}:{v['aggregate_id']}"), printable(v["event_type"]),
            f"{v['failures']} (x{v['deaths']})", v["created_at"],
            printable(textwrap.shorten(v["last_error"], 160, placeholder=" ...")),
        )
    console().print(table)
    print(f"payload of the first: {textwrap.shorten(payload_text(views[0]['payload']), 200)}")


def _replay(args: argparse.Namespace) -> int:
    done = _store(args).replay(args.ids, actor=actor())
    return _report(args, "replayed", done)


def _discard(args: argparse.Namespace) -> int:
    done = _store(args).discard(args.ids, actor=actor(), reason=args.reason)
    return _report(args, "discarded", done)


def _report(args: argparse.Namespace, what: str, done: list[int]) -> int:
    skipped = [i for i in args.ids if i not in done]
    data = {what: done, "not_open": skipped}
    code = emit(
        args,
        data,
        lambda: print(
            f"{what}: {', '.join(map(str, done)) or 'none'}"
            + (f"; not open dead letters: {', '.join(map(str, skipped))}" if skipped else "")
        ),
    )
    return code or (0 if done else 1)
