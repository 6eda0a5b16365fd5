-- The intake's flow-control columns made safe for the previous release's producers, and the
-- request statuses of this release admitted (expand/contract: sql/README, docs/upgrades.md).
--
-- 0110 rebuilt job_requests with claim_rank NOT NULL and no default: every insert from a process
-- of the previous release (which does not know the column) failed once a new process had
-- migrated. Here claim_rank becomes nullable and the trigger fills it in the same statement as
-- the insert, with created_at (the rank of priority 0, the only priority the previous release
-- writes), so no reader ever sees it empty. SQLite changes a CHECK only by rebuilding the table,
-- so the same rebuild admits the statuses this release adds (cancelled, dead_lettered,
-- superseded), written only once every process knows them (sql/README).
-- Where 0110 is still pending it is not run: this file does its work, with one rebuild instead
-- of two. The runner keeps the AUTOINCREMENT counter across the rebuild; the last two
-- statements heal a counter 0110 lowered, from the request ids other tables still hold.
-- The rebuilt table also has 0150's tenant and claimed_at (with their defaults), 0170's
-- available_at and the indexes of 0151, 0164, 0171 and 0180, so that running this file again
-- after them leaves the schema as it was; a database that applied it before they existed gets
-- them from 0150/0151/0164/0170/0171/0180 (same columns, same order).
-- sekali: replaces 0110_flow_intake
-- sekali: accepts 0513497f0966faca e6de2938b6c3666b 5c3eb8ba6c010290 1b3d61094bb45b22
ALTER TABLE job_requests ADD COLUMN IF NOT EXISTS priority INTEGER NOT NULL DEFAULT 0;
ALTER TABLE job_requests ADD COLUMN IF NOT EXISTS claim_rank DOUBLE PRECISION;
ALTER TABLE job_requests ADD COLUMN IF NOT EXISTS dedupe_window DOUBLE PRECISION;
ALTER TABLE job_requests ADD COLUMN IF NOT EXISTS debounce_key TEXT;
ALTER TABLE job_requests ADD COLUMN IF NOT EXISTS debounce_wait DOUBLE PRECISION;
ALTER TABLE job_requests ADD COLUMN IF NOT EXISTS debounce_max_wait DOUBLE PRECISION;
ALTER TABLE job_requests ADD COLUMN IF NOT EXISTS coalesced_into BIGINT;
ALTER TABLE job_requests ADD COLUMN IF NOT EXISTS coalesced_count INTEGER NOT NULL DEFAULT 0;
DROP TABLE IF EXISTS job_requests_0120;
CREATE TABLE job_requests_0120 (
    id                INTEGER PRIMARY KEY AUTOINCREMENT,
    job_type          TEXT NOT NULL,
    key               TEXT NOT NULL UNIQUE,
    payload           TEXT NOT NULL,
    payload_hash      TEXT NOT NULL,
    status            TEXT NOT NULL DEFAULT 'pending'
        CHECK (status IN ('pending', 'launched', 'running', 'completed', 'failed', 'coalesced',
                          'cancelled', 'dead_lettered', 'superseded')),
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
    claim_rank        DOUBLE PRECISION,
    dedupe_window     DOUBLE PRECISION,
    debounce_key      TEXT,
    debounce_wait     DOUBLE PRECISION,
    debounce_max_wait DOUBLE PRECISION,
    coalesced_into    BIGINT,
    coalesced_count   INTEGER NOT NULL DEFAULT 0,
    amends            TEXT,
    tenant            TEXT NOT NULL DEFAULT 'default',
    claimed_at        DOUBLE PRECISION,
    available_at      DOUBLE PRECISION
);
INSERT INTO job_requests_0120 (id, job_type, key, payload, payload_hash, status, queue,
    correlation_id, run_key, run_id, created_at, updated_at, attempts, last_error, error_class,
    traceparent, superseded_by, priority, claim_rank, dedupe_window, debounce_key,
    debounce_wait, debounce_max_wait, coalesced_into, coalesced_count, amends)
SELECT id, job_type, key, payload, payload_hash, status, queue, correlation_id, run_key, run_id,
    created_at, updated_at, attempts, last_error, error_class, traceparent, superseded_by,
    priority, COALESCE(claim_rank, created_at), dedupe_window, debounce_key, debounce_wait,
    debounce_max_wait, coalesced_into, coalesced_count, amends
FROM job_requests;
DROP TABLE job_requests;
ALTER TABLE job_requests_0120 RENAME TO job_requests;
CREATE INDEX IF NOT EXISTS job_requests_status_id ON job_requests (status, id);
CREATE INDEX IF NOT EXISTS job_requests_status_updated ON job_requests (status, updated_at);
CREATE INDEX IF NOT EXISTS job_requests_claim ON job_requests (claim_rank, id)
    WHERE status IN ('pending', 'launched');
CREATE INDEX IF NOT EXISTS job_requests_debounce ON job_requests (debounce_key, created_at)
    WHERE status = 'pending' AND debounce_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS job_requests_coalesced_into ON job_requests (coalesced_into);
CREATE INDEX IF NOT EXISTS job_requests_tenant_claim ON job_requests (tenant, claim_rank, id)
    WHERE status IN ('pending', 'launched');
CREATE INDEX IF NOT EXISTS job_requests_claimed_at ON job_requests (claimed_at)
    WHERE claimed_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS job_requests_tenant_waiting
    ON job_requests (tenant, status, updated_at, debounce_key)
    WHERE status IN ('pending', 'launched');
CREATE INDEX IF NOT EXISTS job_requests_held ON job_requests (run_id)
    WHERE status IN ('running', 'launched');
CREATE INDEX IF NOT EXISTS job_requests_created ON job_requests (created_at);
CREATE TRIGGER IF NOT EXISTS job_requests_claim_rank AFTER INSERT ON job_requests
    FOR EACH ROW WHEN NEW.claim_rank IS NULL
BEGIN
    UPDATE job_requests SET claim_rank = NEW.created_at WHERE id = NEW.id;
END;
INSERT INTO sqlite_sequence (name, seq) SELECT 'job_requests', 0
    WHERE NOT EXISTS (SELECT 1 FROM sqlite_sequence WHERE name = 'job_requests');
UPDATE sqlite_sequence SET seq = MAX(seq,
    (SELECT COALESCE(MAX(id), 0) FROM job_requests),
    (SELECT COALESCE(MAX(request_id), 0) FROM job_attempts),
    (SELECT COALESCE(MAX(request_id), 0) FROM dlq_records),
    (SELECT COALESCE(MAX(MAX(request_id), MAX(previous_request_id)), 0) FROM request_versions))
WHERE name = 'job_requests';
