-- Retention: each purge picks its expired rows by the time column its owner keeps them by
-- (pipelines/retention.py); these indexes let a batch find them without reading the table.
CREATE INDEX IF NOT EXISTS job_attempts_started ON job_attempts (started_at);

CREATE INDEX IF NOT EXISTS job_requests_status_updated ON job_requests (status, updated_at);

CREATE INDEX IF NOT EXISTS job_rejections_created ON job_rejections (created_at);

CREATE INDEX IF NOT EXISTS report_snapshots_built ON report_snapshots (built_at);

CREATE INDEX IF NOT EXISTS outbox_published ON outbox (published_at);

CREATE INDEX IF NOT EXISTS inbox_processed ON inbox (processed_at);

CREATE INDEX IF NOT EXISTS dlq_records_key ON dlq_records (idempotency_key);
