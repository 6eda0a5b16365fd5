-- The idempotency ledger: one row per business intent (the key), never per message or run.
-- Status transitions live beside the Status enum in resources/idempotency.py.
CREATE TABLE IF NOT EXISTS idempotency_records (
    key                  TEXT PRIMARY KEY,
    payload_hash         TEXT,
    status               TEXT NOT NULL
        CHECK (status IN ('in_progress', 'completed', 'failed', 'retryable')),
    owner_token          TEXT,
    lease_expires_at     DOUBLE PRECISION,
    fence                BIGINT NOT NULL DEFAULT 1,
    attempt              INTEGER NOT NULL DEFAULT 1,
    recovery_point       TEXT,
    recovery_data        TEXT,
    result               TEXT,
    error_class          TEXT,
    error_message        TEXT,
    created_at           DOUBLE PRECISION NOT NULL,
    updated_at           DOUBLE PRECISION NOT NULL,
    retention_expires_at DOUBLE PRECISION
);

CREATE INDEX IF NOT EXISTS idempotency_records_status_lease
    ON idempotency_records (status, lease_expires_at);

CREATE INDEX IF NOT EXISTS idempotency_records_retention
    ON idempotency_records (retention_expires_at);
