-- The statements of resources/locks/db_lock.sql whose Postgres text differs.

-- lock_row --
-- One business row, locked for the rest of the caller's transaction.
SELECT * FROM {table} WHERE {key_column} = :key FOR UPDATE;

-- lock_rows --
-- Business rows of :keys, locked in key order for the rest of the caller's transaction (two
-- transactions locking overlapping sets then never wait on each other in a cycle).
SELECT * FROM {table} WHERE {key_column} IN :keys ORDER BY {key_column} FOR UPDATE;
