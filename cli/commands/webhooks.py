"""``sekali webhooks secret rotate | list`` and ``sekali webhooks http``: the signing secrets of
webhook endpoints (:mod:`resources.webhook_secrets`; docs/webhooks.md "Secrets").

- ``secret rotate ENDPOINT [--overlap 24h]``: a new secret for the endpoint, printed once (hand
  it to the customer); the secrets active until now keep signing for ``--overlap`` (24 h by
  default), every message carrying one signature per active secret, then expire.
- ``secret list [ENDPOINT] [--reveal]``: an endpoint's secrets (its derived default when it was
  never rotated), or those of every endpoint that has stored ones: state, created, expires;
  masked (``whsec_abcd...``) unless ``--reveal``.
- ``http ENDPOINT --allow | --refuse``: whether the endpoint's URL may be plain http.

Reads the deployment's key as the workers do (``SEKALI_WEBHOOKS_SIGNING_KEY``, ``..._FILE``, or
the state folder's). ``--json`` prints only JSON on stdout; times are ISO-8601. Exit codes: 0
done, 2 bad usage or input (one line naming the field).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rich import box
from rich.table import Table

from cli.commands.arguments import actor, age, app_database
from cli.commands.output import add_output_arguments, console, emit, printable, when
from pipelines.jobs.webhook import signing_key
from resources.errors import SekaliError
from resources.webhook_secrets import WebhookSecrets

DEFAULT_OVERLAP = 24 * 3600.0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("webhooks", help="webhook endpoints: signing secrets, plain http")
    actions = parser.add_subparsers(dest="webhooks_command", required=True)
    secret = actions.add_parser("secret", help="an endpoint's signing secrets")
    secret_sub = secret.add_subparsers(dest="secret_command", required=True)

    rotate = secret_sub.add_parser("rotate", help="a new secret; the old ones keep signing "
                                                  "for the overlap")
    rotate.add_argument("endpoint")
    rotate.add_argument("--overlap", type=age, default=DEFAULT_OVERLAP,
                        help="how long the secrets active now keep signing (24h)")
    rotate.add_argument("--actor", default=None)
    rotate.add_argument("--url", help="app database URL (default: DATABASE_URL or embedded)")
    add_output_arguments(rotate)
    rotate.set_defaults(func=_rotate)

    listing = secret_sub.add_parser("list", help="secrets, masked unless --reveal")
    listing.add_argument("endpoint", nargs="?")
    listing.add_argument("--reveal", action="store_true",
                         help="print the secrets themselves (to hand one to its customer)")
    listing.add_argument("--url", help="app database URL (default: DATABASE_URL or embedded)")
    add_output_arguments(listing)
    listing.set_defaults(func=_list)

    plain = actions.add_parser("http", help="allow or refuse plain http for an endpoint")
    plain.add_argument("endpoint")
    choice = plain.add_mutually_exclusive_group(required=True)
    choice.add_argument("--allow", action="store_true")
    choice.add_argument("--refuse", action="store_true")
    plain.add_argument("--actor", default=None)
    plain.add_argument("--url", help="app database URL (default: DATABASE_URL or embedded)")
    plain.set_defaults(func=_http)


def _store(args: argparse.Namespace) -> WebhookSecrets:
    return WebhookSecrets(app_database(args), signing_key)


def _rotate(args: argparse.Namespace) -> int:
    try:
        row = _store(args).rotate(args.endpoint, overlap=args.overlap, actor=actor(args))
    except SekaliError as exc:
        print(printable(f"error: {exc}"), file=sys.stderr)
        return 2
    view = row.view(row.created_at or 0.0, reveal=True)
    print(printable(f"{args.endpoint}: new secret {row.id}; the previous ones keep signing "
                    f"for {args.overlap:g}s"), file=sys.stderr)
    return emit(args, view, lambda: print(row.secret))


def _list(args: argparse.Namespace) -> int:
    try:
        rows = _store(args).listing(args.endpoint, reveal=args.reveal)
    except SekaliError as exc:
        print(printable(f"error: {exc}"), file=sys.stderr)
        return 2
    return emit(args, rows, lambda: _print_list(rows))


def _print_list(rows: list[dict[str, Any]]) -> None:
    if not rows:
        print("no endpoint has stored secrets (each signs with its derived default)")
        return
    table = Table(box=box.SIMPLE_HEAD)
    for name in ("endpoint", "id", "state", "secret", "derived", "created", "expires"):
        table.add_column(name, overflow="fold")
    for r in rows:
        table.add_row(printable(r["endpoint_id"]), "" if r["id"] is None else str(r["id"]),
                      r["state"], r["secret"], "yes" if r["derived"] else "",
                      when(r["created_at"]), when(r["expires_at"]))
    console().print(table)


def _http(args: argparse.Namespace) -> int:
    try:
        _store(args).allow_http(args.endpoint, args.allow, actor=actor(args))
    except SekaliError as exc:
        print(printable(f"error: {exc}"), file=sys.stderr)
        return 2
    print(printable(f"{args.endpoint}: plain http {'allowed' if args.allow else 'refused'}"))
    return 0
