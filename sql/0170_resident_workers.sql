-- Resident workers (engine/worker.py): a request a worker gives back for a retry after the
-- policy's delay, or takes back from a dead worker whose lease on its key runs until then, is
-- pending but not claimed before available_at (NULL: at once). The previous release never
-- writes it and claims such a request early, which only retries it sooner (the ledger still
-- refuses a key in progress).
ALTER TABLE job_requests ADD COLUMN IF NOT EXISTS available_at DOUBLE PRECISION;
