"""``sekali tenants set | list``: fair share across tenants at intake (docs/flow.md).

- ``set NAME --weight W [--min M] [--max X]``: the tenant's weight (> 0), guaranteed minimum
  share and burst maximum share of each claim page (0..1; omitted: none). The next claim reads
  them: no restart. A bad value, or minimums adding up past 1, is exit 2 naming the field.
- ``list [--json]``: every tenant set or served, with its settings, the requests claimed for it
  so far and those waiting.

``--json`` prints only JSON on stdout; times are ISO-8601 in the local zone.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rich import box
from rich.table import Table

from cli.commands.arguments import app_database
from cli.commands.output import add_output_arguments, console, emit, when
from engine.requests import RequestStore
from engine.tenants import TenantStore
from resources.errors import ValidationError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("tenants", help="fair share across tenants: weights, min, max")
    tenants_sub = parser.add_subparsers(dest="tenants_command", required=True)

    p_set = tenants_sub.add_parser("set", help="set a tenant's weight, minimum and maximum share")
    p_set.add_argument("name")
    p_set.add_argument("--weight", type=float, required=True, help="relative weight, > 0")
    p_set.add_argument("--min", type=float, default=None, dest="min_share",
                       help="guaranteed share of each page while it has work, 0..1")
    p_set.add_argument("--max", type=float, default=None, dest="max_share",
                       help="most it may take of a page even when alone, 0..1")
    add_output_arguments(p_set)
    p_set.add_argument("--url", help="app database URL (default: DATABASE_URL or embedded)")
    p_set.set_defaults(func=_set)

    p_list = tenants_sub.add_parser("list", help="tenants, their settings and backlog")
    add_output_arguments(p_list)
    p_list.add_argument("--url", help="app database URL (default: DATABASE_URL or embedded)")
    p_list.set_defaults(func=_list)


def _view(setting: Any, waiting: int = 0) -> dict[str, Any]:
    return {
        "name": setting.name,
        "weight": setting.weight,
        "min_share": setting.min_share,
        "max_share": setting.max_share,
        "claimed": setting.claimed,
        "waiting": waiting,
        "set_at": when(setting.set_at) or None,
    }


def _set(args: argparse.Namespace) -> int:
    try:
        setting = TenantStore(app_database(args)).set(
            args.name, weight=args.weight, min_share=args.min_share, max_share=args.max_share
        )
    except ValidationError as exc:
        print(f"error: {exc.field}: {exc.problem}", file=sys.stderr)
        return 2
    view = _view(setting)
    return emit(args, view, lambda: console().print(
        f"tenant {setting.name}: weight {setting.weight:g}, min {setting.min_share or 0:g}, "
        f"max {1 if setting.max_share is None else setting.max_share:g} (next claim)"
    ))


def _list(args: argparse.Namespace) -> int:
    db = app_database(args)
    waiting = RequestStore(db).waiting_by_tenant()
    known = TenantStore(db).list()
    views = [_view(s, waiting.get(s.name, 0)) for s in known]
    seen = {s.name for s in known}
    views += [_view(TenantStore.default(name), n) for name, n in waiting.items()
              if name not in seen]
    views.sort(key=lambda v: v["name"])
    return emit(args, views, lambda: _print(views))


def _print(views: list[dict[str, Any]]) -> None:
    if not views:
        print("no tenants yet (every request is the default tenant's)")
        return
    table = Table(box=box.SIMPLE_HEAD)
    for name in ("tenant", "weight", "min", "max", "claimed", "waiting", "set at"):
        table.add_column(name, justify="left" if name in ("tenant", "set at") else "right")
    for v in views:
        table.add_row(
            v["name"], f"{v['weight']:g}",
            "" if v["min_share"] is None else f"{v['min_share']:g}",
            "" if v["max_share"] is None else f"{v['max_share']:g}",
            str(v["claimed"]), str(v["waiting"]), v["set_at"] or "",
        )
    console().print(table)
