-- Named statements of resources/outbox/dead_letters.py (OutboxDeadLetters), the owner of
-- outbox_dead_letters and of the outbox's dead_letter_id mark.

-- record --
-- Copy one outbox row into its dead letter (open again, one more death, if it had one).
INSERT INTO outbox_dead_letters (outbox_id, event_id, aggregate_type, aggregate_id, event_type,
    payload, traceparent, failures, last_error, status, created_at, updated_at)
SELECT id, event_id, aggregate_type, aggregate_id, event_type, payload, traceparent, failures,
    last_error, 'open', :now, :now
FROM outbox
WHERE id = :id
ON CONFLICT (event_id) DO UPDATE
SET status = 'open', failures = excluded.failures, last_error = excluded.last_error,
    deaths = outbox_dead_letters.deaths + 1, detail = NULL, updated_at = excluded.updated_at;

-- dead_letter_of --
-- The dead letter of one outbox row.
SELECT d.id FROM outbox_dead_letters d JOIN outbox o ON o.event_id = d.event_id
WHERE o.id = :id;

-- mark_dead --
-- Take one outbox row out of publication: marked with its dead letter, its claim dropped.
UPDATE outbox SET dead_letter_id = :dead, claimed_by = NULL, claimed_until = NULL
WHERE id = :id;

-- page --
-- Dead letters with ids above :after, oldest first.
SELECT id, outbox_id, event_id, aggregate_type, aggregate_id, event_type, payload, failures,
       last_error, deaths, status, detail, created_at, updated_at
FROM outbox_dead_letters
WHERE id > :after
ORDER BY id
LIMIT :limit;

-- page_of_status --
-- Dead letters of one status with ids above :after, oldest first.
SELECT id, outbox_id, event_id, aggregate_type, aggregate_id, event_type, payload, failures,
       last_error, deaths, status, detail, created_at, updated_at
FROM outbox_dead_letters
WHERE id > :after AND status = :status
ORDER BY id
LIMIT :limit;

-- by_id --
-- One dead letter.
SELECT id, outbox_id, event_id, aggregate_type, aggregate_id, event_type, payload, failures,
       last_error, deaths, status, detail, created_at, updated_at
FROM outbox_dead_letters
WHERE id = :id;

-- expired --
-- The condition of a dead letter replayed or discarded before :cutoff.
status IN ('replayed', 'discarded') AND updated_at <= :cutoff;

-- unpublished_event --
-- The condition that keeps a dead letter whose event is still unpublished.
EXISTS (SELECT 1 FROM outbox o WHERE o.event_id = outbox_dead_letters.event_id
        AND o.published_at IS NULL);

-- close --
-- An open dead letter replayed or discarded.
UPDATE outbox_dead_letters SET status = :status, detail = :detail, updated_at = :now
WHERE id = :id AND status = 'open';

-- republish --
-- A replayed dead letter's outbox row back for publication, first of its aggregate again.
UPDATE outbox SET dead_letter_id = NULL, failures = 0, claimed_by = NULL, claimed_until = NULL
WHERE dead_letter_id = :id;

-- drop_discarded --
-- A discarded dead letter's outbox row goes (the dead letter is the copy kept).
DELETE FROM outbox WHERE dead_letter_id = :id;
