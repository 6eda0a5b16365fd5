-- Named statements of resources/storage/migration_runners.py, the owner of
-- sekali_schema_migrations (what is applied) and sekali_schema_state (the readers' floor).
-- A block in migration_runners.postgresql.sql wins on Postgres. {table} and {column} in
-- batch_range are a migration file's batch directive, checked when the file is read.

-- create_records --
-- The records table as the previous release's runner created it, with replaced_by.
CREATE TABLE IF NOT EXISTS sekali_schema_migrations (
    name TEXT PRIMARY KEY, checksum TEXT NOT NULL, applied_at DOUBLE PRECISION NOT NULL,
    replaced_by TEXT);

-- create_state --
-- The state table: named values such as the readers' floor.
CREATE TABLE IF NOT EXISTS sekali_schema_state (
    name TEXT PRIMARY KEY, value TEXT NOT NULL, changed_at DOUBLE PRECISION NOT NULL);

-- add_replaced_by --
-- replaced_by where a previous release's records table lacks it.
ALTER TABLE sekali_schema_migrations ADD COLUMN replaced_by TEXT;

-- record --
-- One applied (or replaced) migration.
INSERT INTO sekali_schema_migrations (name, checksum, applied_at, replaced_by)
VALUES (:n, :c, :t, :r);

-- records --
-- Every recorded migration, with the columns the table has.
SELECT * FROM sekali_schema_migrations;

-- recorded --
-- Whether one migration is recorded.
SELECT 1 FROM sekali_schema_migrations WHERE name = :n;

-- state_value --
-- One named state value.
SELECT value FROM sekali_schema_state WHERE name = :n;

-- raise_state --
-- Raise one named state value to :v (never lower it).
UPDATE sekali_schema_state SET value = :v, changed_at = :t WHERE name = :n AND value < :v;

-- insert_state --
-- One named state value, unless it exists.
INSERT INTO sekali_schema_state (name, value, changed_at)
SELECT :n, :v, :t
WHERE NOT EXISTS (SELECT 1 FROM sekali_schema_state WHERE name = :n);

-- batch_range --
-- The range of a batched statement's column.
SELECT MIN({column}), MAX({column}) FROM {table};

-- set_sequence --
-- Put back one SQLite AUTOINCREMENT counter.
UPDATE sqlite_sequence SET seq = :s WHERE name = :n;

-- add_sequence --
-- Recreate one SQLite AUTOINCREMENT counter a table rebuild lost.
INSERT INTO sqlite_sequence (name, seq) VALUES (:n, :s);

-- index_valid --
-- Whether a Postgres index is valid (false: left invalid by a failed concurrent build).
SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(:n);

-- add_column --
-- A guarded ADD COLUMN of a migration file once its column was found missing ({table},
-- {column} and {rest} as the file wrote them, checked when the file is read).
ALTER TABLE {table} ADD COLUMN {column} {rest}

-- sequences --
-- SQLite: the AUTOINCREMENT counters, by table.
SELECT name, seq FROM sqlite_sequence;

-- sqlite_tables --
-- SQLite: the tables that exist.
SELECT name FROM sqlite_master WHERE type = 'table';

-- try_upgrade_lock --
-- Postgres: the session's upgrade lock :id, taken when free (true) or not (false).
SELECT pg_try_advisory_lock(:id);

-- legacy_lock --
-- Postgres: the previous release's upgrade lock :id, held until the transaction ends.
SELECT pg_advisory_xact_lock(:id);
