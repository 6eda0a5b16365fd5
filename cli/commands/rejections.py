"""``sekali rejections list | show``: the requests the validation boundary refused.

- ``list [--job-type T] [--source S] [--limit N] [--json]``: newest first (50 by default), with
  the way in (enqueue, cli, run_config, dlq_replay, micro_batch, fan_out), the field and the
  error.
- ``show ID [--json]``: one rejection in full: the excerpt of the payload as stored (at most
  ``InputLimits.excerpt_bytes``), the size and sha256 of the whole payload, the key.

``--json`` prints only JSON on stdout, ``--out PATH`` writes it to a file; times are ISO-8601
in the local zone. Exit codes: 0 shown, 2 bad
usage or no such rejection (one line on stderr).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from typing import Any

from rich import box
from rich.table import Table

from cli.commands.arguments import app_database, count, record_id
from cli.commands.output import add_output_arguments, console, emit, printable, when
from engine.requests import RequestStore


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("rejections", help="see the requests the intake refused")
    rejections_sub = parser.add_subparsers(dest="rejections_command", required=True)

    p_list = rejections_sub.add_parser("list", help="refused requests, newest first")
    p_list.add_argument("--job-type", dest="job_type")
    p_list.add_argument("--source", help="the way in: enqueue, cli, run_config, dlq_replay, ...")
    p_list.add_argument("--limit", type=count, default=50, help="at most this many (50)")
    add_output_arguments(p_list)
    p_list.add_argument("--url", help="app database URL (default: DATABASE_URL or embedded)")
    p_list.set_defaults(func=_list)

    p_show = rejections_sub.add_parser("show", help="one refused request in full")
    p_show.add_argument("id", type=record_id)
    add_output_arguments(p_show)
    p_show.add_argument("--url", help="app database URL (default: DATABASE_URL or embedded)")
    p_show.set_defaults(func=_show)


def _store(args: argparse.Namespace) -> RequestStore:
    return RequestStore(app_database(args))


def _view(row: dict[str, Any]) -> dict[str, Any]:
    """A rejection as the CLI shows it: ``created_at`` in ISO-8601 (local zone)."""
    return {**row, "created_at": when(float(row["created_at"]))}


def _list(args: argparse.Namespace) -> int:
    rows = _store(args).rejections(
        args.job_type, source=args.source, limit=args.limit, newest_first=True
    )
    views = [_view(r) for r in rows]
    return emit(args, [_summary(v) for v in views], lambda: _print_list(views))


def _print_list(views: list[dict[str, Any]]) -> None:
    if not views:
        print("no rejections match")
        return
    table = Table(box=box.SIMPLE_HEAD)
    for name in ("id", "at", "source", "job type", "field", "size"):
        table.add_column(name, no_wrap=True, justify="right" if name in ("id", "size") else "left")
    table.add_column("error", ratio=1)
    for v in views:
        table.add_row(
            str(v["id"]), v["created_at"], printable(v["source"] or ""),
            printable(v["job_type"]), printable(v["field"]),
            "" if v["payload_size"] is None else str(v["payload_size"]),
            printable(textwrap.shorten(v["error"], 200, placeholder=" ...")),
        )
    console().print(table)


def _summary(view: dict[str, Any]) -> dict[str, Any]:
    return {k: view[k] for k in ("id", "created_at", "source", "job_type", "key", "field",
                                 "error", "payload_size", "payload_sha256")}


def _show(args: argparse.Namespace) -> int:
    row = _store(args).rejection(args.id)
    if row is None:
        print(f"error: no rejection {args.id}; see `sekali rejections list`", file=sys.stderr)
        return 2
    view = _view(row)
    return emit(args, view, lambda: _print_show(view))


def _print_show(view: dict[str, Any]) -> None:
    table = Table.grid(padding=(0, 2))
    table.add_column(justify="right", style="bold")
    table.add_column()
    for name in ("id", "created_at", "source", "job_type", "key", "field", "error",
                 "payload_size", "payload_sha256", "payload"):
        value = view[name]
        table.add_row(name, "" if value is None else printable(str(value)))
    console().print(table)
