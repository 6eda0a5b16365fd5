-- Every compensating or reconciling action, once per action key (the key is also claimed in the
-- idempotency store): what reconciliation found and what it did, for the audit and the metrics.
CREATE TABLE IF NOT EXISTS reconciliation_actions (
    action_key TEXT PRIMARY KEY,
    kind       TEXT NOT NULL,
    subject    TEXT NOT NULL,
    detail     TEXT,
    created_at DOUBLE PRECISION NOT NULL
);

CREATE INDEX IF NOT EXISTS reconciliation_actions_kind ON reconciliation_actions (kind, created_at);
