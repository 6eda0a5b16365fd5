-- Intake flow control (docs/flow.md): a request's priority, the dedupe window its key was
-- derived under (NULL: until finished), its debounce group with the group's wait and maximum
-- wait, and, for a request coalesced into another, the status 'coalesced' and the link.
-- claim_rank is the order the intake claims in: created_at - priority x aging (a request of
-- priority p is served as if it had arrived p x aging seconds earlier), indexed for the claim.
-- SQLite cannot change a CHECK constraint in place: the table is rebuilt in this transaction,
-- with every column the files before this one gave it (superseded_by: 0105). Numbered after
-- 0105 so that rebuild always sees that column, whichever order a database met the files in.
CREATE TABLE job_requests_0110 (
    id                INTEGER PRIMARY KEY AUTOINCREMENT,
    job_type          TEXT NOT NULL,
    key               TEXT NOT NULL UNIQUE,
    payload           TEXT NOT NULL,
    payload_hash      TEXT NOT NULL,
    status            TEXT NOT NULL DEFAULT 'pending'
        CHECK (status IN ('pending', 'launched', 'running', 'completed', 'failed', 'coalesced')),
    queue             TEXT NOT NULL,
    correlation_id    TEXT,
    run_key           TEXT,
    run_id            TEXT,
    created_at        DOUBLE PRECISION NOT NULL,
    updated_at        DOUBLE PRECISION NOT NULL,
    attempts          INTEGER NOT NULL DEFAULT 0,
    last_error        TEXT,
    error_class       TEXT,
    traceparent       TEXT,
    superseded_by     TEXT,
    priority          INTEGER NOT NULL DEFAULT 0,
    claim_rank        DOUBLE PRECISION NOT NULL,
    dedupe_window     DOUBLE PRECISION,
    debounce_key      TEXT,
    debounce_wait     DOUBLE PRECISION,
    debounce_max_wait DOUBLE PRECISION,
    coalesced_into    BIGINT,
    coalesced_count   INTEGER NOT NULL DEFAULT 0
);
INSERT INTO job_requests_0110 (id, job_type, key, payload, payload_hash, status, queue,
    correlation_id, run_key, run_id, created_at, updated_at, attempts, last_error, error_class,
    traceparent, superseded_by, claim_rank)
SELECT id, job_type, key, payload, payload_hash, status, queue, correlation_id, run_key, run_id,
    created_at, updated_at, attempts, last_error, error_class, traceparent, superseded_by,
    created_at
FROM job_requests;
DROP TABLE job_requests;
ALTER TABLE job_requests_0110 RENAME TO job_requests;
CREATE INDEX IF NOT EXISTS job_requests_status_id ON job_requests (status, id);
CREATE INDEX IF NOT EXISTS job_requests_status_updated ON job_requests (status, updated_at);
CREATE INDEX IF NOT EXISTS job_requests_claim ON job_requests (claim_rank, id)
    WHERE status IN ('pending', 'launched');
CREATE INDEX IF NOT EXISTS job_requests_debounce ON job_requests (debounce_key, created_at)
    WHERE status = 'pending' AND debounce_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS job_requests_coalesced_into ON job_requests (coalesced_into);
