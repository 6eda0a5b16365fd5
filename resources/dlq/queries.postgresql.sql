-- The statements of resources/dlq/queries.sql whose Postgres text differs: row locks.

-- lock_by_id --
-- One record, locked until the transaction ends.
SELECT {columns}
FROM dlq_records
WHERE id = :id
FOR UPDATE;

-- lock_by_key --
-- The record of one dedupe key, locked until the transaction ends.
SELECT {columns}
FROM dlq_records
WHERE dedupe_key = :k
FOR UPDATE;

-- replay_requested_ids --
-- Up to :limit records waiting for their replay, oldest request first; rows another claimer
-- holds are skipped, not waited for.
SELECT id FROM dlq_records
WHERE status = 'replay_requested'
ORDER BY status_changed_at, id
LIMIT :limit
FOR UPDATE SKIP LOCKED;
