"""``sekali cluster up|down|status|partition|heal``: sekali on hosts made of network namespaces.

``up`` builds a store host (private PostgreSQL + Redis), a control host (dagster-webserver and
dagster-daemon on ``deploy/production/dagster.yaml``), N worker hosts (a gRPC code server each:
runs execute there) and a provider host (sandbox gateway and mail sink), joined by a bridge; the
Dagster UI answers on the control host's address from this machine. ``down`` removes every
namespace, link, rule and process it made, and may be run again at any time. Root only builds
the namespaces, links and rules: the services run as the system user ``sekali`` (PostgreSQL as
``postgres``), created if missing. ``partition A B``
drops packets between two hosts (connects time out, nothing is refused); ``heal [A B]`` removes
that partition, or every one. See
``deploy/cluster/README.md`` and :mod:`sandbox.hosts`.

Exit codes: 0 done, 1 failed (the message says why), 2 not root or bad arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from cli.commands.output import add_output_arguments, emit
from resources.telemetry.redact import hide_url_password
from sandbox.hosts import Cluster, ClusterError, NotRoot, default_state_dir, require_root


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cluster = sub.add_parser(
        "cluster", help="sekali on several hosts (network namespaces): up, down, status"
    )
    actions = cluster.add_subparsers(dest="action", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--state", type=Path, default=None,
                       help=f"state folder (default {default_state_dir()})")
        add_output_arguments(p)

    up = actions.add_parser("up", help="build the hosts and start everything")
    common(up)
    up.add_argument("--workers", type=int, default=2, help="worker hosts (default 2)")
    up.add_argument("--env", action="append", default=[], metavar="KEY[=VALUE]",
                    help="extra environment for the worker hosts' code servers and runs, e.g. "
                         "SEKALI_INTAKE_MODE=micro_batch; KEY alone passes this command's "
                         "own value (for secrets: never type them here) (repeatable)")
    up.add_argument("--subnet", default=None,
                    help="a free /24 for the hosts (default: the first free one in 10.77.0.0/16)")
    up.add_argument("--timeout", type=float, default=300.0,
                    help="seconds to wait for every host to be healthy (default 300)")
    up.add_argument("--keep-on-failure", action="store_true",
                    help="leave a half-built cluster for inspection instead of removing it")
    up.set_defaults(func=_up)

    down = actions.add_parser("down", help="remove every namespace, link, rule and process")
    common(down)
    down.add_argument("--purge", action="store_true", help="delete the state folder and its logs")
    down.set_defaults(func=_down)

    status = actions.add_parser("status", help="hosts, addresses, processes and health")
    common(status)
    status.set_defaults(func=_status)

    part = actions.add_parser("partition", help="drop packets between two hosts")
    common(part)
    part.add_argument("a", help="a host name (store, control, provider, w1, ...)")
    part.add_argument("b", help="the other host")
    part.add_argument("--one-way", action="store_true", help="drop only packets from A to B")
    part.add_argument("--loss", type=float, default=1.0,
                      help="share of packets dropped, 0 < loss <= 1 (default 1)")
    part.set_defaults(func=_partition)

    heal = actions.add_parser("heal", help="remove the partition between two hosts, or all")
    common(heal)
    heal.add_argument("hosts", nargs="*", metavar="HOST", help="two hosts, or none for all")
    heal.set_defaults(func=_heal)


def _say(args: argparse.Namespace, message: str) -> None:
    print(message, file=sys.stderr if args.json else sys.stdout, flush=True)


def _root_or_exit() -> int | None:
    try:
        require_root()
    except NotRoot as exc:
        print(f"sekali cluster: {exc}; run it as root", file=sys.stderr)
        return 2
    return None


_SECRET_WORDS = ("PASSWORD", "SECRET", "TOKEN", "KEY")


def _parse_env(items: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` items; ``KEY`` alone takes the value from this command's environment
    (so a secret need not be typed on the command line). A secret typed as ``KEY=VALUE`` (a
    secret-named variable, or a URL with a password) is accepted with a warning naming the
    safer form."""
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not key:
            raise ValueError(f"--env: expected KEY=VALUE or KEY, got {item!r}")
        if not sep:
            if key not in os.environ:
                raise ValueError(f"--env {key}: not set in this command's environment")
            value = os.environ[key]
        elif any(w in key.upper() for w in _SECRET_WORDS) or hide_url_password(value) != value:
            print(f"warning: --env {key}=... puts a secret on the command line, visible in the "
                  f"process list and your shell history; export {key} and pass --env {key}",
                  file=sys.stderr)
        env[key] = value
    return env


