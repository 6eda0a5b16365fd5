"""Upgrades that lose nothing and stop nothing, piece by piece (the whole, with the previous
release's processes running: ``tests/test_rolling_upgrade.py``).

Databases start where a real one would: at the previous release (its own ``sql/``, from the
pinned archive in ``tests/releases``), at the release before 0110 (``sql/`` through 0095: the
start of 0110's expand and contract), or at the state the development line reached before
0110 had a successor (0110 applied, its ``claim_rank NOT NULL`` in force).
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import exc as sa_exc
from sqlalchemy import text

from benchmarks.upgrade import PREVIOUS_RELEASE_INSERT
from cli.main import main as sekali
from engine.requests import RequestStore
from pipelines.intake import enqueue
from resources.storage import ddl
from resources.storage.db import Database
from resources.storage.migration_files import sql_through
from resources.storage.migrations import (
    ContractPending,
    MigrationFailed,
    SchemaBehind,
    SchemaTooNew,
    applied,
    contract,
    ensure_schema,
    load_migrations,
    status,
    upgrade,
)
from resources.storage.settings import MigrationSettings
from tests.conftest import drop_postgres_schema, postgres_schema_url
from tests.releases import extract, manifest


def previous_release_sql(tmp_path: Path) -> Path:
    return extract(tmp_path).root / "sql"


def before_flow_intake(tmp_path: Path) -> Path:
    """sql/ as the release before 0110 shipped it (newest 0095_retention, unchanged since):
    the start of the tests of 0110's expand and contract, whatever release is pinned now."""
    return sql_through("0095", tmp_path / "sql-0095")


def before_the_successor(tmp_path: Path) -> Path:
    """sql/ as it stood with 0110 and no successor: this release's files up to 0115."""
    return sql_through("0115", tmp_path / "sql-0115")


@pytest.fixture
def fresh(db_url: str) -> Iterator[Database]:
    """An empty database on each backend (nothing applied)."""
    db = Database.from_url(db_url)
    try:
        yield db
    finally:
        db.dispose()


def old_insert(db: Database, key: str, at: float = 100.0) -> int:
    with db.transaction() as conn:
        return int(conn.execute(text(PREVIOUS_RELEASE_INSERT), {
            "job_type": "send_email", "key": key, "payload": "{}", "hash": "h",
            "queue": "light", "cid": None, "now": at, "traceparent": None,
        }).scalar_one())


def test_an_old_producers_insert_is_accepted_after_the_upgrade(
    fresh: Database, tmp_path: Path
) -> None:
    """Catches: a new column the previous release cannot fill (0110's claim_rank NOT NULL with
    no default failed every old enqueue once a new process had migrated)."""
    upgrade(fresh, before_the_successor(tmp_path))
    with pytest.raises(sa_exc.IntegrityError):  # the state 0110 left: the old insert fails
        old_insert(fresh, "old:before")
    upgrade(fresh)
    first = old_insert(fresh, "old:1", at=100.0)
    second = old_insert(fresh, "old:2", at=50.0)
    store = RequestStore(fresh)
    made = store.get(first)
    assert made is not None and made.claim_rank == made.created_at == 100.0
    assert [r.id for r in store.claim_for_launch(10)] == [second, first]  # by arrival


def test_no_id_is_reused_after_a_purge_and_the_upgrade(fresh: Database, tmp_path: Path) -> None:
    """Request and DLQ ids never go back: the highest rows purged at the previous release,
    then the upgrade, then new rows. Catches: a SQLite table rebuild resetting the
    AUTOINCREMENT counter to MAX(id), so a new request took the id that old attempts and dead
    letters still name."""
    upgrade(fresh, before_flow_intake(tmp_path))
    ids = [old_insert(fresh, f"old:{i}") for i in range(5)]
    with fresh.transaction() as conn:
        for request_id in ids[-2:]:
            _dead_letter(conn, request_id)
        conn.execute(text("DELETE FROM dlq_records WHERE request_id = :r"), {"r": ids[-1]})
        conn.execute(text("DELETE FROM job_requests WHERE id >= :r"), {"r": ids[-2]})
        high_dlq = conn.execute(text("SELECT MAX(id) FROM dlq_records")).scalar_one()
    upgrade(fresh)
    new = RequestStore(fresh).enqueue("send_email", "new", {}, queue="light")
    assert new.id > ids[-1]
    with fresh.transaction() as conn:
        assert _dead_letter(conn, new.id) > high_dlq + 1


