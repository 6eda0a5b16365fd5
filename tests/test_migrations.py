"""``sql/`` is the only schema truth: applying it is repeatable, recorded, safe to race, and it
produces exactly the tables the code declares, on SQLite and Postgres."""

from __future__ import annotations

import importlib
import multiprocessing
import pkgutil
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
from sqlalchemy import inspect, text

import resources
from resources.errors import SekaliError
from resources.storage.db import Database, metadata
from resources.storage.migration_files import Batch
from resources.storage.migrations import (
    MigrationDrift,
    applied,
    load_migrations,
    parse_statements,
    split_statements,
    sql_dir,
    upgrade,
)
from tests.idempotency_workers import migrate_worker


def import_all_resources() -> None:
    """Every module under ``resources`` that declares a table adds it to ``metadata``."""
    for info in pkgutil.iter_modules(resources.__path__, prefix="resources."):
        importlib.import_module(info.name)


def test_upgrade_twice_is_a_noop_and_recorded(db_url: str) -> None:
    """Catches: a migration applied again (second upgrade not empty) or not recorded."""
    db = Database.from_url(db_url)
    try:
        names = [m.name for m in load_migrations(db.dialect)]
        assert names, "sql/ holds no migrations"
        assert upgrade(db) == names
        assert upgrade(db) == []
        assert upgrade(db) == []
        assert applied(db) == names
    finally:
        db.dispose()


def test_schema_matches_declared_tables(db: Database) -> None:
    """Every Table in ``resources.storage.db.metadata`` exists with the same column names.
    Catches: a module declaring a column that no sql/ file creates (or the reverse)."""
    import_all_resources()
    assert "idempotency_records" in metadata.tables
    inspector = inspect(db.engine)
    existing = set(inspector.get_table_names())
    problems: list[str] = []
    for name, table in sorted(metadata.tables.items()):
        if name not in existing:
            problems.append(f"{name}: declared but sql/ does not create it")
            continue
        declared = {c.name for c in table.columns}
        actual = {c["name"] for c in inspector.get_columns(name)}
        if declared != actual:
            problems.append(
                f"{name}: only declared {sorted(declared - actual)}, "
                f"only in the database {sorted(actual - declared)}"
            )
    assert problems == []


def test_concurrent_upgrades_on_a_fresh_database(db_url: str) -> None:
    """Several processes upgrading one fresh database at once: all succeed, each migration is
    applied by exactly one of them. Catches: a missing migration lock (duplicate-key errors on
    the record table, or DDL run twice)."""
    ctx = multiprocessing.get_context("spawn")
    start_at = time.time() + 5.0
    with ProcessPoolExecutor(max_workers=4, mp_context=ctx) as pool:
        results = [
            f.result(timeout=300)
            for f in [pool.submit(migrate_worker, db_url, start_at) for _ in range(4)]
        ]
    db = Database.from_url(db_url)
    try:
        names = [m.name for m in load_migrations(db.dialect)]
        applied_by_someone = sorted(name for result in results for name in result)
        assert applied_by_someone == names  # each exactly once
        assert applied(db) == names
        assert upgrade(db) == []
    finally:
        db.dispose()


def test_edited_applied_migration_raises_drift(db_url: str, tmp_path: Path) -> None:
    """An already-applied file edited afterwards is reported, not silently skipped."""
    directory = tmp_path / "sql"
    shutil.copytree(sql_dir(), directory)
    db = Database.from_url(db_url)
    try:
        names = upgrade(db, directory)
        first = sorted(directory.glob(f"{names[0]}*.sql"))
        target = next(p for p in first if p.name.count(".") == 1 or db.dialect in p.name)
        target.write_text(target.read_text() + "\n-- an edit after the fact\n")
        with pytest.raises(MigrationDrift) as info:
            upgrade(db, directory)
        assert names[0] in str(info.value)
        assert isinstance(info.value, SekaliError)
    finally:
        db.dispose()


def test_new_file_is_applied_after_the_rest(db_url: str, tmp_path: Path) -> None:
    directory = tmp_path / "sql"
    shutil.copytree(sql_dir(), directory)
    db = Database.from_url(db_url)
    try:
        upgrade(db, directory)
        (directory / "9999_probe.sql").write_text(
            "CREATE TABLE IF NOT EXISTS probe_table (id INTEGER PRIMARY KEY);\n"
            "CREATE INDEX IF NOT EXISTS probe_idx ON probe_table (id);\n"
        )
        assert upgrade(db, directory) == ["9999_probe"]
        assert "probe_table" in inspect(db.engine).get_table_names()
        assert upgrade(db, directory) == []
    finally:
        db.dispose()


