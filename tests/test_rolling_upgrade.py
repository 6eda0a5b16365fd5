"""A rolling upgrade from the previous release to this one loses nothing and stops nothing.

The previous release's code (pinned in ``tests/releases``: ``python -m tests.releases.pin REV``
moves the base forward) runs producers and workers against one database; then this release's
``sekali db upgrade`` migrates it while they go on, and this release's producers and workers
join them, as a deployment rolls: a new worker dies right after a charge (the gateway charged,
the key is not completed, its lease is live) while only old workers serve, so an old one takes
the key over with a larger fence; then the old workers leave, an old worker dies the same way
among new ones, which take its key over; then both serve side by side to the end. At the end,
the chaos invariants, read from the sandbox gateway's own ledger and the stores, never from what
workers reported:

- no duplicate: one charge per accepted payment request, none for a refused one;
- nothing lost: every request ended completed, or coalesced into one that completed (the
  previous release knows ``coalesced``, so this one debounces the report requests); every
  enqueue of the old producers was accepted
  or kept as a rejection (an error at enqueue is a request lost: what 0110's ``claim_rank NOT
  NULL`` did to every old enqueue once a new process had migrated);
- old readers work: the old producer re-sending the new producer's requests reads their rows,
  and the old ``sekali rejections list`` reads the rejections;
- the old release is not contracted away: ``sekali db status`` shows nothing pending and the
  reader floor still at the previous release's newest migration.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from pipelines.jobs.payment import reference_for
from resources.storage.db import Database
from sandbox.gateway import GatewayServer
from tests.releases import PreviousRelease, extract

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "tests" / "upgrade_workers.py"
LEASE = 3.0
STALE = 4.0

pytestmark = [pytest.mark.slow, pytest.mark.redis]


class Fleet:
    """The processes of both releases, with their logs and output under one folder."""

    def __init__(self, tmp: Path, env: dict[str, str], old: PreviousRelease) -> None:
        self.tmp = tmp
        self.base_env = env
        self.roots = {"old": old.root, "new": ROOT}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def env(self, release: str, **extra: str) -> dict[str, str]:
        root = str(self.roots[release])
        return {**os.environ, **self.base_env, "PYTHONPATH": root,
                "SEKALI_RELEASE_ROOT": root, **extra}

    def start(self, name: str, release: str, role: str, config: dict[str, Any],
              **extra_env: str) -> Path:
        out = self.tmp / f"{name}.jsonl"
        config = {**config, "out": str(out), "release": release}
        log = (self.tmp / f"{name}.log").open("wb")
        self.procs[name] = subprocess.Popen(
            [sys.executable, str(DRIVER), role, json.dumps(config)],
            env=self.env(release, **extra_env), stdout=log, stderr=subprocess.STDOUT,
            cwd=self.tmp,
        )
        return out

    def run(self, release: str, *args: str, timeout: float = 120.0
            ) -> subprocess.CompletedProcess[str]:
        """``sekali ARGS`` of ``release``, to the end."""
        return subprocess.run(
            [sys.executable, str(DRIVER), "cli", *args], env=self.env(release),
            capture_output=True, text=True, timeout=timeout, cwd=self.tmp,
        )

    def wait(self, name: str, timeout: float) -> int:
        return self.procs[name].wait(timeout=timeout)

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait(timeout=10)


def lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def until(what: str, check: Callable[[], bool], timeout: float, fleet: Fleet) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            logs = "\n".join(f"--- {n}\n{fleet.log(n)}" for n in fleet.procs)
            pytest.fail(f"timed out waiting for {what}\n{logs}")
        time.sleep(0.2)


def test_rolling_upgrade_from_the_previous_release(
    db_url: str, redis_url: str, namespace: str, gateway: GatewayServer, tmp_path: Path,
) -> None:
    """Catches: an old producer's enqueue failing on a column it does not know; an old reader
    meeting a status it has no name for; a takeover between releases (either way) charging
    twice or losing the charge; the upgrade needing the old processes stopped."""
    old = extract(tmp_path)
    env = {
        "DATABASE_URL": db_url, "REDIS_URL": redis_url, "SEKALI_GATEWAY_URL": gateway.url,
        "SEKALI_GATEWAY_SETTLE_SECONDS": "1", "SEKALI_MIGRATION_LOCK_TIMEOUT": "0.5",
    }
    fleet = Fleet(tmp_path, env, old)
    db = Database.from_url(db_url)

    def worker(name: str, release: str, **extra_env: str) -> None:
        fleet.start(name, release, "work", {
            "db_url": db_url, "namespace": namespace, "lease": LEASE, "stale": STALE,
            "stop_file": str(tmp_path / f"stop-{name}")}, **extra_env)

    def stop(*names: str) -> None:
        for name in names:
            (tmp_path / f"stop-{name}").touch()
        for name in names:
            assert fleet.wait(name, 60) == 0, fleet.log(name)

    def produce(name: str, release: str, kind: str, prefix: str, count: int,
                bad_every: int = 0) -> Path:
        return fleet.start(name, release, "produce", {
            "db_url": db_url, "kind": kind, "prefix": prefix, "count": count,
            "bad_every": bad_every, "pace": 0.1 if kind == "payment" else 0.02})

    def dies_after_a_charge(name: str, release: str, producer: Callable[[], object]) -> str:
        """A worker of ``release`` armed to die right after its first charge; ``producer``
        starts once it polls. Returns the key it left charged, claimed and unrecorded."""
        worker(name, release, SEKALI_CRASH_AT="after_charge")
        until(f"{name} polling", lambda: bool(lines(tmp_path / f"{name}.jsonl")), 60, fleet)
        producer()
        assert fleet.wait(name, 120) == -signal.SIGKILL, fleet.log(name)
        return str([ln for ln in lines(tmp_path / f"{name}.jsonl") if ln["t"] == "start"][-1]
                   ["key"])

    def completed_by(key: str) -> Any:
        def done() -> bool:
            with db.statement() as conn:
                return conn.execute(text("SELECT status FROM job_requests WHERE key = :k"),
                                    {"k": key}).scalar() == "completed"

        until(f"{key} completed", done, 120, fleet)
        with db.statement() as conn:
            return conn.execute(text(
                "SELECT fence, pid FROM job_attempts WHERE idempotency_key = :k"
                " AND outcome = 'completed'"), {"k": key}).one()

    def pids(release: str) -> set[int]:
        return {ln["pid"] for p in tmp_path.glob("work-*.jsonl") for ln in lines(p)
                if ln.get("release") == release}

    try:
        # the previous release alone: its producer creates its schema, its workers serve it
        p_old = produce("produce-old", "old", "payment", "old", 60, bad_every=7)
        until("the old producer's first enqueue", lambda: bool(lines(p_old)), 60, fleet)
        for name in ("work-old-1", "work-old-2"):
            worker(name, "old")
        until("old work done", lambda: any(ln.get("t") == "done" for ln in lines(
            tmp_path / "work-old-1.jsonl") + lines(tmp_path / "work-old-2.jsonl")), 60, fleet)

        # this release migrates the database under them
        upgraded = fleet.run("new", "db", "upgrade")
        assert upgraded.returncode == 0, upgraded.stderr
        assert "0120_flow_intake_compat" in upgraded.stdout

        # a new worker dies after its charge: an old worker takes the key over
        new_left = dies_after_a_charge("crash-new", "new", lambda: (
            produce("produce-new", "new", "payment", "new", 40, bad_every=9),
            produce("produce-reports", "new", "report", "rep", 8)))
        fence, pid = completed_by(new_left)
        assert fence > 1 and pid in pids("old"), (new_left, fence, pid)

        # the old workers leave, the new ones come; an old worker dies after its charge: a new
        # worker takes the key over
        stop("work-old-1", "work-old-2")
        for name in ("work-new-1", "work-new-2"):
            worker(name, "new")
        old_left = dies_after_a_charge("crash-old", "old", lambda: produce(
            "produce-new-2", "new", "payment", "later", 20))
        fence, pid = completed_by(old_left)
        assert fence > 1 and pid in pids("new"), (old_left, fence, pid)

        # both serve side by side until the end
        for name in ("work-old-3", "work-old-4"):
            worker(name, "old")
        producers = ("produce-old", "produce-new", "produce-reports", "produce-new-2")
        for name in producers:
            assert fleet.wait(name, 180) == 0, fleet.log(name)

        # an old reader: the old producer sends the new producer's report requests again,
        # reading each row the new release wrote
        p_again = produce("produce-old-again", "old", "report", "rep", 8)
        assert fleet.wait("produce-old-again", 120) == 0, fleet.log("produce-old-again")

        produced = {name: lines(tmp_path / f"{name}.jsonl") for name in producers}
        accepted = {ln["key"] for rows in produced.values() for ln in rows
                    if ln["outcome"] == "accepted"}

        def settled() -> bool:
            with db.statement() as conn:
                rows = conn.execute(text("SELECT status, COUNT(*) AS n FROM job_requests"
                                         " GROUP BY status")).all()
            counts = {r.status: int(r.n) for r in rows}
            return set(counts) <= {"completed", "coalesced"} and sum(counts.values()) == len(
                accepted)

        until("every request completed (or coalesced into one that did)", settled, 180, fleet)
        stop("work-new-1", "work-new-2", "work-old-3", "work-old-4")

        # nothing lost: every enqueue accepted or kept as a rejection
        errors = [ln for rows in produced.values() for ln in rows if ln["outcome"] == "error"]
        assert errors == []
        assert all(ln["outcome"] == "accepted" and not ln["created"]
                   for ln in lines(p_again)), lines(p_again)
        refused = [ln for rows in produced.values() for ln in rows if ln["outcome"] == "rejected"]
        assert len(refused) == 9 + 5  # every 7th of 60, every 9th of 40
        with db.statement() as conn:
            kept = [r.payload for r in conn.execute(text("SELECT payload FROM job_rejections"))]
            keys = {r.key for r in conn.execute(text("SELECT key FROM job_requests"))}
            completed = {r.key for r in conn.execute(text(
                "SELECT key FROM idempotency_records WHERE status = 'completed'"))}
            # the previous release knows `coalesced` (0110), so this one debounces the report
            # requests: each coalesced one names a request that completed
            coalesced = {r.key: r.into_status for r in conn.execute(text(
                "SELECT r.key, i.status AS into_status FROM job_requests r"
                " JOIN job_requests i ON i.id = r.coalesced_into WHERE r.status = 'coalesced'"))}
        # every refusal kept: the previous release keeps the payload, this one a masked
        # excerpt with the size and hash of what was sent (no value)
        assert len(kept) == len(refused), kept
        refused_ids = {ln["payload"]["order_id"] for ln in refused}
        assert all(i in refused_ids for p in kept
                   for i in re.findall(r'"order_id": ?"([^"<][^"]*)"', p)), (kept, refused_ids)
        assert keys == accepted
        assert set(coalesced.values()) <= {"completed"}
        assert all(k.startswith("report:") for k in coalesced), coalesced
        assert completed == accepted - set(coalesced)

        # no duplicate: one charge per accepted payment, none for a refused one
        charges = Counter(c["reference"] for c in gateway.charges())
        payments = {k for k in accepted if k.startswith("payment:")}
        assert len(payments) == 60 - 9 + 40 - 5 + 20
        assert charges == Counter({reference_for(k): 1 for k in payments})

        # the old command line reads what both releases wrote
        listed = fleet.run("old", "rejections", "list", "--json")
        assert listed.returncode == 0, listed.stderr
        assert len(json.loads(listed.stdout)) == len(refused)

        state = fleet.run("new", "db", "status", "--json")
        assert state.returncode == 0, state.stderr
        status = json.loads(state.stdout)
        assert status["pending"] == []
        assert status["readers_know"] == old.newest_migration
    finally:
        fleet.stop()
        db.dispose()
