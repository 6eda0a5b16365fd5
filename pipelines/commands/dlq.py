"""``sekali dlq list | show | replay | discard``: the dead letter queue from the command line.

- ``list [--status S] [--job-type T] [--class C] [--fingerprint F] [--older-than 2h]
  [--newer-than 1d] [--json]``: unresolved records by default (open, replay_requested,
  replaying); ``--status all`` for every record.
- ``show ID [--json]``: one record with its error, trace, failed runs and audit trail.
- ``replay [ID ...] [filters] [--dry-run]``: ask for a replay of the selected open records; the
  ``dlq_replay_sensor`` launches them at its rate bound. Each selected record's idempotency key is
  reset from failed to retryable, and only those. Without ids a filter is required.
  ``--dry-run`` changes nothing and says what would be replayed.
- ``discard ID ... --reason R``: give up on records (kept, marked discarded, audited).

Exit codes: 0 done, 1 nothing matched / nothing changed, 2 bad arguments or unknown record
(one line on stderr; ids are whole numbers from 1 to 2**63 - 1).
"""

from __future__ import annotations

import argparse
import datetime as dt
import getpass
import json
import sys
from typing import Any

from pipelines.commands.arguments import record_id
from pipelines.privacy import dlq_view
from pipelines.requests import RequestStore
from resources.dlq import DlqRecordNotFound, DlqStore, parse_age
from resources.idempotency import IdempotencyStore
from resources.storage.db import shared_database
from resources.storage.settings import Settings
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
            "--class", dest="error_class", choices=["permanent", "transient", "data_bug", "unknown"]
        )
        p.add_argument("--fingerprint")
        p.add_argument("--older-than", dest="older_than", help="last failure at least this old")
        p.add_argument("--newer-than", dest="newer_than", help="last failure at most this old")

    p_list = dlq_sub.add_parser("list", help="list dead letters")
    filters(p_list)
    common(p_list)
    p_list.add_argument(
        "--status", action="append", help="status to show (repeatable); 'all' for every status"
    )
    p_list.add_argument("--json", action="store_true")
    p_list.set_defaults(func=_list)

    p_show = dlq_sub.add_parser("show", help="one dead letter in full")
    p_show.add_argument("id", type=record_id)
    p_show.add_argument("--json", action="store_true")
    common(p_show)
    p_show.set_defaults(func=_show)

    p_replay = dlq_sub.add_parser("replay", help="request replays (the replay sensor runs them)")
    p_replay.add_argument("ids", type=record_id, nargs="*")
    filters(p_replay)
    common(p_replay)
    p_replay.add_argument("--dry-run", action="store_true", dest="dry_run")
    p_replay.add_argument("--actor", default=None)
    p_replay.add_argument("--reason", default="")
    p_replay.set_defaults(func=_replay)

    p_discard = dlq_sub.add_parser("discard", help="give up on dead letters (kept, audited)")
    p_discard.add_argument("ids", type=record_id, nargs="+")
    p_discard.add_argument("--reason", required=True)
    p_discard.add_argument("--actor", default=None)
    common(p_discard)
    p_discard.set_defaults(func=_discard)


def _store(args: argparse.Namespace) -> Any:
    return DlqStore(shared_database(args.url or Settings.from_env().database_url))


def _actor(args: argparse.Namespace) -> str:
    if args.actor:
        return str(args.actor)
    try:
        return f"cli:{getpass.getuser()}"
    except Exception:  # noqa: BLE001 - no user name in some containers
        return "cli"


def _select(args: argparse.Namespace, store: Any, statuses: list[str] | None) -> list[Any]:
    return list(
        store.list_records(
            status=statuses,
            job_type=args.job_type,
            error_class=args.error_class,
            fingerprint=args.fingerprint,
            older_than=parse_age(args.older_than),
            newer_than=parse_age(args.newer_than),
            ids=getattr(args, "ids", None) or None,
        )
    )


def _when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, tz=dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _list(args: argparse.Namespace) -> int:
    statuses = None if args.status and "all" in args.status else (args.status or UNRESOLVED)
    try:
        records = _select(args, _store(args), statuses)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([dlq_view(r, summary=True) for r in records], indent=2))
        return 0
    if not records:
        print("no dead letters match")
        return 0
    print(
        f"{'id':>5}  {'status':<16} {'job_type':<20} {'class':<9} {'fingerprint':<16} "
        f"{'fails':>5} {'replays':>7}  last failure          error"
    )
    for r in records:
        print(
            f"{r.id:>5}  {r.status:<16} {r.job_type:<20} {r.error_class:<9} "
            f"{r.fingerprint:<16} {r.failure_count:>5} {r.replay_count:>7}  "
            f"{_when(r.last_failed_at)}  {r.error_type}: {dlq_view(r)['last_error'][:60]}"
        )
    return 0


def _show(args: argparse.Namespace) -> int:
    store = _store(args)
    try:
        record = store.get(args.id)
    except DlqRecordNotFound as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    data = {
        **dlq_view(record),  # personal fields and e-mail addresses masked
        "dedupe_window": RequestStore(store.db).dedupe_of(
            record.request_id, record.idempotency_key
        ),
        "failed_runs": store.failures(record.id),
        "audit": redact_data(store.audit(record.id)),
    }
    if args.json:
        print(json.dumps(data, indent=2, default=str))
        return 0
    for name, value in data.items():
        if name in ("trace", "audit"):
            continue
        print(f"{name:>16}: {value}")
    print("           audit:")
    for entry in data["audit"]:
        print(
            f"    {_when(entry['at'])} {entry['actor']}: {entry['action']} "
            f"{entry['from_status']} -> {entry['to_status']} {entry['detail'] or ''}"
        )
    print("           trace:")
    print(data["trace"])
    return 0


def _replay(args: argparse.Namespace) -> int:
    if not args.ids and not any(
        (args.job_type, args.error_class, args.fingerprint, args.older_than, args.newer_than)
    ):
        print(
            "error: name record ids or give a filter (--job-type, --class, --fingerprint, "
            "--older-than, --newer-than)",
            file=sys.stderr,
        )
        return 2
    store = _store(args)
    try:
        records = _select(args, store, ["open"] if not args.ids else None)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    missing = set(args.ids) - {r.id for r in records}
    if missing:
        print(f"error: no DLQ record {sorted(missing)}", file=sys.stderr)
        return 2
    decisions = store.request_replay(
        [r.id for r in records],
        actor=_actor(args),
        reason=args.reason,
        idempotency=IdempotencyStore(store.db),
        dry_run=args.dry_run,
    )
    for d in decisions:
        verb = ("would replay" if args.dry_run else "replay requested") if d.replay else "skipped"
        reset = " (key reset)" if d.key_reset else ""
        print(
            f"{d.record.id:>5}  {verb}: {d.record.job_type} key={d.record.idempotency_key} "
            f"{'' if d.replay else d.reason}{reset}"
        )
    chosen = sum(d.replay for d in decisions)
    print(
        f"{chosen} of {len(decisions)} selected records "
        f"{'would be replayed (dry run)' if args.dry_run else 'requested for replay'}"
    )
    return 0 if chosen else 1


def _discard(args: argparse.Namespace) -> int:
    store = _store(args)
    try:
        decisions = store.discard(args.ids, actor=_actor(args), reason=args.reason)
    except (DlqRecordNotFound, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for d in decisions:
        print(f"{d.record.id:>5}  {'discarded' if d.replay else 'skipped: ' + d.reason}")
    return 0 if any(d.replay for d in decisions) else 1
