-- An amended request (pipelines/replay.py) names the key of the version it amends, so the run
-- that serves it can say so (the sekali/amends tag) without a join.
-- (Guarded since it was first applied, so the file can run again; its checksum then is accepted.)
-- sekali: accepts b48137cb3ef74566
ALTER TABLE job_requests ADD COLUMN IF NOT EXISTS amends TEXT;
