-- Signing secrets per webhook endpoint (resources/webhook_secrets.py owns both tables;
-- docs/webhooks.md "Secrets"). New tables only: the previous release neither reads nor writes
-- them (it signs with its one key), so an expand file.
-- webhook_secrets: every secret an endpoint has had; the active ones (expires_at NULL or in
-- the future) all sign each message during a rotation's overlap. derived: the row stands for
-- the endpoint's default secret (derived from the deployment's key), kept when a rotation
-- retires it, so its expiry is recorded.
-- webhook_endpoints: what an endpoint is allowed beyond the defaults (plain http).
CREATE TABLE IF NOT EXISTS webhook_secrets (
    id          {{identity}},
    endpoint_id TEXT NOT NULL,
    secret      TEXT NOT NULL,
    derived     INTEGER NOT NULL DEFAULT 0,
    created_at  DOUBLE PRECISION NOT NULL,
    expires_at  DOUBLE PRECISION,
    created_by  TEXT
);
CREATE INDEX IF NOT EXISTS webhook_secrets_endpoint ON webhook_secrets (endpoint_id, id);
CREATE TABLE IF NOT EXISTS webhook_endpoints (
    endpoint_id TEXT PRIMARY KEY,
    allow_http  INTEGER NOT NULL DEFAULT 0,
    updated_at  DOUBLE PRECISION NOT NULL,
    updated_by  TEXT
);