def test_dialect_file_wins(tmp_path: Path) -> None:
    """``NNNN_x.postgresql.sql`` replaces ``NNNN_x.sql`` on Postgres only."""
    (tmp_path / "0001_a.sql").write_text("SELECT 1;\n")
    (tmp_path / "0001_a.postgresql.sql").write_text("SELECT 2;\n")
    (tmp_path / "0002_b.sqlite.sql").write_text("SELECT 3;\n")
    pg = load_migrations("postgresql", tmp_path)
    lite = load_migrations("sqlite", tmp_path)
    assert [(m.name, m.sql) for m in pg] == [("0001_a", "SELECT 2;\n")]
    assert [(m.name, m.sql) for m in lite] == [("0001_a", "SELECT 1;\n"), ("0002_b", "SELECT 3;\n")]
    (tmp_path / "bad.sql").write_text("")
    with pytest.raises(ValueError):
        load_migrations("sqlite", tmp_path)


def test_split_statements() -> None:
    sql = "-- comment; here\nCREATE TABLE a (x INT);\nCREATE INDEX i\n  ON a (x);\n\n"
    assert split_statements(sql) == ["CREATE TABLE a (x INT)", "CREATE INDEX i\n  ON a (x)"]


def test_function_and_trigger_bodies_stay_one_statement() -> None:
    """A ``;`` at the end of a line inside ``$$ ... $$`` or a SQLite ``BEGIN ... END;`` trigger
    body does not end the statement. Catches: a Postgres trigger function or a SQLite trigger
    sent in pieces."""
    sql = (
        "CREATE FUNCTION f() RETURNS trigger LANGUAGE plpgsql AS $$\nBEGIN\n"
        "    NEW.a := COALESCE(NEW.a, 1);\n    RETURN NEW;\nEND\n$$;\n"
        "CREATE TRIGGER t AFTER INSERT ON x\n    FOR EACH ROW WHEN NEW.a IS NULL\nBEGIN\n"
        "    UPDATE x SET a = 1 WHERE id = NEW.id;\nEND;\n"
        "-- sekali: batch x.id 100\nUPDATE x SET a = 2 WHERE id >= :lo AND id < :hi;\n"
    )
    statements = parse_statements(sql)
    assert [s.sql.split()[1] for s in statements] == ["FUNCTION", "TRIGGER", "x"]
    assert statements[0].sql.endswith("$$") and statements[1].sql.endswith("END")
    assert [s.batch for s in statements] == [None, None, Batch("x", "id", 100)]


def test_directives_are_checked_when_loaded(tmp_path: Path) -> None:
    """Catches: a misspelt directive silently ignored (an online file run as one transaction),
    or a file claiming to replace one that comes after it."""
    (tmp_path / "0001_a.sql").write_text("-- sekali: onlin\nSELECT 1;\n")
    with pytest.raises(ValueError, match="0001_a.sql: unknown directive 'sekali: onlin'"):
        load_migrations("sqlite", tmp_path)
    (tmp_path / "0001_a.sql").write_text("-- sekali: replaces 0002_b\nSELECT 1;\n")
    (tmp_path / "0002_b.sql").write_text("SELECT 2;\n")
    with pytest.raises(ValueError, match="0001_a: replaces '0002_b', not an earlier file"):
        load_migrations("sqlite", tmp_path)
    (tmp_path / "0001_a.sql").write_text("-- sekali: accepts abc def\nSELECT 1;\n")
    (tmp_path / "0002_b.sql").write_text("-- sekali: online\n-- sekali: replaces 0001_a\n")
    first, second = load_migrations("postgresql", tmp_path)
    assert first.matches("abc") and first.matches(first.checksum) and not first.matches("x")
    assert second.online and second.replaces == ("0001_a",) and not first.online


def test_identity_placeholder_renders_per_dialect_and_ids_auto_increment(db: Database) -> None:
    """One file serves both backends: ``{{identity}}`` becomes each dialect's auto-increment key."""
    from resources.storage.migrations import render

    assert "{{" not in render("id {{identity}},", db.dialect)
    assert all("{{identity}}" not in m.sql for m in load_migrations(db.dialect))
    with db.transaction() as conn:
        for i in range(3):
            conn.execute(
                text(
                    "INSERT INTO dlq_audit (record_id, action, actor, at)"
                    " VALUES (:r, 'noted', 'test', 0)"
                ),
                {"r": i},
            )
        ids = [r[0] for r in conn.execute(text("SELECT id FROM dlq_audit ORDER BY id"))]
    assert len(set(ids)) == 3 and ids == sorted(ids)
