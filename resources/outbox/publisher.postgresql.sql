-- The statements of resources/outbox/publisher.sql whose Postgres text differs.

-- claim_ids --
-- As in publisher.sql, the rows locked: FOR UPDATE waits for a row another publisher is
-- releasing or marking, then re-reads it; claimers never wait for each other's row locks (the
-- advisory lock comes first).
SELECT o.id FROM outbox o
WHERE o.published_at IS NULL AND o.dead_letter_id IS NULL
  AND (o.claimed_until IS NULL OR o.claimed_until <= :now OR o.claimed_by = :me)
  AND NOT EXISTS (
    SELECT 1 FROM outbox b
    WHERE b.aggregate_type = o.aggregate_type AND b.aggregate_id = o.aggregate_id
      AND b.published_at IS NULL AND b.id < o.id
      AND (b.dead_letter_id IS NOT NULL OR (b.claimed_until > :now AND b.claimed_by <> :me)))
ORDER BY o.id
LIMIT :limit
FOR UPDATE;
