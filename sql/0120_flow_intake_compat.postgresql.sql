-- The intake's flow-control columns made safe for the previous release's producers, and the
-- request statuses of this release admitted (expand/contract: sql/README, docs/upgrades.md).
--
-- 0110 made claim_rank NOT NULL with no default: every insert from a process of the previous
-- release (which does not know the column) failed once a new process had migrated. The trigger
-- fills it before the row is checked, with created_at (the rank of priority 0, the only
-- priority the previous release writes).
-- Metadata only, one short transaction: the columns are nullable or carry a constant default
-- (no rewrite). Where 0110 is pending, its backfill, checks and indexes are done online by 0121.
ALTER TABLE job_requests
    ADD COLUMN IF NOT EXISTS priority INTEGER NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS claim_rank DOUBLE PRECISION,
    ADD COLUMN IF NOT EXISTS dedupe_window DOUBLE PRECISION,
    ADD COLUMN IF NOT EXISTS debounce_key TEXT,
    ADD COLUMN IF NOT EXISTS debounce_wait DOUBLE PRECISION,
    ADD COLUMN IF NOT EXISTS debounce_max_wait DOUBLE PRECISION,
    ADD COLUMN IF NOT EXISTS coalesced_into BIGINT,
    ADD COLUMN IF NOT EXISTS coalesced_count INTEGER NOT NULL DEFAULT 0;
CREATE OR REPLACE FUNCTION sekali_job_requests_claim_rank() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.claim_rank := COALESCE(NEW.claim_rank, NEW.created_at);
    RETURN NEW;
END
$$;
DROP TRIGGER IF EXISTS job_requests_claim_rank ON job_requests;
CREATE TRIGGER job_requests_claim_rank BEFORE INSERT ON job_requests
    FOR EACH ROW EXECUTE FUNCTION sekali_job_requests_claim_rank();
