-- The fair claim's index: each tenant's claimable requests in claim order (engine/requests.py),
-- and the recently claimed requests whose waits the metrics read; built concurrently.
-- sekali: online
CREATE INDEX CONCURRENTLY IF NOT EXISTS job_requests_tenant_claim
    ON job_requests (tenant, claim_rank, id)
    WHERE status IN ('pending', 'launched');
CREATE INDEX CONCURRENTLY IF NOT EXISTS job_requests_claimed_at ON job_requests (claimed_at)
    WHERE claimed_at IS NOT NULL;
