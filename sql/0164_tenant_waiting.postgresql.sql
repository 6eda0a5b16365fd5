-- The fair claim's count of each tenant's claimable requests (engine/requests.py): pending ones
-- and launched ones due again, each a range of this index, never the requests already claimed;
-- built concurrently.
-- sekali: online
CREATE INDEX CONCURRENTLY IF NOT EXISTS job_requests_tenant_waiting
    ON job_requests (tenant, status, updated_at, debounce_key)
    WHERE status IN ('pending', 'launched');
