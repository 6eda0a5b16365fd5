-- One row per attempt of a job request (invariant 6): inserted when the attempt starts
-- (outcome 'started'), updated when it ends. A row left at 'started' with no ended_at is an
-- attempt whose worker died (SIGKILL, OOM): the next attempt's takeover = 1 shows the redelivery.
-- Shaped for the metrics (issue 7): p50/p95/p99 of duration_seconds per job_type, retries by
-- error_class/reason, duplicate_suppressed per completed, lease takeovers, lock wait.
CREATE TABLE IF NOT EXISTS job_attempts (
    attempt_id        TEXT PRIMARY KEY,
    job_type          TEXT NOT NULL,
    idempotency_key   TEXT,
    resource_id       TEXT,
    run_id            TEXT,
    step              TEXT,
    attempt           INTEGER NOT NULL,
    claim_attempt     INTEGER,
    host              TEXT NOT NULL,
    pid               INTEGER NOT NULL,
    started_at        DOUBLE PRECISION NOT NULL,
    ended_at          DOUBLE PRECISION,
    duration_seconds  DOUBLE PRECISION,
    lock_wait_seconds DOUBLE PRECISION,
    fence             BIGINT,
    takeover          INTEGER NOT NULL DEFAULT 0,
    durations         TEXT,
    outcome           TEXT NOT NULL
        CHECK (outcome IN ('started', 'completed', 'duplicate_suppressed', 'retried',
                           'failed_permanent', 'dead_lettered', 'lease_lost',
                           'in_progress_elsewhere')),
    error_class       TEXT,
    error_kind        TEXT,
    error_reason      TEXT,
    status_before     TEXT,
    status_after      TEXT,
    correlation_id    TEXT,
    request_id        BIGINT
);

CREATE INDEX IF NOT EXISTS job_attempts_type_started ON job_attempts (job_type, started_at);

CREATE INDEX IF NOT EXISTS job_attempts_outcome_started ON job_attempts (outcome, started_at);

CREATE INDEX IF NOT EXISTS job_attempts_key ON job_attempts (idempotency_key, started_at);

CREATE INDEX IF NOT EXISTS job_attempts_correlation ON job_attempts (correlation_id);

CREATE INDEX IF NOT EXISTS job_attempts_run ON job_attempts (run_id, step);