def test_a_counter_lowered_before_is_healed_from_the_ids_still_held(
    fresh: Database, tmp_path: Path
) -> None:
    """A database that ran 0110 (its SQLite rebuild lowered the counter after a purge) gets it
    back from the request ids dead letters and attempts still hold. Catches: a new request
    taking the id of a purged one an open dead letter points at."""
    upgrade(fresh, before_flow_intake(tmp_path))
    ids = [old_insert(fresh, f"old:{i}") for i in range(5)]
    with fresh.transaction() as conn:
        _dead_letter(conn, ids[-1])
        conn.execute(text("DELETE FROM job_requests WHERE id >= :r"), {"r": ids[-2]})
    upgrade(fresh, before_the_successor(tmp_path))
    if not fresh.is_postgres:  # what 0110's rebuild did under the runner of its day
        with fresh.transaction() as conn:
            conn.exec_driver_sql("UPDATE sqlite_sequence SET seq = (SELECT MAX(id) FROM"
                                 " job_requests) WHERE name = 'job_requests'")
    upgrade(fresh)
    new = RequestStore(fresh).enqueue("send_email", "new", {}, queue="light")
    assert new.id > ids[-1]


def _dead_letter(conn: Any, request_id: int) -> int:
    return int(conn.execute(text(
        "INSERT INTO dlq_records (dedupe_key, job_type, request_id, error_class, error_type,"
        " fingerprint, first_failed_at, last_failed_at, status_changed_at, created_at,"
        " updated_at) VALUES (:d, 'send_email', :r, 'permanent', 'E', 'f', 0, 0, 0, 0, 0)"
        " RETURNING id"), {"d": f"dl:{request_id}:{time.time_ns()}", "r": request_id},
    ).scalar_one())


def test_no_migration_lowers_an_autoincrement_counter(sqlite_url: str, tmp_path: Path) -> None:
    """From every point of the history: counters set high (the highest rows purged), the rest
    applied, no counter lower than it was. Catches any future table rebuild on SQLite that
    forgets sqlite_sequence, not only the one 0110 did."""
    names = [m.name for m in load_migrations("sqlite")]
    source = Path(__file__).resolve().parent.parent / "sql"
    for k in range(1, len(names)):
        directory = tmp_path / f"first-{k}"
        directory.mkdir()
        for path in source.glob("0*.sql"):
            if path.name.split(".")[0] in names[:k]:
                shutil.copy(path, directory / path.name)
        db = Database.from_url(f"sqlite:///{tmp_path / f'{k}.db'}")
        upgrade(db, directory)
        with db.transaction() as conn:
            tables = [r[0] for r in conn.exec_driver_sql(
                "SELECT name FROM sqlite_master WHERE type = 'table'"
                " AND sql LIKE '%AUTOINCREMENT%'")]
            if not tables:
                continue
            conn.exec_driver_sql("DELETE FROM sqlite_sequence")
            for table in tables:
                conn.execute(text("INSERT INTO sqlite_sequence (name, seq) VALUES (:n, 10000)"),
                             {"n": table})
        upgrade(db)
        with db.statement() as conn:
            kept = dict(conn.exec_driver_sql("SELECT name, seq FROM sqlite_sequence").all())
        db.dispose()
        assert {t: kept.get(t) for t in tables} == dict.fromkeys(tables, 10000), names[k - 1]


def _newer_than_the_previous_release(dialect: str) -> list[str]:
    released = set(manifest()["migrations"])  # type: ignore[call-overload]
    migrations = load_migrations(dialect)
    replaced = {name for m in migrations for name in m.replaces}
    return [m.name for m in migrations if m.name not in released and m.name not in replaced]


def test_every_migration_of_this_release_runs_twice(db: Database) -> None:
    """Each file applied again leaves the schema as it was. Catches: an unguarded
    ``ADD COLUMN`` (0105 and 0115 had one), a constraint added twice, a trigger created twice:
    a half-recorded upgrade could then never finish."""
    before = schema_of(db)
    for name in _newer_than_the_previous_release(db.dialect):
        with db.transaction() as conn:
            conn.execute(text("DELETE FROM sekali_schema_migrations WHERE name = :n"),
                         {"n": name})
        assert upgrade(db) == [name]
        assert schema_of(db) == before, name


