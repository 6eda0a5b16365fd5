-- The statements of resources/locks/db_lock.sql whose Postgres text differs.

-- lock_row --
-- One business row, locked for the rest of the caller's transaction.
SELECT * FROM {table} WHERE {key_column} = :key FOR UPDATE;
