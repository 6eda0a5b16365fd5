-- Cancelling a request (engine/requests.py RequestStore.cancel) and where a request came from,
-- beside job_requests rather than in it (a column there would be lost when 0120's SQLite
-- rebuild runs again, and the previous release never reads these): one row per request.
-- request_cancels.cancel_state: 'requested' (running: it stops at its next cancel point),
-- 'cancelled' or 'refused' (decided; cancel_detail says why), who asked, why and when beside it.
-- request_sources.source: 'launchpad' for a run launched by hand that the op recorded (a
-- request without a row here came through enqueue).
CREATE TABLE IF NOT EXISTS request_cancels (
    request_id          BIGINT PRIMARY KEY,
    cancel_state        TEXT NOT NULL
        CHECK (cancel_state IN ('requested', 'cancelled', 'refused')),
    cancel_reason       TEXT,
    cancel_by           TEXT NOT NULL,
    cancel_requested_at DOUBLE PRECISION NOT NULL,
    cancel_decided_at   DOUBLE PRECISION,
    cancel_detail       TEXT
);
CREATE INDEX IF NOT EXISTS request_cancels_requested ON request_cancels (cancel_requested_at);
CREATE TABLE IF NOT EXISTS request_sources (
    request_id BIGINT PRIMARY KEY,
    source     TEXT NOT NULL
);
