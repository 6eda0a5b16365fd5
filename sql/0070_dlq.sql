-- The dead letter queue: one record per failed job request (or per job type and idempotency key
-- when a run names no request), however many runs failed for it; every run that failed for it is
-- listed once in dlq_failures, so seeing a run twice changes nothing; dlq_audit says who did what.
-- Status transitions live beside the DlqStatus enum in resources/dlq.py.
CREATE TABLE IF NOT EXISTS dlq_records (
    id               {{identity}},
    dedupe_key       TEXT NOT NULL UNIQUE,
    job_type         TEXT NOT NULL,
    idempotency_key  TEXT,
    request_id       BIGINT,
    run_id           TEXT,
    step             TEXT,
    payload          TEXT,
    run_config       TEXT,
    tags             TEXT,
    error_class      TEXT NOT NULL
        CHECK (error_class IN ('permanent', 'transient', 'data_bug', 'unknown')),
    error_type       TEXT NOT NULL,
    fingerprint      TEXT NOT NULL,
    last_error       TEXT,
    trace            TEXT,
    failure_count    INTEGER NOT NULL DEFAULT 1,
    replay_count     INTEGER NOT NULL DEFAULT 0,
    first_failed_at  DOUBLE PRECISION NOT NULL,
    last_failed_at   DOUBLE PRECISION NOT NULL,
    correlation_id   TEXT,
    status           TEXT NOT NULL DEFAULT 'open'
        CHECK (status IN ('open', 'replay_requested', 'replaying', 'resolved', 'discarded')),
    status_changed_at DOUBLE PRECISION NOT NULL,
    created_at       DOUBLE PRECISION NOT NULL,
    updated_at       DOUBLE PRECISION NOT NULL
);

CREATE INDEX IF NOT EXISTS dlq_records_status ON dlq_records (status, status_changed_at);

CREATE INDEX IF NOT EXISTS dlq_records_fingerprint ON dlq_records (fingerprint);

CREATE INDEX IF NOT EXISTS dlq_records_job_type ON dlq_records (job_type, error_class);

CREATE INDEX IF NOT EXISTS dlq_records_request ON dlq_records (request_id);

CREATE TABLE IF NOT EXISTS dlq_failures (
    record_id  BIGINT NOT NULL,
    run_id     TEXT NOT NULL,
    step       TEXT NOT NULL DEFAULT '',
    seen_at    DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (record_id, run_id, step)
);

CREATE TABLE IF NOT EXISTS dlq_audit (
    id         {{identity}},
    record_id  BIGINT NOT NULL,
    action     TEXT NOT NULL,
    actor      TEXT NOT NULL,
    from_status TEXT,
    to_status  TEXT,
    detail     TEXT,
    at         DOUBLE PRECISION NOT NULL
);

CREATE INDEX IF NOT EXISTS dlq_audit_record ON dlq_audit (record_id, id);
