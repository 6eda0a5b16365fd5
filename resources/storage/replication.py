"""Can a database failover roll a completed key back? What the primary says about its replicas.

A key completes in the same transaction as the business change; the effect at the downstream
(a charge, a mail) is outside the database and stays. If the database then fails over to a
replica that had not received that commit, the completion is gone while the effect is not: the
request runs again, and unless its first send looks the effect up first it makes it twice
(docs/chaos.md, ``pg-failover``). Whether that can happen is the primary's replication mode:

- ``synchronous_commit`` ``on`` / ``remote_write`` / ``remote_apply`` with a
  ``synchronous_standby_names`` a connected standby satisfies (``sync_state`` ``sync`` or
  ``quorum`` in ``pg_stat_replication``): a commit returns once a standby has it, so a failover
  to that standby keeps every completed key (``remote_write``: unless the standby's own
  operating system crashes at the same time);
- streaming standbys and no synchronous one (or ``synchronous_commit`` ``local`` / ``off``):
  asynchronous, a failover to any of them can lose the last commits;
- ``synchronous_commit = off`` (and no standby): even a crash of the primary itself can lose
  them (the doctor warns; a process does not refuse it);
- no standby this server knows of: a failover cannot be prepared from here, unless a managed
  service replicates underneath (its settings are listed: whether that replication is
  synchronous, e.g. a high-availability standby, or asynchronous, e.g. a read replica
  promoted by hand, cannot be read from inside the database).

:func:`read_replication` reads it (three statements, no privilege needed but for the
standbys' states, which ``pg_monitor`` shows); :func:`require_durable_commits` is the refusal a
process makes at its first use of a Postgres database, as it refuses an evicting Redis.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import text

from resources.errors import AsyncReplication
from resources.storage.queries import load_queries

log = logging.getLogger(__name__)

ACCEPT_ENV = "SEKALI_ACCEPT_ASYNC_REPLICATION"
_Q = load_queries(Path(__file__).with_suffix(".sql"))
MANAGED_PREFIXES = ("rds.", "aurora", "cloudsql.", "azure.", "alloydb", "neon.", "google.")
DURABLE = "durable"
ASYNC = "async"
LOCAL_ONLY = "local_only"
NO_STANDBY = "no_standby"
STANDBY = "standby"


@dataclass(frozen=True)
class Replication:
    """The primary's replication mode as it reports it (see the module)."""

    synchronous_commit: str
    synchronous_standby_names: str
    in_recovery: bool
    standbys: list[dict[str, Any]] = field(default_factory=list)
    managed: dict[str, str] = field(default_factory=dict)

    @property
    def sync_standbys(self) -> list[dict[str, Any]]:
        return [s for s in self.standbys if s.get("sync_state") in ("sync", "quorum")]

    @property
    def mode(self) -> str:
        """``standby`` (this is a replica), ``local_only`` (commits not even flushed here),
        ``durable`` (a synchronous standby has every commit), ``async`` (standbys that may lag),
        ``no_standby``."""
        if self.in_recovery:
            return STANDBY
        waits = self.synchronous_commit in ("on", "remote_write", "remote_apply")
        if waits and self.synchronous_standby_names.strip() and self.sync_standbys:
            return DURABLE
        if self.standbys:
            return ASYNC
        if self.synchronous_commit == "off":
            return LOCAL_ONLY
        return NO_STANDBY

    @property
    def rolls_back(self) -> bool:
        """Whether a failover (or, ``local_only``, a crash) can roll a completed key back."""
        return self.mode in (ASYNC, LOCAL_ONLY)

    @property
    def refused(self) -> bool:
        """What a process refuses at start: an asynchronously replicated primary (a crash-only
        risk, ``local_only``, is the doctor's to report)."""
        return self.mode == ASYNC

    def describe(self) -> str:
        names = self.synchronous_standby_names or "''"
        states = ", ".join(f"{s.get('name')}: {s.get('sync_state')}" for s in self.standbys)
        head = (f"synchronous_commit={self.synchronous_commit}, "
                f"synchronous_standby_names={names}, {len(self.standbys)} streaming standby(s)"
                + (f" ({states})" if states else ""))
        why = {
            STANDBY: "this server is a standby in recovery: point DATABASE_URL at the primary",
            LOCAL_ONLY: "a commit returns before it is flushed even here: a crash of the "
                        "primary can roll completed keys back, a failover too",
            DURABLE: "a commit returns once a synchronous standby has it: a failover to it "
                     "keeps every completed key",
            ASYNC: "no standby confirms commits: a failover to a lagging one rolls back the "
                   "keys completed in its lag, while their effects stay",
            NO_STANDBY: "no standby streams from this server: nothing here can be failed over "
                        "to; a platform that replicates underneath decides for itself",
        }[self.mode]
        managed = (f"; managed service settings seen: {', '.join(sorted(self.managed))[:200]}"
                   " (a high-availability standby there is synchronous, a read replica "
                   "promoted by hand is not: check which failover the platform makes)"
                   if self.managed else "")
        return f"{head}: {why}{managed}"


def read_replication(conn: Any) -> Replication:
    """The mode from a Postgres connection (any user; the standbys' states need
    ``pg_monitor`` or superuser, else they read as unknown)."""
    row = conn.execute(text(_Q["commit_mode"])).one()
    standbys = [
        {"name": r.application_name, "state": r.state, "sync_state": r.sync_state,
         "replay_lag": None if r.replay_lag is None else r.replay_lag.total_seconds()}
        for r in conn.execute(text(_Q["standbys"]))
    ]
    patterns = [f"{prefix}%" for prefix in MANAGED_PREFIXES]
    managed = {str(r.name): str(r.setting) for r in conn.execute(
        text(_Q["managed_settings"]), {"patterns": patterns})}
    return Replication(str(row[0]), str(row[1]), bool(row[2]), standbys, managed)


_checked: set[str] = set()
_checked_guard = threading.Lock()


def accepted() -> bool:
    return os.environ.get(ACCEPT_ENV, "").strip() == "1"


def require_durable_commits(db: Any) -> None:
    """Refuse (:class:`AsyncReplication`, permanent) a Postgres primary whose completed keys a
    failover can roll back, unless ``SEKALI_ACCEPT_ASYNC_REPLICATION=1`` (then one warning);
    checked once per database URL per process. SQLite has no replicas: nothing to check."""
    if not db.sql_dialect.has_replicas:
        return
    url = str(db.engine.url)
    with _checked_guard:
        if url in _checked:
            return
    with db.statement() as conn:
        found = read_replication(conn)
    if found.refused:
        if not accepted():
            raise AsyncReplication(found.describe())
        log.warning("%s accepted asynchronous replication: %s", ACCEPT_ENV, found.describe())
    with _checked_guard:
        _checked.add(url)


__all__ = [
    "ACCEPT_ENV",
    "Replication",
    "accepted",
    "read_replication",
    "require_durable_commits",
]
