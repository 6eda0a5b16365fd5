-- Outbox dead letters (resources/outbox/dead_letters.py owns the table): an event whose
-- publication failed ``max_failures`` times in a row stops being retried and is kept here whole,
-- shown by `sekali outbox dead`, replayed or discarded by an operator. The outbox row counts its
-- failures and names its dead letter while one is open; later events of the same aggregate wait
-- behind it (order per aggregate), events of other aggregates never do. The previous release's
-- publishers know none of these columns: they keep retrying a dead event, as they did.
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS failures INTEGER NOT NULL DEFAULT 0;
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS last_error TEXT;
ALTER TABLE outbox ADD COLUMN IF NOT EXISTS dead_letter_id BIGINT;
CREATE TABLE IF NOT EXISTS outbox_dead_letters (
    id             {{identity}},
    outbox_id      BIGINT NOT NULL,
    event_id       TEXT NOT NULL UNIQUE,
    aggregate_type TEXT NOT NULL,
    aggregate_id   TEXT NOT NULL,
    event_type     TEXT NOT NULL,
    payload        TEXT NOT NULL,
    traceparent    TEXT,
    failures       INTEGER NOT NULL,
    last_error     TEXT,
    deaths         INTEGER NOT NULL DEFAULT 1,
    status         TEXT NOT NULL DEFAULT 'open'
        CHECK (status IN ('open', 'replayed', 'discarded')),
    detail         TEXT,
    created_at     DOUBLE PRECISION NOT NULL,
    updated_at     DOUBLE PRECISION NOT NULL
);
CREATE INDEX IF NOT EXISTS outbox_dead_letters_status ON outbox_dead_letters (status, id);
