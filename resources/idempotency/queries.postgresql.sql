-- The statements of resources/idempotency/queries.sql whose Postgres text differs: each claim
-- and each batch write is one statement (dialects.PostgresLedger). A claim's upsert is only
-- attempted when the statement's snapshot shows the key absent or claimable (ON CONFLICT's
-- WHERE still decides, on the latest row version). Without that filter every replay of a
-- completed key would lock its row: a transaction id and a WAL flush per read, and replays of
-- one hot key queued behind each other.

-- claim --
-- Claim :key or read its record, in one round trip: the record, whether it was claimed, and
-- its status before. The second branch reads the statement's snapshot, so it sees the record
-- as it was before the upsert tried it.
WITH claimed AS (
    INSERT INTO idempotency_records AS r
        (key, payload_hash, status, owner_token, lease_expires_at, fence, attempt,
         created_at, updated_at, solo_fence)
    SELECT :key, :hash, 'in_progress', :owner, :expires, 1, 1, :now, :now,
        CAST(:solo AS BIGINT)
    WHERE NOT EXISTS (
        SELECT 1 FROM idempotency_records x WHERE x.key = :key AND NOT (
            x.payload_hash = :hash AND (x.status = 'retryable'
            OR (x.status = 'in_progress' AND x.lease_expires_at <= :now))))
    {claim_on_conflict}
    RETURNING {r.columns}
)
SELECT {columns}, TRUE AS claimed,
       (SELECT p.status FROM idempotency_records p WHERE p.key = :key) AS previous_status
FROM claimed
UNION ALL
SELECT {columns}, FALSE AS claimed, status AS previous_status
FROM idempotency_records WHERE key = :key AND NOT EXISTS (SELECT 1 FROM claimed);

-- claim_many --
-- The same decision for every key of :keys / :hashes / :owners in one statement. "before" is
-- the statement's snapshot of the batch's records (the previous status, or the record to
-- answer with when the key is not claimed); rows are inserted in key order, so two batches
-- that share keys take their row locks in the same order.
WITH input AS (
    SELECT i.key, i.hash, i.owner
    FROM unnest(CAST(:keys AS text[]), CAST(:hashes AS text[]), CAST(:owners AS text[]))
        AS i(key, hash, owner)
),
before AS (
    SELECT {columns} FROM idempotency_records WHERE key = ANY(CAST(:keys AS text[]))
),
claimed AS (
    INSERT INTO idempotency_records AS r
        (key, payload_hash, status, owner_token, lease_expires_at, fence, attempt,
         created_at, updated_at, solo_fence)
    SELECT i.key, i.hash, 'in_progress', i.owner, :expires, 1, 1, :now, :now, NULL
    FROM input i
    WHERE NOT EXISTS (
        SELECT 1 FROM before x WHERE x.key = i.key AND NOT (
            x.payload_hash = i.hash AND (x.status = 'retryable'
            OR (x.status = 'in_progress' AND x.lease_expires_at <= :now))))
    ORDER BY i.key
    {claim_on_conflict}
    RETURNING {r.columns}
)
SELECT {c.columns}, TRUE AS claimed, b.status AS previous_status
FROM claimed c LEFT JOIN before b ON b.key = c.key
UNION ALL
SELECT {b.columns}, FALSE AS claimed, b.status AS previous_status
FROM before b WHERE NOT EXISTS (SELECT 1 FROM claimed c WHERE c.key = b.key);

-- heartbeat_many --
-- The owner's heartbeat for a batch (:keys / :owners); returns the keys still owned (written).
UPDATE idempotency_records AS r SET lease_expires_at = :expires, updated_at = :now
FROM unnest(CAST(:keys AS text[]), CAST(:owners AS text[])) AS i(key, owner)
WHERE r.key = i.key AND r.owner_token = i.owner AND r.status = 'in_progress'
RETURNING r.key;

-- complete_many --
-- The owner's completion for a batch (:keys / :owners / :results); returns the keys still owned
-- (written).
UPDATE idempotency_records AS r SET status = 'completed', result = i.result,
    lease_expires_at = NULL, error_class = NULL, error_message = NULL,
    retention_expires_at = :retain, updated_at = :now
FROM unnest(CAST(:keys AS text[]), CAST(:owners AS text[]), CAST(:results AS text[]))
    AS i(key, owner, result)
WHERE r.key = i.key AND r.owner_token = i.owner AND r.status = 'in_progress'
RETURNING r.key;

-- status_of_locked --
-- The status of :key, its record locked for the rest of the caller's transaction.
SELECT status FROM idempotency_records WHERE key = :key FOR UPDATE;
