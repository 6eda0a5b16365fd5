"""``sekali doctor [--json] [--out PATH] [--check NAME ...]``: the production diagnosis checklist.

Prints one row per checklist item with its verdict, what it found and, for a check that failed,
the fix to make; ``--json`` prints the same as a JSON list (only JSON on stdout), ``--out PATH``
writes it to a file. Exit status: 1 when a check of ERROR severity fails (a broken invariant),
0 otherwise (warnings included), 2 when the app database has not been created yet (one line
naming ``sekali db upgrade``). Configuration defaults to what the code location uses
(``pipelines.profile.resource_defs()`` and the environment); flags override it. In dev, the
payment downstream's charges are read from ``sekali dev``'s sandbox gateway ledger.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from dataclasses import replace
from typing import Any

from cli.commands.arguments import existing_database
from cli.commands.dev import dev_gateway_ledger_url
from cli.commands.output import add_output_arguments, emit
from engine.health.diagnosis import has_errors
from engine.health.observability import build_observability
from pipelines.domain.payments import charge_ledger
from pipelines.profile import resource_defs
from resources.storage.db import shared_database
from resources.storage.settings import RetentionSettings, Settings

CHECK_NAMES = (
    "real_duplicates", "lease_vs_duration", "idempotency_coverage", "lock_ttl",
    "retry_synchronisation", "cache_expiry_clusters", "ack_timing", "dlq",
    "unique_constraints", "correlation", "retention_backlog", "retention_agreement",
    "redis_eviction", "tenant_starvation", "outbox_dead_letters", "replication",
    "adaptive_timing", "worker_capacity",
)


def add_source_arguments(parser: argparse.ArgumentParser) -> None:
    """Where the evidence lives; shared with ``sekali metrics``."""
    parser.add_argument("--url", help="app database URL (default: DATABASE_URL or embedded)")
    parser.add_argument("--redis-url", help="Redis URL (default: REDIS_URL or embedded)")
    parser.add_argument("--gateway-ledger-url",
                        help="database of the payment downstream's charge ledger (default: the "
                             "sandbox gateway's of `sekali dev`, when it is the one configured)")
    parser.add_argument("--lease-seconds", type=float, help="idempotency lease to check against")
    parser.add_argument("--lock-ttl", type=float, help="lock TTL to check against")
    parser.add_argument("--no-lock-renew", action="store_true", help="locks are not renewed")
    parser.add_argument("--cache-namespace", action="append", dest="cache_namespaces")
    parser.add_argument("--window-hours", type=float, help="how far back the checks look")


def observability_from_args(args: argparse.Namespace, *, created: bool = True) -> Any:
    """The checks' and metrics' sources: flags, then the code location's resources, then the
    environment; the payment ledger defaults to ``sekali dev``'s sandbox gateway's (said on
    stderr) when that gateway is the downstream configured. ``created``: the app database must
    exist already (:func:`~cli.commands.arguments.existing_database`); an exporter started
    before it (``metrics serve``) passes False and reports its sources missing meanwhile."""
    settings = Settings.from_env()
    res = resource_defs()
    idem, locks, cache, obs = (res["idempotency"], res["locks"], res["cache"],
                               res["observability"])
    ledger_url = args.gateway_ledger_url or obs.gateway_ledger_url
    if not ledger_url:
        ledger_url = dev_gateway_ledger_url(settings)
        if ledger_url:
            print(f"counting the charges of sekali dev's sandbox gateway ({ledger_url}); "
                  "--gateway-ledger-url to choose another", file=sys.stderr)
    url = args.url or res["app_db"].database_url or settings.database_url
    return build_observability(
        existing_database(url) if created else shared_database(url),
        lease_seconds=args.lease_seconds or idem.lease_seconds,
        lock_backend=locks.backend,
        lock_ttl_seconds=args.lock_ttl or locks.ttl_seconds,
        lock_auto_renew=locks.auto_renew and not args.no_lock_renew,
        redis_url=args.redis_url or cache.redis_url or settings.redis_url,
        cache_namespaces=args.cache_namespaces or [cache.namespace],
        effect_ledgers=[charge_ledger(ledger_url)] if ledger_url else [],
        window_hours=args.window_hours or obs.window_hours,
        metrics_window_minutes=obs.metrics_window_minutes,
        retention=replace(RetentionSettings.from_env(), dlq=res["dlq"].retention_days * 86400),
    )


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("doctor", help="run the production diagnosis checklist")
    add_output_arguments(parser)
    parser.add_argument("--check", action="append", choices=CHECK_NAMES, dest="checks",
                        help="run only this check (repeatable)")
    add_source_arguments(parser)
    parser.set_defaults(func=_doctor)


def render_table(findings: list[Any], width: int = 100) -> str:
    """One row per check (title and verdict), its finding wrapped beneath, and for a check that
    failed its fix (a check that passed has nothing to fix; ``--json`` keeps every field)."""
    lines = [f"{'CHECK':<58} VERDICT", "-" * width]
    for f in findings:
        lines.append(f"{f.title:<58} {f.verdict}")
        shown = (("found", f.found),) if f.passed else (("found", f.found), ("fix", f.fix))
        for label, body in shown:
            wrapped = textwrap.wrap(body, width - 11) or [""]
            lines.append(f"    {label + ':':<6} {wrapped[0]}")
            lines.extend(f"           {line}" for line in wrapped[1:])
    failed = [f for f in findings if not f.passed]
    errors = sum(1 for f in failed if f.severity == "ERROR")
    lines.append("-" * width)
    lines.append(
        f"{len(findings) - len(failed)} passed, {errors} failed at ERROR, "
        f"{len(failed) - errors} failed at WARN"
    )
    return "\n".join(lines)


def _doctor(args: argparse.Namespace) -> int:
    findings = observability_from_args(args).findings(args.checks)
    data = json.loads(json.dumps([f.as_dict() for f in findings], default=_json_default))
    if emit(args, data, lambda: print(render_table(findings))):
        return 2
    if has_errors(findings):
        print("doctor: at least one ERROR-severity check failed", file=sys.stderr)
        return 1
    return 0


def _json_default(value: Any) -> Any:
    return str(value)
