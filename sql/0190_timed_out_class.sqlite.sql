-- sekali: replaces 0161_crash_loop_class
-- ``timed_out`` admitted as a DLQ failure class (see the Postgres file). SQLite changes a CHECK
-- only by rebuilding the table, as 0161 did: the rows are copied whole (ids kept; the runner
-- keeps the AUTOINCREMENT counter), then the indexes are made again. A reader of the previous
-- release reads the class as ``unknown`` (FailureClass.parse).
DROP TABLE IF EXISTS dlq_records_0190;
CREATE TABLE dlq_records_0190 (
    id               INTEGER PRIMARY KEY AUTOINCREMENT,
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
        CHECK (error_class IN ('permanent', 'transient', 'data_bug', 'unknown', 'crash_loop',
                        'timed_out')),
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
    updated_at       DOUBLE PRECISION NOT NULL,
    trace_id         TEXT
);
INSERT INTO dlq_records_0190 (id, dedupe_key, job_type, idempotency_key, request_id, run_id,
    step, payload, run_config, tags, error_class, error_type, fingerprint, last_error, trace,
    failure_count, replay_count, first_failed_at, last_failed_at, correlation_id, status,
    status_changed_at, created_at, updated_at, trace_id)
SELECT id, dedupe_key, job_type, idempotency_key, request_id, run_id, step, payload, run_config,
    tags, error_class, error_type, fingerprint, last_error, trace, failure_count, replay_count,
    first_failed_at, last_failed_at, correlation_id, status, status_changed_at, created_at,
    updated_at, trace_id
FROM dlq_records;
DROP TABLE dlq_records;
ALTER TABLE dlq_records_0190 RENAME TO dlq_records;
CREATE INDEX IF NOT EXISTS dlq_records_status ON dlq_records (status, status_changed_at);
CREATE INDEX IF NOT EXISTS dlq_records_fingerprint ON dlq_records (fingerprint);
CREATE INDEX IF NOT EXISTS dlq_records_job_type ON dlq_records (job_type, error_class);
CREATE INDEX IF NOT EXISTS dlq_records_request ON dlq_records (request_id);
CREATE INDEX IF NOT EXISTS dlq_records_key ON dlq_records (idempotency_key);
CREATE INDEX IF NOT EXISTS dlq_records_status_class ON dlq_records (status, error_class);
