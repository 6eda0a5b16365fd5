-- The requests a worker run holds (engine/requests.py RequestStore.take_back: what a dead
-- worker's run held goes back to pending).
CREATE INDEX IF NOT EXISTS job_requests_held ON job_requests (run_id)
    WHERE status IN ('running', 'launched');