def test_the_schema_is_the_same_whichever_state_it_was_upgraded_from(
    db_url: str, tmp_path: Path
) -> None:
    """Fresh, from the previous release, and from the state 0110 left: one schema (columns,
    nullability, defaults, indexes, constraints, triggers). Catches: a replacing file or a
    rebuild that forgets what another path gets (an index, a trigger, a column)."""
    schemas = []
    for start in (None, previous_release_sql(tmp_path), before_the_successor(tmp_path)):
        url, cleanup = _another_database(db_url, tmp_path)
        db = Database.from_url(url)
        try:
            if start is not None:
                upgrade(db, start)
            upgrade(db)
            schemas.append(schema_of(db))
        finally:
            db.dispose()
            cleanup()
    assert schemas[1] == schemas[0]
    assert schemas[2] == schemas[0]


def _another_database(db_url: str, tmp_path: Path) -> tuple[str, Any]:
    if db_url.startswith("sqlite"):
        return f"sqlite:///{tmp_path / f'{time.time_ns()}.db'}", lambda: None
    url, schema = postgres_schema_url()
    return url, lambda: drop_postgres_schema(schema)


def schema_of(db: Database) -> dict[str, list[tuple[Any, ...]]]:
    """The schema as a comparable value (the runner's own tables left out)."""
    with db.statement() as conn:
        if not db.is_postgres:
            rows = conn.exec_driver_sql(
                "SELECT type, name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"
                " AND name NOT LIKE 'sekali_schema_%' ORDER BY type, name").all()
            return {"objects": [(t, n, " ".join((s or "").split())) for t, n, s in rows]}
        schema = conn.exec_driver_sql("SELECT current_schema()").scalar_one()
        queries = {
            "columns": "SELECT table_name, column_name, data_type, is_nullable, column_default"
                       " FROM information_schema.columns WHERE table_schema = current_schema()"
                       " AND table_name NOT LIKE 'sekali_schema_%' ORDER BY 1, 2",
            "indexes": "SELECT indexname, indexdef FROM pg_indexes"
                       " WHERE schemaname = current_schema() ORDER BY 1",
            "constraints": "SELECT c.conrelid::regclass::text, c.conname,"
                           " pg_get_constraintdef(c.oid), c.convalidated FROM pg_constraint c"
                           " JOIN pg_namespace n ON n.oid = c.connamespace"
                           " WHERE n.nspname = current_schema() ORDER BY 1, 2",
            "triggers": "SELECT t.tgname, pg_get_triggerdef(t.oid) FROM pg_trigger t"
                        " JOIN pg_class c ON c.oid = t.tgrelid JOIN pg_namespace n"
                        " ON n.oid = c.relnamespace WHERE n.nspname = current_schema()"
                        " AND NOT t.tgisinternal ORDER BY 1",
        }
        return {
            what: [tuple(str(v).replace(f"{schema}.", "") for v in row)
                   for row in conn.execute(text(sql))]
            for what, sql in queries.items()
        }


def _debounced(db: Database, group: str, t0: float) -> list[int]:
    return [
        enqueue("rebuild_report_cache", {"report": "stock_levels", "as_of": f"{group}-{i}"},
                db=db, clock=lambda i=i: t0 + i).id  # type: ignore[misc]
        for i in range(3)
    ]


def test_coalesced_is_written_only_after_the_contract_step(fresh: Database, tmp_path: Path
                                                            ) -> None:
    """Upgraded from the previous release (whose processes may still read requests and have no
    name for ``coalesced``): debounced requests are claimed one by one, as that release claims
    them; after ``sekali db contract`` they coalesce. Catches: a new status written while an
    old reader may meet it (``ValueError: 'coalesced' is not a valid RequestStatus``)."""
    upgrade(fresh, before_flow_intake(tmp_path))
    upgrade(fresh)
    t0 = time.time()
    first = _debounced(fresh, "a", t0)
    late = RequestStore(fresh, clock=lambda: t0 + 1000)
    assert sorted(r.id for r in late.claim_for_launch(10)) == first
    assert late.counts()["coalesced"] == 0
    assert contract(fresh) == max(m.name for m in load_migrations(fresh.dialect))
    second = _debounced(fresh, "b", t0)
    later = RequestStore(fresh, clock=lambda: t0 + 1000)
    assert [r.id for r in later.claim_for_launch(10)] == [second[-1]]
    assert later.counts()["coalesced"] == 2


