-- An amended request (pipelines/replay.py) names the key of the version it amends, so the run
-- that serves it can say so (the sekali/amends tag) without a join.
ALTER TABLE job_requests ADD COLUMN amends TEXT;
