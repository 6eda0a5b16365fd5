-- Named statements of resources/storage/dialects.py's PostgresDialect.

-- advisory_lock --
-- Hold the transaction-scoped advisory lock :key, exclusive, until the transaction ends.
SELECT pg_advisory_xact_lock(:key);

-- advisory_lock_shared --
-- Hold the transaction-scoped advisory lock :key, shared, until the transaction ends.
SELECT pg_advisory_xact_lock_shared(:key);

-- analyze --
-- Postgres: the planner's statistics of {table} (an identifier checked by the caller).
ANALYZE {table};

-- unlock_all_advisory --
-- Postgres: drop every session-level advisory lock a pooled connection still holds.
SELECT pg_advisory_unlock_all();
