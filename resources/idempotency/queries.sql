-- Named statements of resources/idempotency (IdempotencyStore writes, LedgerViews reads, the
-- dialect classes of dialects.py claim), the owner of idempotency_records. A block in
-- queries.postgresql.sql or queries.sqlite.sql wins for its dialect. Filled at import:
-- {columns} is records.RECORD_COLUMNS ({r.columns}: prefixed with the alias r), and
-- {claim_on_conflict} / {owner_check} the fragments of the same names below. {column} in a
-- condition is a column name from code, never input. The statuses a statement moves a record
-- between are the transitions of records.Status.

-- claim_on_conflict --
-- Fragment of every claim: an existing key is taken only when its payload is the same and it is
-- retryable, or in progress under a lease that ran out (a takeover: the fence grows, and the
-- takeover of a holder that ran alone counts a crash). Otherwise nothing is written.
ON CONFLICT (key) DO UPDATE SET
    status = 'in_progress',
    owner_token = excluded.owner_token,
    lease_expires_at = excluded.lease_expires_at,
    fence = r.fence + 1,
    attempt = r.attempt + 1,
    crashes = r.crashes
        + CASE WHEN r.status = 'in_progress' AND r.solo_fence = r.fence THEN 1 ELSE 0 END,
    solo_fence = CASE WHEN excluded.solo_fence IS NULL THEN NULL ELSE r.fence + 1 END,
    updated_at = excluded.updated_at
WHERE r.payload_hash = excluded.payload_hash
  AND (r.status = 'retryable' OR (r.status = 'in_progress' AND r.lease_expires_at <= :now))

-- owner_check --
-- Fragment of the owner's writes: each applies only while the caller still owns a live claim.
WHERE key = :key AND owner_token = :owner AND status = 'in_progress'

-- select_one --
-- One record.
SELECT {columns} FROM idempotency_records WHERE key = :key;

-- heartbeat --
-- The owner extends its lease.
UPDATE idempotency_records SET lease_expires_at = :expires, updated_at = :now
{owner_check};

-- checkpoint --
-- The owner records a recovery point and extends its lease.
UPDATE idempotency_records SET recovery_point = :point, recovery_data = :data,
    lease_expires_at = :expires, updated_at = :now
{owner_check};

-- complete --
-- The owner stores the result: in_progress -> completed, kept until :retain.
UPDATE idempotency_records SET status = 'completed', result = :result,
    lease_expires_at = NULL, error_class = NULL, error_message = NULL,
    retention_expires_at = :retain, updated_at = :now
{owner_check};

-- fail --
-- The owner records a failure: in_progress -> :status (failed, or retryable).
UPDATE idempotency_records SET status = :status, error_class = :eclass,
    error_message = :emsg, lease_expires_at = NULL, updated_at = :now
{owner_check};

-- run_alone --
-- The owner's handler runs alone from now: its death counts a crash at the next takeover.
UPDATE idempotency_records SET solo_fence = fence, updated_at = :now
{owner_check};

-- survived --
-- A holder that ran alone came back after its key was taken over: the crash counted is taken
-- back.
UPDATE idempotency_records SET crashes = crashes - 1, updated_at = :now
WHERE key = :key AND fence > :fence AND crashes > 0;

-- reset --
-- Operator (DLQ replay): failed -> retryable, the crash count back to zero.
UPDATE idempotency_records SET status = 'retryable', crashes = 0, updated_at = :now
WHERE key = :key AND status = 'failed';

-- highest_fence --
-- The highest fence of the keys :keys (expanding).
SELECT MAX(fence) FROM idempotency_records WHERE key IN :keys;

-- continue_fences --
-- A new key as retryable at another key's fence (absent -> retryable); nothing if it exists.
INSERT INTO idempotency_records (key, payload_hash, status, fence, attempt,
    created_at, updated_at)
VALUES (:key, :hash, 'retryable', :fence, 0, :now, :now)
ON CONFLICT (key) DO NOTHING;

-- records --
-- The records of the keys :keys (expanding).
SELECT {columns} FROM idempotency_records WHERE key IN :keys;

-- records_in_status --
-- The records of the keys :keys (expanding) in :status.
SELECT {columns} FROM idempotency_records WHERE key IN :keys AND status = :status;

-- held --
-- Whether a live holder holds :key at :now (in progress, its lease not run out).
SELECT 1 FROM idempotency_records
WHERE key = :key AND status = 'in_progress' AND lease_expires_at > :now;

-- status_of --
-- The status of :key, in the caller's transaction.
SELECT status FROM idempotency_records WHERE key = :key;

-- status_of_locked --
-- The same, the record locked for the rest of the transaction (SQLite's BEGIN IMMEDIATE already
-- holds the write lock: a plain read).
SELECT status FROM idempotency_records WHERE key = :key;

-- unfinished_key_reference --
-- Condition: the key in {column} is claimed and not completed.
EXISTS (SELECT 1 FROM idempotency_records i WHERE i.key = {column} AND i.status <> 'completed')

-- expired --
-- Condition for retention: completed and past retention.
status = 'completed' AND retention_expires_at <= :now

-- expired_or_older --
-- Condition for retention: completed, and past retention or last updated before :cutoff.
status = 'completed' AND (retention_expires_at <= :now OR updated_at <= :cutoff)

-- expired_or_older_with_failed --
-- Condition for retention: as expired_or_older, or failed or retryable and last updated before
-- :cutoff.
status = 'completed' AND (retention_expires_at <= :now OR updated_at <= :cutoff) OR status IN ('failed', 'retryable') AND updated_at <= :cutoff
