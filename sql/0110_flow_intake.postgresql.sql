-- Intake flow control (docs/flow.md): a request's priority, the dedupe window its key was
-- derived under (NULL: until finished), its debounce group with the group's wait and maximum
-- wait, and, for a request coalesced into another, the status 'coalesced' and the link.
-- claim_rank is the order the intake claims in: created_at - priority x aging (a request of
-- priority p is served as if it had arrived p x aging seconds earlier), indexed for the claim.
ALTER TABLE job_requests ADD COLUMN IF NOT EXISTS priority INTEGER NOT NULL DEFAULT 0;
ALTER TABLE job_requests ADD COLUMN IF NOT EXISTS claim_rank DOUBLE PRECISION;
UPDATE job_requests SET claim_rank = created_at WHERE claim_rank IS NULL;
ALTER TABLE job_requests ALTER COLUMN claim_rank SET NOT NULL;
ALTER TABLE job_requests ADD COLUMN IF NOT EXISTS dedupe_window DOUBLE PRECISION;
ALTER TABLE job_requests ADD COLUMN IF NOT EXISTS debounce_key TEXT;
ALTER TABLE job_requests ADD COLUMN IF NOT EXISTS debounce_wait DOUBLE PRECISION;
ALTER TABLE job_requests ADD COLUMN IF NOT EXISTS debounce_max_wait DOUBLE PRECISION;
ALTER TABLE job_requests ADD COLUMN IF NOT EXISTS coalesced_into BIGINT;
ALTER TABLE job_requests ADD COLUMN IF NOT EXISTS coalesced_count INTEGER NOT NULL DEFAULT 0;
ALTER TABLE job_requests DROP CONSTRAINT IF EXISTS job_requests_status_check;
ALTER TABLE job_requests ADD CONSTRAINT job_requests_status_check CHECK (
    status IN ('pending', 'launched', 'running', 'completed', 'failed', 'coalesced'));
CREATE INDEX IF NOT EXISTS job_requests_claim ON job_requests (claim_rank, id)
    WHERE status IN ('pending', 'launched');
CREATE INDEX IF NOT EXISTS job_requests_debounce ON job_requests (debounce_key, created_at)
    WHERE status = 'pending' AND debounce_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS job_requests_coalesced_into ON job_requests (coalesced_into);
