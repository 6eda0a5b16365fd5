-- The statements of resources/idempotency/queries.sql whose SQLite text differs: the claims and
-- the batch writes, which SQLite runs one key at a time inside one BEGIN IMMEDIATE transaction
-- (dialects.SqliteLedger).

-- claim --
-- Claim :key, or change nothing; returns the record when claimed. The caller reads the record
-- first, in the same transaction, for what it answers when nothing was claimed.
INSERT INTO idempotency_records AS r
    (key, payload_hash, status, owner_token, lease_expires_at, fence, attempt,
     created_at, updated_at, solo_fence)
VALUES (:key, :hash, 'in_progress', :owner, :expires, 1, 1, :now, :now, CAST(:solo AS BIGINT))
{claim_on_conflict}
RETURNING {columns};

-- claim_many --
-- One key of a batch's claim: as claim (:solo is NULL: a batch's claims count no crash).
INSERT INTO idempotency_records AS r
    (key, payload_hash, status, owner_token, lease_expires_at, fence, attempt,
     created_at, updated_at, solo_fence)
VALUES (:key, :hash, 'in_progress', :owner, :expires, 1, 1, :now, :now, CAST(:solo AS BIGINT))
{claim_on_conflict}
RETURNING {columns};

-- heartbeat_many --
-- One key of a batch's heartbeat: as heartbeat.
UPDATE idempotency_records SET lease_expires_at = :expires, updated_at = :now
{owner_check};

-- complete_many --
-- One key of a batch's completion: as complete.
UPDATE idempotency_records SET status = 'completed', result = :result,
    lease_expires_at = NULL, error_class = NULL, error_message = NULL,
    retention_expires_at = :retain, updated_at = :now
{owner_check};