def _up(args: argparse.Namespace) -> int:
    if (code := _root_or_exit()) is not None:
        return code
    try:
        worker_env = _parse_env(args.env)
    except ValueError as exc:
        print(f"sekali cluster up: {exc}", file=sys.stderr)
        return 2
    logging.getLogger("alembic").setLevel(logging.WARNING)  # Dagster's storage migrations
    cluster = Cluster(args.state)
    try:
        cluster.up(args.workers, worker_env=worker_env, subnet=args.subnet,
                   timeout=args.timeout, progress=lambda m: _say(args, m))
    except (ClusterError, OSError) as exc:
        print(f"sekali cluster up failed: {exc}", file=sys.stderr)
        if cluster.exists and not args.keep_on_failure:
            print("removing what was built (logs stay in "
                  f"{cluster.state_dir / 'logs'})", file=sys.stderr)
            try:
                cluster.down()
            except ClusterError as down_exc:
                print(f"sekali cluster down failed too: {down_exc}", file=sys.stderr)
        elif cluster.exists:
            print(f"left as it is: sekali cluster down --state {cluster.state_dir}",
                  file=sys.stderr)
        return 1
    return _print_status(args, cluster.status())


def _down(args: argparse.Namespace) -> int:
    if (code := _root_or_exit()) is not None:
        return code
    cluster = Cluster(args.state)
    try:
        removed = cluster.down(purge=args.purge, progress=lambda m: _say(args, m))
    except ClusterError as exc:
        print(f"sekali cluster down failed: {exc}", file=sys.stderr)
        return 1
    if args.json or args.out:
        data = {"removed": removed, "leftovers": cluster.leftovers()}
        return emit(args, data, lambda: None)
    return 0


def _status(args: argparse.Namespace) -> int:
    if (code := _root_or_exit()) is not None:
        return code
    status = Cluster(args.state).status()
    return _print_status(args, status) or (0 if status.get("healthy") else 1)


def _partition(args: argparse.Namespace) -> int:
    if (code := _root_or_exit()) is not None:
        return code
    cluster = Cluster(args.state)
    if not cluster.exists:
        print(f"sekali cluster partition: no cluster recorded in {cluster.state_dir}",
              file=sys.stderr)
        return 2
    try:
        part = cluster.partition(args.a, args.b, one_way=args.one_way, loss=args.loss)
    except ClusterError as exc:
        print(f"sekali cluster partition: {exc}", file=sys.stderr)
        return 2
    return emit(args, {"partition": part.to_json()}, lambda: print(
        f"partition {part.a} {'->' if part.one_way else '<->'} {part.b} loss {part.loss}"))


def _heal(args: argparse.Namespace) -> int:
    if (code := _root_or_exit()) is not None:
        return code
    if len(args.hosts) not in (0, 2):
        print("sekali cluster heal: name two hosts, or none to heal every partition",
              file=sys.stderr)
        return 2
    cluster = Cluster(args.state)
    if not cluster.exists:
        print(f"sekali cluster heal: no cluster recorded in {cluster.state_dir}", file=sys.stderr)
        return 2
    try:
        healed = cluster.heal(*args.hosts)
    except ClusterError as exc:
        print(f"sekali cluster heal: {exc}", file=sys.stderr)
        return 2
    return emit(args, {"healed": healed}, lambda: print(f"healed {healed} partition(s)"))


def _print_status(args: argparse.Namespace, status: dict[str, Any]) -> int:
    """The status as JSON (``--json``, ``--out``) or lines; 2 when ``--out`` cannot be written."""
    return emit(args, json.loads(json.dumps(status, default=str)),
                lambda: _print_status_lines(status))


def _print_status_lines(status: dict[str, Any]) -> None:
    if status["phase"] == "absent":
        print(f"no cluster recorded in {status['state_dir']}")
        return
    print(f"cluster {status['state_dir']}  phase {status['phase']}  subnet {status['subnet']}  "
          f"bridge {status['bridge']}  {'healthy' if status['healthy'] else 'NOT healthy'}")
    for host in status["hosts"]:
        procs = ", ".join(f"{p['name']}:{p['pid']}{'' if p['alive'] else ' (dead)'}"
                          for p in host["processes"])
        health = ", ".join(f"{k} {v}" for k, v in host["health"].items())
        location = f" location {host['location']}" if host.get("location") else ""
        print(f"  {host['name']:<9} {host['address']:<13} ns {host['namespace']}{location}")
        print(f"            processes: {procs or '-'}  health: {health or '-'}")
    for part in status["partitions"]:
        arrow = "->" if part["one_way"] else "<->"
        print(f"  partition {part['a']} {arrow} {part['b']} loss {part['loss']}")
    print(f"Dagster UI: {status['ui_url']} (login required: user operator, its password in "
          f"{status['state_dir']}/state.json, secrets.ui); read-only for viewers: "
          f"{status.get('ui_readonly_url', '-')}")
