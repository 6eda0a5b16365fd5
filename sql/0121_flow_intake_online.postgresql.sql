-- What 0110 did under one long ACCESS EXCLUSIVE lock (a 2 M-row job_requests stopped intake and
-- enqueue for about 25 s), done online: the backfill in ranges of ids, one short transaction
-- each (rows inserted meanwhile get their rank from 0120's trigger), then a VACUUM, so the
-- intake's scans and the steps after it do not wade through a dead copy of every row; the
-- CHECKs added NOT VALID (metadata only) and validated under SHARE UPDATE EXCLUSIVE, which
-- writers pass; NOT NULL set from a validated CHECK, which spares Postgres the scan under its
-- ACCESS EXCLUSIVE lock; the indexes built concurrently. Where 0110 was applied, every
-- statement finds its work done but one: the status CHECK admits this release's statuses
-- (cancelled, dead_lettered, superseded), written only once every process knows them
-- (sql/README).
-- sekali: online
-- sekali: replaces 0110_flow_intake
-- sekali: batch job_requests.id 5000
UPDATE job_requests SET claim_rank = created_at
WHERE id >= :lo AND id < :hi AND claim_rank IS NULL;
VACUUM (ANALYZE) job_requests;
ALTER TABLE job_requests DROP CONSTRAINT IF EXISTS job_requests_status_check,
    ADD CONSTRAINT job_requests_status_check CHECK (
        status IN ('pending', 'launched', 'running', 'completed', 'failed', 'coalesced',
                   'cancelled', 'dead_lettered', 'superseded')) NOT VALID;
ALTER TABLE job_requests VALIDATE CONSTRAINT job_requests_status_check;
ALTER TABLE job_requests DROP CONSTRAINT IF EXISTS job_requests_claim_rank_set,
    ADD CONSTRAINT job_requests_claim_rank_set CHECK (claim_rank IS NOT NULL) NOT VALID;
ALTER TABLE job_requests VALIDATE CONSTRAINT job_requests_claim_rank_set;
ALTER TABLE job_requests ALTER COLUMN claim_rank SET NOT NULL;
ALTER TABLE job_requests DROP CONSTRAINT IF EXISTS job_requests_claim_rank_set;
CREATE INDEX CONCURRENTLY IF NOT EXISTS job_requests_claim ON job_requests (claim_rank, id)
    WHERE status IN ('pending', 'launched');
CREATE INDEX CONCURRENTLY IF NOT EXISTS job_requests_debounce
    ON job_requests (debounce_key, created_at)
    WHERE status = 'pending' AND debounce_key IS NOT NULL;
CREATE INDEX CONCURRENTLY IF NOT EXISTS job_requests_coalesced_into
    ON job_requests (coalesced_into);
