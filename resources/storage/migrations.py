"""Apply the ordered DDL files in ``sql/`` (the only truth of the schema), say what is applied
and pending, and decide at a process's start whether it may run on the schema it finds.

The rule is expand/contract (``sql/README``, ``docs/upgrades.md``): a release only adds what the
previous release can live with, because during a rolling upgrade both run against one
database. Each applied file is recorded in ``sekali_schema_migrations`` with a checksum, so
applying twice is a no-op and an edited file that was already applied is reported instead of
silently skipped; the DDL is idempotent too (``IF NOT EXISTS``), so a file can always run again.
How each database applies a file, and how Postgres keeps writers going meanwhile:
:mod:`resources.storage.migration_runners`; the files and their directives:
:mod:`resources.storage.migration_files`.

Who applies: the operator (``sekali db upgrade``), or a process when it first opens the
database if ``SEKALI_AUTO_MIGRATE`` allows (default: on SQLite, the embedded default, yes; on
Postgres no). :func:`ensure_schema` is that check: a schema missing migrations this process
needs is applied or refused with the command that fixes it; a schema with migrations this
process does not know (a newer release upgraded it) is said in one log line and used as this
process knows it, unless the operator declared every process newer (:func:`contract`), in
which case it refuses to start.

What the newest migration every running process knows (:func:`contract`, the "contract step")
decides: a value old readers cannot read (a new request status) is written only once every
process knows the migration that introduced it (:class:`ReaderFloor`).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from resources.errors import SekaliError
from resources.storage.db import Database
from resources.storage.migration_files import (
    PLACEHOLDERS,
    Migration,
    load_migrations,
    parse_statements,
    render,
    split_statements,
    sql_dir,
)
from resources.storage.migration_runners import (
    MigrationFailed,
    MigrationPlan,
    Record,
    read_readers_know,
    read_records,
    runner_for,
)
from resources.storage.replication import require_durable_commits
from resources.storage.settings import MigrationSettings

log = logging.getLogger(__name__)

__all__ = [
    "PLACEHOLDERS",
    "ContractPending",
    "Migration",
    "MigrationDrift",
    "MigrationFailed",
    "NoSchema",
    "ReaderFloor",
    "SchemaBehind",
    "SchemaStatus",
    "SchemaTooNew",
    "applied",
    "contract",
    "ensure_schema",
    "load_migrations",
    "parse_statements",
    "plan",
    "render",
    "split_statements",
    "sql_dir",
    "status",
    "upgrade",
]


class MigrationDrift(SekaliError, RuntimeError):
    """A migration already applied has a different checksum from the file on disk.

    Permanent: restore the file as it was applied and put the change in a new ``NNNN_`` file
    (or, for an edit that changes nothing a database holds, list the old checksum in the file's
    ``-- sekali: accepts`` line).
    """

    permanent = True


class SchemaBehind(SekaliError):
    """The database lacks migrations this release needs, and this process may not apply them.

    Run ``sekali db upgrade`` (docs/upgrades.md), or let processes apply them on start with
    ``SEKALI_AUTO_MIGRATE=1``.
    """

    permanent = True

    def __init__(self, pending: list[str]) -> None:
        super().__init__(
            f"the database lacks {len(pending)} migration(s) this release needs "
            f"({', '.join(pending)}): run `sekali db upgrade` (docs/upgrades.md), or set "
            "SEKALI_AUTO_MIGRATE=1 to let processes apply them when they start"
        )
        self.pending = pending


class ContractPending(SekaliError):
    """A pending migration removes or tightens what processes older than a migration use, and
    the operator has not declared them gone. The migrations before it were applied.

    Once no process of the older release runs: ``sekali db contract``, then ``sekali db
    upgrade`` again.
    """

    permanent = True

    def __init__(self, migration: str, requires: str, readers_know: str | None) -> None:
        super().__init__(
            f"sql/{migration} removes or tightens what processes older than sql/{requires} "
            f"use, and every process is only known to know {readers_know or 'nothing yet'}: "
            "once none of them runs, `sekali db contract`, then `sekali db upgrade` again"
        )
        self.migration = migration
        self.requires = requires


class SchemaTooNew(SekaliError):
    """The database was declared (``sekali db contract``) to serve only processes that know a
    migration this release does not ship: a newer release may have removed what this one needs.
    Run this process from that release or later."""

    permanent = True

    def __init__(self, required: str, newest_known: str) -> None:
        super().__init__(
            f"the database serves only processes that know sql/{required} (`sekali db "
            f"contract` was run by a newer release); this release knows up to "
            f"sql/{newest_known}: run this process from that newer release"
        )
        self.required = required
        self.newest_known = newest_known


class NoSchema(SekaliError):
    """The database holds no sekali schema yet (no migration was ever applied to it, or the
    SQLite file does not exist): create it with ``sekali db upgrade``, or start ``sekali dev``,
    which applies the migrations itself."""

    permanent = True

    def __init__(self, where: str) -> None:
        super().__init__(
            f"no sekali database at {where} yet: create it with `sekali db upgrade` (or start "
            "`sekali dev`, which creates it)"
        )
        self.where = where


def upgrade(
    db: Database,
    directory: Path | None = None,
    *,
    settings: MigrationSettings | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[str]:
    """Apply every migration not yet recorded; return the names recorded now, in order (a
    replaced file among them). Safe to race: upgraders queue on one lock, and each migration is
    re-checked under it. Each migration commits on its own, so a failure keeps the ones before.
    """
    settings = settings or MigrationSettings.from_env()
    migrations = load_migrations(db.dialect, directory)
    runner = runner_for(db, settings, progress)
    done_now: list[str] = []
    with runner.exclusive():
        runner.prepare(max((m.name for m in migrations), default="0000"))
        records = runner.records()
        _check_drift(migrations, records)
        floor = runner.readers_know()
        for step in _steps(migrations, records):
            required = step.migration.requires
            if step.run and required and (floor is None or floor < required):
                raise ContractPending(step.migration.name, required, floor)
            if not step.run:
                runner.record_replaced(step.replaced, step.migration)
                done_now += [m.name for m in step.replaced]
            elif runner.apply(step.migration, step.replaced):
                done_now += [m.name for m in step.replaced] + [step.migration.name]
                if progress is not None:
                    progress(f"applied {step.migration.name}"
                             + "".join(f" (replacing {m.name})" for m in step.replaced))
    return sorted(done_now)


@dataclass(frozen=True)
class _Step:
    migration: Migration
    replaced: list[Migration]
    """Pending files ``migration`` does the work of: recorded as replaced, never run."""
    run: bool = True
    """False: ``migration`` was applied already; only what it replaces is recorded."""


def _steps(migrations: list[Migration], records: dict[str, Record]) -> list[_Step]:
    pending = [m for m in migrations if m.name not in records]
    replaced_by = {name: m.name for m in migrations for name in m.replaces}
    steps = []
    for m in migrations:
        replaced = [p for p in pending if p.name in m.replaces]
        if m.name in records:
            if replaced:
                steps.append(_Step(m, replaced, run=False))
        elif m.name not in replaced_by:
            steps.append(_Step(m, replaced))
    return steps


def _check_drift(migrations: list[Migration], records: dict[str, Record]) -> None:
    for migration in migrations:
        record = records.get(migration.name)
        if record is not None and not migration.matches(record.checksum):
            raise MigrationDrift(
                f"sql/{migration.name} changed after it was applied "
                f"({record.checksum} -> {migration.checksum}); add a new file instead"
            )


def applied(db: Database) -> list[str]:
    """The names recorded as applied (replaced files included), in order."""
    with db.statement() as conn:
        return sorted(read_records(conn))


@dataclass(frozen=True)
class SchemaStatus:
    """What ``sekali db status`` shows."""

    dialect: str
    applied: list[dict[str, Any]]
    """name, applied_at and, for a file another one did the work of, ``replaced_by``."""
    pending: list[dict[str, Any]]
    """name and, where a later pending file will do its work, ``replaced_by``."""
    unknown: list[str]
    """Applied, but not shipped with this release: a newer release upgraded the database."""
    readers_know: str | None
    """The newest migration every running process is declared to know."""
    newest_known: str
    drift: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def status(db: Database, directory: Path | None = None) -> SchemaStatus:
    migrations = load_migrations(db.dialect, directory)
    with db.statement() as conn:
        records = read_records(conn)
        floor = read_readers_know(conn)
    known = {m.name for m in migrations}
    replacing = {name: m.name for m in migrations for name in m.replaces}
    return SchemaStatus(
        dialect=db.dialect,
        applied=[
            {"name": r.name, "applied_at": r.applied_at, "replaced_by": r.replaced_by}
            for r in sorted(records.values(), key=lambda r: r.name)
        ],
        pending=[
            {"name": m.name, "replaced_by": replacing.get(m.name)}
            for m in migrations if m.name not in records
        ],
        unknown=sorted(set(records) - known),
        readers_know=floor,
        newest_known=max(known) if known else "",
        drift=[m.name for m in migrations
               if m.name in records and not m.matches(records[m.name].checksum)],
    )


def plan(db: Database, directory: Path | None = None,
         settings: MigrationSettings | None = None) -> list[MigrationPlan]:
    """What ``upgrade`` would run now, statement by statement, with the locks each takes."""
    settings = settings or MigrationSettings.from_env()
    migrations = load_migrations(db.dialect, directory)
    with db.statement() as conn:
        records = read_records(conn)
    runner = runner_for(db, settings)
    out = []
    for step in _steps(migrations, records):
        names = ", ".join(m.name for m in step.replaced)
        if not step.run:
            out.append(MigrationPlan(names, f"not run: {step.migration.name} did its work", []))
            continue
        described = runner.describe(step.migration)
        if step.replaced:
            described = MigrationPlan(described.name, f"{described.how}; does the work of "
                                      f"{names}, which is not run", described.statements)
        out.append(described)
    return out


def contract(db: Database, directory: Path | None = None) -> str:
    """Declare that every process running against ``db`` is of this release (the contract
    step of a rolling upgrade, once no older process is left): records the newest migration
    this release ships as known by all, so values older releases cannot read may now be
    written, and the files that remove or tighten what older releases used may run. Refuses
    (:class:`SchemaBehind`) while other migrations are pending. Returns the name."""
    migrations = load_migrations(db.dialect, directory)
    with db.statement() as conn:
        records = read_records(conn)
    replaced = {name for m in migrations for name in m.replaces}
    pending = [m.name for m in migrations
               if m.name not in records and m.name not in replaced and not m.requires]
    if pending:
        raise SchemaBehind(pending)
    newest = max(m.name for m in migrations)
    runner = runner_for(db, MigrationSettings.from_env())
    with runner.exclusive():
        runner.set_readers_know(newest)
    return newest


_checked: weakref.WeakSet[Database] = weakref.WeakSet()
_checked_lock = threading.Lock()


def ensure_schema(
    db: Database,
    *,
    settings: MigrationSettings | None = None,
    directory: Path | None = None,
) -> None:
    """At a process's first use of ``db``: make sure this release can run on its schema (once
    per Database per process; cheap afterwards).

    - Migrations this release needs are missing: applied when ``SEKALI_AUTO_MIGRATE`` allows
      (default: on SQLite), else :class:`SchemaBehind` naming them and the command.
    - Migrations this release does not know were applied (a newer release upgraded the
      database during a rolling upgrade): one warning line; this process keeps to what it knows,
      which the newer release's migrations left working (expand/contract).
    - The database was declared to serve only processes that know a migration this release
      does not ship (:func:`contract` run by a newer release): :class:`SchemaTooNew`.
    - A Postgres primary whose completed keys a failover can roll back (asynchronous standbys):
      ``AsyncReplication`` unless ``SEKALI_ACCEPT_ASYNC_REPLICATION=1``
      (:func:`resources.storage.replication.require_durable_commits`).
    """
    with _checked_lock:
        if db in _checked:
            return
        settings = settings or MigrationSettings.from_env()
        migrations = load_migrations(db.dialect, directory)
        known = {m.name for m in migrations}
        with db.statement() as conn:
            records = read_records(conn)
            floor = read_readers_know(conn)
        if floor is not None and floor not in known and floor > max(known):
            raise SchemaTooNew(floor, max(known))
        unknown = sorted(set(records) - known)
        if unknown:
            log.warning(
                "the database has %d migration(s) this release does not know (%s): a newer "
                "release upgraded it; running with the schema this release knows",
                len(unknown), ", ".join(unknown),
            )
        pending = [m.name for m in migrations if m.name not in records]
        if pending:
            if not settings.auto_for(db.dialect):
                raise SchemaBehind(pending)
            upgrade(db, directory, settings=settings)
        require_durable_commits(db)
        _checked.add(db)


class ReaderFloor:
    """Does every process that may read the database know migration ``name``?

    True once the newest migration every process is declared to know (:func:`contract`, or a
    database this release created) is ``name`` or later. Writers of values an older release
    cannot read (a request status it has no name for) ask this first. Cached: a True answer
    never changes (the floor only rises); a False one is asked again after ``recheck`` seconds.
    """

    def __init__(self, db: Database, *, recheck: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.db = db
        self.recheck = recheck
        self.clock = clock
        self._floor: str | None = None
        self._read_at: float | None = None
        self._lock = threading.Lock()

    def knows(self, name: str) -> bool:
        with self._lock:
            if self._floor is not None and self._floor >= name:
                return True
            now = self.clock()
            if self._read_at is None or now - self._read_at >= self.recheck:
                with self.db.statement() as conn:
                    self._floor = read_readers_know(conn)
                self._read_at = now
            return self._floor is not None and self._floor >= name
