-- Named statements of resources/webhook_secrets.py (WebhookSecrets), the owner of
-- webhook_secrets and webhook_endpoints.

-- secrets_of --
-- Every secret one endpoint has had, newest first.
SELECT id, endpoint_id, secret, derived, created_at, expires_at
FROM webhook_secrets
WHERE endpoint_id = :endpoint
ORDER BY id DESC;

-- count_secrets --
-- How many secrets one endpoint has stored.
SELECT COUNT(*) FROM webhook_secrets WHERE endpoint_id = :endpoint;

-- insert_secret --
-- Store one secret of an endpoint.
INSERT INTO webhook_secrets (endpoint_id, secret, derived, created_at, created_by)
VALUES (:endpoint, :secret, :derived, :now, :actor)
RETURNING id;

-- expire_active --
-- The endpoint's secrets active now stay active until :until (a rotation's overlap).
UPDATE webhook_secrets
SET expires_at = :until
WHERE endpoint_id = :endpoint AND (expires_at IS NULL OR expires_at > :until);

-- endpoints_with_secrets --
-- The endpoints that have stored secrets.
SELECT DISTINCT endpoint_id FROM webhook_secrets ORDER BY endpoint_id;

-- set_allow_http --
-- Whether one endpoint's URL may be plain http.
INSERT INTO webhook_endpoints (endpoint_id, allow_http, updated_at, updated_by)
VALUES (:endpoint, :allowed, :now, :actor)
ON CONFLICT (endpoint_id) DO UPDATE
SET allow_http = excluded.allow_http, updated_at = excluded.updated_at,
    updated_by = excluded.updated_by;

-- allow_http_of --
-- Whether one endpoint's URL may be plain http.
SELECT allow_http FROM webhook_endpoints WHERE endpoint_id = :endpoint;
