-- The statements of resources/storage/retention.sql whose Postgres text differs.

-- choose_batch --
-- Up to :_batch_size expired rows' keys, locked; rows another purge holds are skipped.
SELECT {key} FROM {table} WHERE {where} LIMIT :_batch_size FOR UPDATE SKIP LOCKED;
