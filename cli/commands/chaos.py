"""``sekali chaos``: break the system on purpose and check that no effect happened twice and no
job was lost (see :mod:`proof.chaos` and docs/chaos.md).

Exit codes: 0 every invariant held (or ``--naive``, whose violations are the point: they are
printed, not failed on), 1 a violation in guarded mode, 2 bad arguments. ``--json`` prints the
report (only JSON) on stdout and the human summary on stderr; ``--out PATH`` writes the report
to a file as well.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from rich.console import Console

from cli.commands.output import add_output_arguments, emit
from proof.chaos import (
    DEFAULT_FAULTS,
    FAULTS,
    ChaosConfig,
    ChaosConfigError,
    format_table,
    parse_faults,
    run_chaos,
)
from proof.chaos_hosts import HOSTS_DELIVERIES, HostsConfig, run_hosts_chaos


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "chaos",
        help="fault-injection run with an invariant checker (duplicates, losses, stale writes)",
    )
    p.add_argument("--requests", type=int, default=None,
                   help="job requests (default 300; 100 with --topology hosts)")
    p.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    p.add_argument("--redelivery", type=int, default=3, help="deliveries per request (default 3)")
    p.add_argument("--faults", default=",".join(DEFAULT_FAULTS),
                   help=f"comma-separated, from {','.join(FAULTS)}; 'all' for every fault the "
                        f"run can strike (default: {','.join(DEFAULT_FAULTS)})")
    p.add_argument("--job-type", dest="job_type", default=None, metavar="NAME[,NAME...]",
                   help="run these registered job types (built-in or from SEKALI_JOB_MODULES) "
                        "instead of the built-in mix: payloads from each one's example, effects "
                        "counted at its sandbox stand-in by the stand-in's own record (else "
                        "through its lookup hook: unverified), the lookup calibrated first")
    p.add_argument("--calibration-runs", dest="calibration_runs", type=int, default=3,
                   help="with --job-type: sends per calibration key that the lookup must all "
                        "report before the fault run (default 3; 0: no calibration, said so)")
    p.add_argument("--require-record", dest="require_record", action="store_true",
                   help="with --job-type: refuse a job type whose stand-in declares no record "
                        "of its own (its effects could only be counted through its lookup)")
    p.add_argument("--dagster", action="store_true",
                   help="with --job-type: each delivery is a real run of the job type's "
                        "per-request Dagster job on a real instance (Dagster's retries and the "
                        "run-failure sensor's DLQ path inside the proof; slower: run fewer); "
                        "with --delivery resident: every worker is a sekali_worker run the "
                        "workers' supervisor asked for")
    p.add_argument("--delivery", choices=list(HOSTS_DELIVERIES), default=None,
                   help="resident (the platform's default): requests enqueued, resident worker "
                        "processes (Dagster worker runs with --topology hosts) claim and run "
                        "them, a dead one's requests given back; per_request: each delivered to "
                        "the per-request op's step entry (a run each with --topology hosts); "
                        "fan_out and micro_batch: --topology hosts only (default: resident, but "
                        "per_request with --job-type, --dagster or --naive)")
    p.add_argument("--batch", type=int, default=4,
                   help="with --delivery resident: requests a worker claims at once (default 4)")
    p.add_argument("--backend", choices=["sqlite", "postgres"], default="sqlite")
    p.add_argument("--database-url", dest="database_url",
                   help="Postgres URL to create the run's schema in (default DATABASE_URL or the "
                        "local test database); with pg-restart the run starts a private cluster "
                        "and refuses a URL")
    p.add_argument("--seed", type=int, default=1)
    add_output_arguments(p)
    p.add_argument("--topology", choices=["local", "hosts"], default="local",
                   help="local: worker processes on this host; hosts: through `sekali cluster` "
                        "(network namespaces, root only) with partitions (proof/chaos_hosts.py)")
    p.add_argument("--workers-hosts", dest="workers_hosts", type=int, default=2,
                   help="worker hosts with --topology hosts (default 2)")
    p.add_argument("--naive", action="store_true",
                   help="defences off: no claim, no lock, no Idempotency-Key, ack before work")
    p.add_argument("--lease", type=float, default=2.0, help="lease and lock TTL in seconds")
    p.add_argument("--adaptive", action="store_true",
                   help="leases follow the observed durations (the platform's default) instead "
                        "of --lease, up to each job type's ceiling; the stall bound follows the "
                        "longest ceiling (slower: raise --timeout)")
    p.add_argument("--kills", type=int, default=None, help="SIGKILLs (default requests/40, >=3)")
    p.add_argument("--stops", type=int, default=2, help="SIGSTOPs past the lease (default 2)")
    p.add_argument("--timeout", type=float, default=300.0, help="give up after this many seconds")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--keep-state", action="store_true", help="keep the temp folder (worker logs)")
    p.set_defaults(func=_run)


def _report(args: argparse.Namespace, report: dict[str, Any], say: Any) -> int:
    """The report through the one ``--json``/``--out`` path; the summary was printed before
    (on stderr under ``--json``). 0, or 2 when ``--out`` cannot be written."""
    code = emit(args, report, lambda: None)
    if code == 0 and args.out is not None:
        say(f"report written to {args.out}")
    return code


def config_from_args(args: argparse.Namespace) -> tuple[ChaosConfig, list[str]]:
    """The one-host run the arguments ask for, and the notes on faults left out; nothing runs.
    Raises :class:`ChaosConfigError` for options that cannot make a run (the run checks the
    rest, :meth:`ChaosConfig.validate`)."""
    job_types = tuple(n.strip() for n in (args.job_type or "").split(",") if n.strip())
    if args.job_type is not None and not job_types:
        raise ChaosConfigError("--job-type: name at least one job type")
    faults, notes = parse_faults(args.faults, backend=args.backend,
                                 database_url=args.database_url, typed=bool(job_types))
    delivery = args.delivery or ("per_request" if job_types or args.naive else "resident")
    return ChaosConfig(
        requests=300 if args.requests is None else args.requests,
        workers=args.workers,
        redelivery=args.redelivery,
        faults=faults,
        backend=args.backend,
        database_url=args.database_url,
        seed=args.seed,
        naive=args.naive,
        lease_seconds=args.lease,
        adaptive=args.adaptive,
        kills=args.kills,
        stops=args.stops,
        timeout=args.timeout,
        progress=args.progress and sys.stderr.isatty(),
        keep_state=args.keep_state,
        job_types=job_types,
        dagster=args.dagster,
        calibration_runs=args.calibration_runs,
        require_record=args.require_record,
        delivery=delivery,
        batch_size=args.batch,
    ), notes


def _run(args: argparse.Namespace) -> int:
    if args.topology == "hosts" and args.job_type is not None:
        print("sekali chaos: --job-type runs with --topology local only", file=sys.stderr)
        return 2
    if args.topology == "hosts":
        return _run_hosts(args)
    if not args.verbose:  # the sandbox servers log every charge and mail
        for name in ("mail.log", "sandbox.gateway", "sandbox.mailsink", "resources",
                     "engine", "pipelines"):
            logging.getLogger(name).setLevel(logging.WARNING)

    try:
        config, notes = config_from_args(args)
    except ChaosConfigError as exc:
        print(f"sekali chaos: {exc}", file=sys.stderr)
        return 2
    job_types = config.job_types
    out = sys.stderr if args.json else sys.stdout
    for note in notes:
        print(f"sekali chaos: {note}", file=sys.stderr)
    try:
        report = run_chaos(config)
    except ChaosConfigError as exc:
        print(f"sekali chaos: {exc}", file=sys.stderr)
        return 2
    mode = "naive (defences off)" if config.naive else "guarded"
    mode += f", {config.delivery.replace('_', '-')} delivery" + (
        " (sekali_worker Dagster runs)" if config.dagster and config.delivery == "resident"
        else "")
    if job_types:
        mode += f", job types {','.join(job_types)}" + (", Dagster runs" if args.dagster else "")
    print(f"sekali chaos: {mode}, {config.requests} requests x {config.redelivery} deliveries, "
          f"{config.workers} workers, backend {config.backend}, faults {','.join(config.faults)}",
          file=out)
    print(format_table(report.rows) if report.rows else "(no fault run)", file=out)
    s = report.stats
    def struck(name: str, stat: str) -> str:
        planned = s.get(f"{name}_scheduled")
        return f"{s.get(stat, 0)}" + (f" of {planned} planned" if planned else "")

    pg = (f" pg restarts {struck('pg-restart', 'pg-restart')} (seen by the run's database:"
          f" {s['pg_restarts_seen']})," if "pg_restarts_seen" in s else "")
    print(f"\n{s.get('dispatches', 0)} dispatches in {report.seconds}s;"
          f" kills {struck('kills', 'kills')}, stops {struck('stops', 'stops')},"
          f" redis restarts {struck('redis-restart', 'redis-restart')},{pg}"
          f" stale writes rejected {s.get('stale_writes_rejected', 0)},"
          f" unplanned worker deaths {s.get('unplanned_deaths', 0)}", file=out)
    newer = [f for f in config.faults if f"{f}_scheduled" in s and f not in (
        "redis-restart", "pg-restart")]
    if newer:
        print("struck: " + ", ".join(f"{f} {struck(f, f)}" for f in newer), file=out)
    if report.counting:
        ways = {"record": "the stand-in's own record", "lookup": "its lookup"}
        print("counted: " + ", ".join(f"{name} by {ways[how]}"
                                      for name, how in report.counting.items())
            + (f"; send bounds checked on {s.get('send_bound_checked', 0)} arrivals"
               f" ({s.get('send_bound_unjudged', 0)} unjudged: their holder died unrecorded)"
               if "record" in report.counting.values() else ""), file=out)
    for cal in report.calibration:
        seen = ", ".join(f"{k['reported']}/{k['made'] if k['made'] is not None else '?'}"
                         for k in cal["keys"])
        print(f"calibration of {cal['job_type']}'s lookup (reported/recorded per key, "
              f"{cal['keys'][0]['runs'] if cal['keys'] else 0} sends each): {seen}"
              + (" FAILED" if cal["problem"] else ""), file=out)
    for line in report.unverified:
        print(f"UNVERIFIED: {line}", file=out)
    if report.state_dir:
        print(f"state kept in {report.state_dir} (worker logs, databases)", file=out)
    code = _report(args, report.to_dict(), lambda m: print(m, file=out))
    if code:
        return code
    if report.ok:
        print("OK: every invariant held", file=out)
        return 0
    print(f"\n{len(report.violations)} violation(s):", file=out)
    for line in report.violations[:30]:
        print(f"  - {line}", file=out)
    if len(report.violations) > 30:
        print(f"  ... and {len(report.violations) - 30} more (see --json)", file=out)
    if config.naive:
        print("(naive mode: these are what the defences prevent; not a failure of this command)",
              file=out)
        return 0
    return 1


def _run_hosts(args: argparse.Namespace) -> int:
    """``--topology hosts``: progress and the table on stderr, with ``--json`` only the report
    on stdout, ``--out PATH`` the report in a file. Exit 0 every invariant held, 1 a violation,
    2 bad arguments or not root."""
    err = Console(stderr=True, soft_wrap=True)
    config = HostsConfig(requests=100 if args.requests is None else args.requests,
                         worker_hosts=args.workers_hosts, seed=args.seed,
                         kills=args.kills if args.kills is not None else 2,
                         intake_mode=args.delivery or "resident")
    for name in ("alembic", "engine.intake", "sandbox.hosts"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        report = run_hosts_chaos(config, say=lambda m: err.print(f"[dim]chaos hosts:[/] {m}"))
    except ChaosConfigError as exc:
        err.print(f"sekali chaos: {exc}")
        return 2
    code = _report(args, report.to_dict(), err.print)
    if code:
        return code
    out = err if args.json else Console(soft_wrap=True)
    s = report.stats
    out.print(f"sekali chaos --topology hosts: {config.requests} requests, "
              f"{config.worker_hosts} worker hosts, {config.intake_mode} delivery, seed "
              f"{config.seed}, {report.seconds} s")
    out.print(format_table(report.rows) if report.rows else "(no verdicts)")
    out.print(f"partitions struck {s.get('partition_struck', 0)} of "
              f"{s.get('partition_planned', 0)} planned, kills {s.get('kill_struck', 0)} of "
              f"{s.get('kill_planned', 0)}, redis restarts {s.get('redis-restart_struck', 0)} of "
              f"{s.get('redis-restart_planned', 0)}; completed {s.get('completed')}, "
              f"dead-lettered {s.get('dead_lettered')}; settled "
              f"{s.get('settled_seconds_after_last_heal')} s after the last heal "
              f"(bound {s.get('settle_bound_seconds')} s); Dagster runs open at the end "
              f"{s.get('runs_open_at_end')}"
              + (f" ({s['worker_runs_terminated']} worker runs ended in "
                 f"{s['runs_closed_seconds']} s)" if "worker_runs_terminated" in s else ""))
    if report.ok:
        out.print("OK: every invariant held")
        return 0
    out.print(f"{len(report.violations)} violation(s):")
    for line in report.violations[:30]:
        out.print(f"  - {line}", markup=False)
    return 1
