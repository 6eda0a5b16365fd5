-- The statements of resources/dlq/queries.sql whose SQLite text differs.

-- key_page --
-- As in queries.sql, the status checked row by row along the primary key (unary plus: no index
-- on status), so at most the window of ids is read, not every record of the status.
SELECT id, idempotency_key FROM dlq_records
WHERE id > :after AND id <= :hi AND +status IN :statuses
ORDER BY id
LIMIT :limit;
