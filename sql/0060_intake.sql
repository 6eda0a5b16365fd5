-- The intake: one row per accepted job request (unique on its idempotency key), and every
-- rejected request kept with the field that was wrong, so bad input is never lost.
-- Status transitions live beside the RequestStatus enum in resources/requests.py.
CREATE TABLE IF NOT EXISTS job_requests (
    id             {{identity}},
    job_type       TEXT NOT NULL,
    key            TEXT NOT NULL UNIQUE,
    payload        TEXT NOT NULL,
    payload_hash   TEXT NOT NULL,
    status         TEXT NOT NULL DEFAULT 'pending'
        CHECK (status IN ('pending', 'launched', 'running', 'completed', 'failed')),
    queue          TEXT NOT NULL,
    correlation_id TEXT,
    run_key        TEXT,
    run_id         TEXT,
    created_at     DOUBLE PRECISION NOT NULL,
    updated_at     DOUBLE PRECISION NOT NULL,
    attempts       INTEGER NOT NULL DEFAULT 0,
    last_error     TEXT
);

CREATE INDEX IF NOT EXISTS job_requests_status_id ON job_requests (status, id);

CREATE TABLE IF NOT EXISTS job_rejections (
    id         {{identity}},
    job_type   TEXT NOT NULL,
    key        TEXT,
    payload    TEXT NOT NULL,
    field      TEXT NOT NULL,
    error      TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL
);
