"""Durability across a database failover: a private primary with a streaming asynchronous
replica (the sandbox's Postgres launcher), the replica lagging, the primary killed and the
replica promoted under load.

- ``pg-failover`` in the chaos harness: the keys completed in the replica's lag are rolled back
  while their charges and mails stay; the rolled-back requests run again. Without the guard
  (``SEKALI_LOOKUP_FIRST``: the first send does not look its effect up first) they charge and
  mail twice; with it, never.
- The primary says what it is: ``read_replication`` and the doctor's ``replication`` check
  report the mode, and a process refuses an asynchronously replicated primary at its first use
  unless ``SEKALI_ACCEPT_ASYNC_REPLICATION=1``, as it refuses an evicting Redis.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from sqlalchemy import text

from engine.health.diagnosis import DiagnosisSetup, check_replication
from engine.registry import JOB_TYPES
from proof.chaos import ChaosConfig, ChaosReport, run_chaos
from resources.errors import AsyncReplication
from resources.storage import replication
from resources.storage.db import Database
from resources.storage.migrations import ensure_schema
from resources.storage.replication import ACCEPT_ENV, read_replication, require_durable_commits
from sandbox.postgres_server import PostgresServer

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


def _failover_run(monkeypatch: pytest.MonkeyPatch, guard: str, seed: int) -> ChaosReport:
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.setenv("SEKALI_LOOKUP_FIRST", f"charge_payment={guard},send_email={guard}")
    return run_chaos(ChaosConfig(requests=200, workers=2, redelivery=2, faults=("pg-failover",),
                                 backend="postgres", seed=seed, timeout=300))


def _duplicates(report: ChaosReport) -> int:
    total = next(r for r in report.rows if r["fault"] == "all")
    return int(total["duplicates"]) + int(total["smtp_resends"])


@pytest.mark.timeout(900)
def test_pg_failover_repeats_effects_without_the_guard_and_none_with_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Catches: a first send that trusts a ledger a failover can roll back (8 of 8 orders
    charged twice, 8 of 8 mails sent twice in the probe), and a harness whose failover does
    not roll anything back (then both runs would be clean and prove nothing)."""
    bare = _failover_run(monkeypatch, "0", seed=4)
    why = "\n".join(bare.violations[:10]) + f"\n{bare.stats}"
    assert bare.stats["pg-failover"] == 1 and not bare.stats.get("pg-failover_failed"), why
    assert bare.stats["pg-failover_redelivered"] >= 1, why
    assert _duplicates(bare) >= 1, why
    assert any(v.startswith(("duplicate effect", "duplicate mail")) for v in bare.violations)

    guarded = _failover_run(monkeypatch, "1", seed=4)
    why = "\n".join(guarded.violations[:10]) + f"\n{guarded.stats}"
    assert guarded.stats["pg-failover"] == 1 and not guarded.stats.get("pg-failover_failed")
    assert guarded.stats["pg-failover_redelivered"] >= 1, why
    assert guarded.ok and _duplicates(guarded) == 0, why
    total = next(r for r in guarded.rows if r["fault"] == "all")
    assert total["lost"] == 0, why


@pytest.fixture
def replicated() -> Iterator[tuple[PostgresServer, PostgresServer]]:
    primary = PostgresServer().start()
    standby = None
    try:
        standby = primary.replica()
        yield primary, standby
    finally:
        if standby is not None:
            standby.stop()
        primary.stop()


def _mode(db: Database) -> replication.Replication:
    deadline = time.monotonic() + 30
    while True:
        with db.statement() as conn:
            found = read_replication(conn)
        if found.standbys or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_the_primary_says_whether_a_failover_can_roll_a_key_back(
    replicated: tuple[PostgresServer, PostgresServer], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Catches: a doctor silent on asynchronous replication, a process that starts against it
    without the operator's consent, and a check that cannot tell a synchronous standby."""
    primary, standby = replicated
    db = Database.from_url(primary.url())
    try:
        found = _mode(db)
        assert found.mode == "async" and found.refused, found
        monkeypatch.delenv(ACCEPT_ENV, raising=False)
        monkeypatch.setattr(replication, "_checked", set())
        with pytest.raises(AsyncReplication, match="synchronous_standby_names"):
            require_durable_commits(db)
        setup = DiagnosisSetup(db=db, job_types=JOB_TYPES, lease_seconds=60)
        finding = check_replication(setup)
        assert not finding.passed and finding.severity == "ERROR", finding
        assert "CAN be rolled back" in finding.found and "charge_payment" in finding.found
        monkeypatch.setenv(ACCEPT_ENV, "1")
        require_durable_commits(db)  # accepted: a warning, no refusal
        assert check_replication(setup).severity == "WARN"

        with db.statement() as conn:
            conn.execute(text("ALTER SYSTEM SET synchronous_standby_names = '*'"))
            conn.execute(text("ALTER DATABASE postgres SET synchronous_commit = 'on'"))
            conn.execute(text("SELECT pg_reload_conf()"))
        db.dispose()
        deadline = time.monotonic() + 30
        while _mode(db).mode != "durable" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _mode(db).mode == "durable", _mode(db)
        monkeypatch.delenv(ACCEPT_ENV)
        monkeypatch.setattr(replication, "_checked", set())
        require_durable_commits(db)
        assert check_replication(setup).passed
    finally:
        db.dispose()
    assert standby.postmaster_pid() is not None


def test_ensure_schema_refuses_an_async_primary_at_first_use(
    replicated: tuple[PostgresServer, PostgresServer], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The refusal sits where a process first opens its database (beside the schema check)."""
    primary, _ = replicated
    db = Database.from_url(primary.url())
    try:
        _mode(db)
        monkeypatch.delenv(ACCEPT_ENV, raising=False)
        monkeypatch.setattr(replication, "_checked", set())
        monkeypatch.setenv("SEKALI_AUTO_MIGRATE", "1")
        with pytest.raises(AsyncReplication):
            ensure_schema(db)
    finally:
        db.dispose()
