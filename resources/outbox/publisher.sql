-- Named statements of resources/outbox/publisher.py (Inbox, OutboxPublisher and the stuck-row
-- views), over outbox and inbox. A block in publisher.postgresql.sql wins on Postgres.

-- inbox_insert --
-- Mark one event processed by one consumer; no row changed when it was before.
INSERT INTO inbox (consumer, event_id, processed_at)
VALUES (:c, :e, :now)
ON CONFLICT DO NOTHING;

-- inbox_seen --
-- Whether one consumer processed one event.
SELECT 1 FROM inbox WHERE consumer = :c AND event_id = :e;

-- claim_ids --
-- Up to :limit publishable rows, oldest first: unpublished, not dead-lettered, not claimed by
-- another live claim, and no earlier row of the aggregate dead-lettered or claimed by another.
SELECT o.id FROM outbox o
WHERE o.published_at IS NULL AND o.dead_letter_id IS NULL
  AND (o.claimed_until IS NULL OR o.claimed_until <= :now OR o.claimed_by = :me)
  AND NOT EXISTS (
    SELECT 1 FROM outbox b
    WHERE b.aggregate_type = o.aggregate_type AND b.aggregate_id = o.aggregate_id
      AND b.published_at IS NULL AND b.id < o.id
      AND (b.dead_letter_id IS NOT NULL OR (b.claimed_until > :now AND b.claimed_by <> :me)))
ORDER BY o.id
LIMIT :limit;

-- mark_claimed --
-- The claimed rows (:ids expanding) are this publisher's until :until.
UPDATE outbox
SET claimed_by = :me, claimed_until = :until, attempts = attempts + 1
WHERE id IN :ids;

-- events_by_ids --
-- The claimed rows (:ids expanding), by id.
SELECT id, event_id, aggregate_type, aggregate_id, event_type, payload, created_at, attempts,
       traceparent
FROM outbox
WHERE id IN :ids
ORDER BY id;

-- extend_claim --
-- Extend this publisher's claim on one unpublished row.
UPDATE outbox SET claimed_until = :until
WHERE id = :id AND claimed_by = :me AND published_at IS NULL;

-- count_failure --
-- One more failed publication of a row this publisher holds; the count back.
UPDATE outbox SET failures = failures + 1, last_error = :error
WHERE id = :id AND claimed_by = :me AND published_at IS NULL
RETURNING failures;

-- mark_published --
-- A row this publisher holds was published.
UPDATE outbox
SET published_at = :now, claimed_by = NULL, claimed_until = NULL, failures = 0
WHERE id = :id AND claimed_by = :me AND published_at IS NULL;

-- release_aggregate --
-- Give back this publisher's claims on one aggregate's unpublished rows.
UPDATE outbox SET claimed_by = NULL, claimed_until = NULL
WHERE claimed_by = :me AND published_at IS NULL
  AND aggregate_type = :t AND aggregate_id = :a;

-- unpublished_older_than --
-- Live rows written before :cutoff and still unpublished, none waiting behind a dead letter.
SELECT id FROM outbox
WHERE published_at IS NULL AND created_at <= :cutoff AND dead_letter_id IS NULL
  AND NOT EXISTS (
    SELECT 1 FROM outbox b
    WHERE b.aggregate_type = outbox.aggregate_type AND b.aggregate_id = outbox.aggregate_id
      AND b.published_at IS NULL AND b.id < outbox.id AND b.dead_letter_id IS NOT NULL)
ORDER BY id;

-- held_by_dead_letters --
-- Unpublished rows dead-lettered, and unpublished rows waiting behind one of their aggregate.
SELECT COALESCE(SUM(CASE WHEN dead_letter_id IS NOT NULL THEN 1 ELSE 0 END), 0),
       COALESCE(SUM(CASE WHEN dead_letter_id IS NULL AND EXISTS (
           SELECT 1 FROM outbox b
           WHERE b.aggregate_type = outbox.aggregate_type
             AND b.aggregate_id = outbox.aggregate_id AND b.published_at IS NULL
             AND b.id < outbox.id AND b.dead_letter_id IS NOT NULL)
         THEN 1 ELSE 0 END), 0)
FROM outbox
WHERE published_at IS NULL;