def test_a_contracting_file_waits_for_the_contract_step(fresh: Database, tmp_path: Path
                                                         ) -> None:
    """A file that removes or tightens (``-- sekali: requires``) is not applied while a process
    of the older release may run; the files before it are. Catches: a contraction applied in the
    same upgrade that expanded, under the previous release's feet."""
    directory = tmp_path / "sql"
    shutil.copytree(Path(__file__).resolve().parent.parent / "sql", directory)
    (directory / "9990_contract_probe.sql").write_text(
        "-- sekali: requires 0115_request_amends\n"
        "CREATE TABLE IF NOT EXISTS contract_probe (id INTEGER);\n"
    )
    upgrade(fresh, before_flow_intake(tmp_path))
    with pytest.raises(ContractPending, match="sekali db contract"):
        upgrade(fresh, directory)
    assert "0115_request_amends" in applied(fresh) and "9990_contract_probe" not in applied(fresh)
    assert contract(fresh, directory) == "9990_contract_probe"
    assert upgrade(fresh, directory) == ["9990_contract_probe"]


def test_a_newer_schema_is_one_warning_until_it_is_contracted(
    db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A process of this release on a database a newer release upgraded: one warning line, and
    it works; once the newer release declared every process newer (its contract step), this
    one refuses to start, naming the fix. Catches: an old process failing on a schema it could
    serve, or running on one contracted away from it."""
    db = Database.from_url(db_url)
    upgrade(db)
    with db.transaction() as conn:
        conn.execute(text("INSERT INTO sekali_schema_migrations (name, checksum, applied_at)"
                          " VALUES ('9999_from_the_future', 'x', 0)"))
    with caplog.at_level(logging.WARNING, logger="resources.storage.migrations"):
        ensure_schema(db)
        ensure_schema(db)
    warned = [r.getMessage() for r in caplog.records if "9999_from_the_future" in r.getMessage()]
    assert len(warned) == 1 and "\n" not in warned[0]
    assert enqueue("send_email", {"template": "welcome", "user_id": "u1", "date": "2026-12-01",
                                  "to": "u1@example.com"}, db=db).created
    with db.transaction() as conn:
        conn.execute(text("UPDATE sekali_schema_state SET value = '9999_from_the_future'"))
    again = Database.from_url(db_url)  # a process starting now
    with pytest.raises(SchemaTooNew, match="run this process from that newer release"):
        ensure_schema(again)
    again.dispose()
    db.dispose()


def test_processes_apply_nothing_on_postgres_unless_told(
    fresh: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On Postgres (production) a process finding migrations pending refuses, naming the
    command; ``SEKALI_AUTO_MIGRATE=1`` lets it apply them; on SQLite (embedded) it applies
    them unasked, so the README's first command just works. Catches: a new process switching
    every old one off by migrating on start."""
    monkeypatch.delenv("SEKALI_AUTO_MIGRATE", raising=False)
    if fresh.is_postgres:
        with pytest.raises(SchemaBehind, match="sekali db upgrade"):
            ensure_schema(fresh)
        assert applied(fresh) == []
        monkeypatch.setenv("SEKALI_AUTO_MIGRATE", "1")
    ensure_schema(fresh)
    assert applied(fresh) == sorted(m.name for m in load_migrations(fresh.dialect))


def test_status_and_dry_run_show_the_pending_work(
    fresh: Database, db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``db status`` lists applied and pending migrations; ``db upgrade --dry-run`` prints each
    statement with the locks it takes and applies nothing; ``db contract`` raises the floor."""
    upgrade(fresh, before_flow_intake(tmp_path))

    def run(*args: str) -> Any:
        code = sekali(["db", *args, "--url", db_url])
        out = capsys.readouterr().out
        assert code == 0, out
        return __import__("json").loads(out) if "--json" in args else out

    found = run("status", "--json")
    newest = "0095_retention"
    assert found["applied"][-1]["name"] == newest and found["readers_know"] == newest
    pending = {p["name"]: p["replaced_by"] for p in found["pending"]}
    successor = "0121_flow_intake_online" if fresh.is_postgres else "0120_flow_intake_compat"
    assert pending["0110_flow_intake"] == successor
    assert {"0105_request_versions", "0115_request_amends", successor} <= set(pending)

    planned = {p["name"]: p for p in run("upgrade", "--dry-run", "--json")["pending"]}
    assert "0110_flow_intake" not in planned and "does the work of" in planned[successor]["how"]
    locks = [lock for s in planned[successor]["statements"] for lock in s["locks"]]
    if fresh.is_postgres:
        assert "job_requests: SHARE UPDATE EXCLUSIVE (index build)" in locks
        assert "job_requests: ROW EXCLUSIVE (rows, in batches)" in locks
        assert not any("ACCESS EXCLUSIVE (scan)" in lock for lock in locks)
    else:
        assert set(locks) == {"the database: write lock"}
    assert "CREATE INDEX" in run("upgrade", "--dry-run")
    assert run("status", "--json")["pending"] == found["pending"]  # the dry run applied nothing

    run("upgrade", "--json")
    after = run("status", "--json")
    assert after["pending"] == [] and after["readers_know"] == newest
    assert "run `sekali db contract`" in run("status")
    run("contract")
    assert run("status", "--json")["readers_know"] == after["newest_known"]


def test_every_new_postgres_migration_keeps_writers_going() -> None:
    """No statement of this release's Postgres migrations stops writers for as long as a large
    table takes to scan, rewrite or index, or updates rows outside bounded batches; and
    ``CONCURRENTLY`` and ``VACUUM`` appear only in online files (they cannot run in a
    transaction). Catches:
    another 0110, whose backfill and validation held ACCESS EXCLUSIVE on 2 M requests for 25 s.
    """
    migrations = {m.name: m for m in load_migrations("postgresql")}
    problems = []
    for name in _newer_than_the_previous_release("postgresql"):
        migration = migrations[name]
        context = ddl.Context()
        for statement in migration.statements:
            locks = ddl.statement_locks(statement.sql, context,
                                        batched=statement.batch is not None)
            problems += [f"{name}: {lock}" for lock in ddl.risky(locks)]
            if ddl.outside_transactions(statement.sql) and not migration.online:
                problems.append(f"{name}: `{statement.sql[:40]}` cannot run in a file that is"
                                " one transaction")
    assert problems == []


@pytest.mark.postgres
def test_the_locks_written_down_are_the_ones_postgres_takes(postgres_url: str) -> None:
    """Every statement of sql/ run in a transaction of its own: the strongest lock it holds on
    its table (``pg_locks``) is the one :mod:`resources.storage.ddl` names (``sekali db upgrade
    --dry-run`` prints), or none for a ``DROP ... IF EXISTS`` with nothing to drop.
    ``CONCURRENTLY`` cannot run in a transaction; it runs as it would. Catches: a dry run that
    tells the operator a statement is harmless when it stops writers."""
    strength = [ddl.ROW_EXCLUSIVE, ddl.SHARE_UPDATE_EXCLUSIVE, ddl.SHARE,
                ddl.SHARE_ROW_EXCLUSIVE, ddl.EXCLUSIVE, ddl.ACCESS_EXCLUSIVE]
    db = Database.from_url(postgres_url)
    checked = 0
    with db.session() as conn:
        for migration in load_migrations("postgresql"):
            if migration.name == "0110_flow_intake":
                continue  # replaced by 0121 on a new database
            context = ddl.Context()
            for statement in migration.statements:
                locks = ddl.statement_locks(statement.sql, context,
                                            batched=statement.batch is not None)
                params = {"lo": 0, "hi": 10} if statement.batch else None
                if ddl.outside_transactions(statement.sql):
                    conn.exec_driver_sql(statement.sql)
                    continue
                conn.exec_driver_sql("BEGIN")
                if params:
                    conn.execute(text(statement.sql), params)
                else:
                    conn.exec_driver_sql(statement.sql)
                for lock in locks:
                    if lock.table in ("?",) or lock.table.startswith("index "):
                        continue
                    held = conn.execute(text(
                        "SELECT l.mode FROM pg_locks l WHERE l.pid = pg_backend_pid()"
                        " AND l.relation = to_regclass(:t)"), {"t": lock.table}).scalars().all()
                    names = {m.removesuffix("Lock") for m in held}
                    observed = max((s for s in strength if s.title().replace(" ", "") in names),
                                   key=strength.index, default=None)
                    if observed is None and "IF EXISTS" in statement.sql.upper():
                        continue  # nothing to drop: Postgres took no lock
                    assert observed == lock.mode, (migration.name, statement.sql[:80], held)
                    checked += 1
                conn.exec_driver_sql("COMMIT")
    db.dispose()
    assert checked > 40


@pytest.mark.postgres
def test_an_online_statement_gives_way_to_writers(
    postgres_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A long transaction reads job_requests; the upgrade needs ACCESS EXCLUSIVE behind it. A
    lock request waiting in the queue stops every writer behind it, so the upgrade waits
    ``lock_timeout``, gives way and tries again, and meanwhile an old producer's insert goes
    through. Catches: one upgrade transaction waiting (or holding) its locks for as long as
    it takes, with intake and enqueue stopped behind it."""
    db = Database.from_url(postgres_url)
    upgrade(db, before_flow_intake(tmp_path))
    old_insert(db, "old:0")
    settings = MigrationSettings(lock_timeout=0.2, lock_retries=300)
    blocker = db.engine.connect()
    blocker.exec_driver_sql("BEGIN")
    blocker.exec_driver_sql("SELECT count(*) FROM job_requests")  # holds ACCESS SHARE
    done: list[Any] = []
    upgrader = threading.Thread(
        target=lambda: done.append(_capture(lambda: upgrade(db, settings=settings))))
    with caplog.at_level(logging.INFO, logger="resources.storage.migration_runners"):
        upgrader.start()
        deadline = time.monotonic() + 60
        while not _lock_waiting_on(db, "job_requests"):
            assert time.monotonic() < deadline and not done, done
            time.sleep(0.02)
        inserted = old_insert(db, "old:1")  # the writer passes while the reader still holds
        assert not done and blocker.in_transaction()
        blocker.exec_driver_sql("COMMIT")
        blocker.close()
        upgrader.join(120)
    assert done and not isinstance(done[0], BaseException), done
    assert inserted > 0 and status(db).pending == []
    assert any("giving way" in r.getMessage() for r in caplog.records)
    db.dispose()


def _lock_waiting_on(db: Database, table: str) -> bool:
    with db.statement() as conn:
        return bool(conn.execute(text(
            "SELECT 1 FROM pg_locks WHERE relation = to_regclass(:t) AND NOT granted"),
            {"t": table}).first())


def _capture(fn: Any) -> Any:
    try:
        return fn()
    except BaseException as exc:  # noqa: BLE001 - handed back to the test thread
        return exc


@pytest.mark.postgres
def test_a_statement_holding_writers_back_too_long_is_cancelled(
    postgres_url: str, tmp_path: Path
) -> None:
    """An online statement that stops writers and then keeps its lock (here: a block that
    locks the table and sleeps; in life: an ALTER that turned out to rewrite the table) is
    cancelled by Postgres at ``lock_timeout + exclusive_hold`` and the upgrade stops, naming it;
    nothing of that file is recorded. Catches: an unbounded ACCESS EXCLUSIVE hold."""
    directory = tmp_path / "sql"
    shutil.copytree(Path(__file__).resolve().parent.parent / "sql", directory)
    (directory / "9990_probe.postgresql.sql").write_text(
        "-- sekali: online\n"
        "DO $$ BEGIN LOCK TABLE job_requests IN ACCESS EXCLUSIVE MODE;"
        " PERFORM pg_sleep(5); END $$;\n"
    )
    db = Database.from_url(postgres_url)
    settings = MigrationSettings(lock_timeout=0.2, exclusive_hold=0.3)
    with pytest.raises(MigrationFailed, match="longer than 0.3 s"):
        upgrade(db, directory, settings=settings)
    assert "9990_probe" not in applied(db) and "0121_flow_intake_online" in applied(db)
    db.dispose()
