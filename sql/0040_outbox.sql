-- Transactional outbox (rows written in the business change's own transaction) and the inbox
-- consumers use to drop redelivered events. The publisher lives in resources/outbox.py.
CREATE TABLE IF NOT EXISTS outbox (
    id             {{identity}},
    event_id       TEXT NOT NULL UNIQUE,
    aggregate_type TEXT NOT NULL,
    aggregate_id   TEXT NOT NULL,
    event_type     TEXT NOT NULL,
    payload        TEXT NOT NULL,
    created_at     DOUBLE PRECISION NOT NULL,
    published_at   DOUBLE PRECISION,
    claimed_by     TEXT,
    claimed_until  DOUBLE PRECISION,
    attempts       INTEGER NOT NULL DEFAULT 0
);

CREATE INDEX IF NOT EXISTS outbox_unpublished ON outbox (published_at, id);

CREATE INDEX IF NOT EXISTS outbox_aggregate ON outbox (aggregate_type, aggregate_id, id);

CREATE TABLE IF NOT EXISTS inbox (
    consumer     TEXT NOT NULL,
    event_id     TEXT NOT NULL,
    processed_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (consumer, event_id)
);
