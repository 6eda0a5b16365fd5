-- Arrivals per job type in a recent window (engine/requests.py RequestStore.arrivals: the
-- workers' sizing reads the arrival rate every supervisor tick); built concurrently.
-- sekali: online
CREATE INDEX CONCURRENTLY IF NOT EXISTS job_requests_created ON job_requests (created_at);
