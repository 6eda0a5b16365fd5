-- Named statements of resources/outbox/events.py (write_event) and retention.py, over outbox
-- and inbox.

-- write_event --
-- One event, in the caller's transaction; nothing when its event id was written before.
INSERT INTO outbox (event_id, aggregate_type, aggregate_id, event_type, payload, created_at,
    attempts, traceparent)
VALUES (:event_id, :aggregate_type, :aggregate_id, :event_type, :payload, :now, 0, :traceparent)
ON CONFLICT (event_id) DO NOTHING;

-- published_before --
-- The condition of an outbox row published before :cutoff.
published_at IS NOT NULL AND published_at <= :cutoff;

-- processed_before --
-- The condition of an inbox entry processed before :cutoff.
processed_at <= :cutoff;

-- event_unpublished --
-- The condition that keeps an inbox entry whose event is still unpublished (it may come again).
EXISTS (SELECT 1 FROM outbox o WHERE o.event_id = inbox.event_id AND o.published_at IS NULL);
