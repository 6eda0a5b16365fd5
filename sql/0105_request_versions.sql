-- Amended replay: a new version of an intent under a derived key (payment:o1#v2), linked to
-- the key it supersedes. Owner: pipelines/replay.py. Each key is superseded at most once
-- (unique previous_key) and a chain has one row per version (unique base_key, version), so
-- concurrent amendments of one record make exactly one new version.
CREATE TABLE IF NOT EXISTS request_versions (
    id                  {{identity}},
    base_key            TEXT NOT NULL,
    version             INTEGER NOT NULL,
    key                 TEXT NOT NULL UNIQUE,
    job_type            TEXT NOT NULL,
    request_id          BIGINT,
    previous_key        TEXT NOT NULL UNIQUE,
    previous_request_id BIGINT,
    previous_record_id  BIGINT,
    actor               TEXT NOT NULL,
    reason              TEXT,
    diff                TEXT NOT NULL,
    created_at          DOUBLE PRECISION NOT NULL,
    UNIQUE (base_key, version)
);

CREATE INDEX IF NOT EXISTS request_versions_base ON request_versions (base_key, version);

-- The request a newer version replaced: closed, never requeued. (Guarded since it was first
-- applied, so the file can run again; the checksums it had then are accepted.)
-- sekali: accepts bf32480a0c47801d 80bb499a4fd8488b
ALTER TABLE job_requests ADD COLUMN IF NOT EXISTS superseded_by TEXT;
