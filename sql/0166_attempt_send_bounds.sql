-- The send bounds an attempt was granted (engine/context.py ``confirm_lease``): a JSON list of
-- ``[asked, bound]`` wall-clock pairs, one per lease confirmation before a downstream call, so
-- every effect's arrival at the downstream can be checked against the lease of the holder that
-- sent it (``sekali chaos``). The previous release writes none: its attempts carry NULL.
ALTER TABLE job_attempts ADD COLUMN IF NOT EXISTS send_bounds TEXT;
