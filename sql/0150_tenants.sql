-- Fair share across tenants (engine/tenants.py owns the tenants table; docs/flow.md).
-- job_requests.tenant: the request's fairness key, written at enqueue; the previous release's
-- enqueue does not name it, so its requests take the constant default ('default', the tenant of
-- every request without a key). claimed_at: when the intake first claimed the request (its
-- wait is claimed_at - created_at); the previous release's claim leaves it NULL.
-- tenants: one row per tenant the operator set or the intake served (weight, guaranteed
-- minimum and burst maximum share; pass and claimed: the fair-share scheduler's state), and
-- the scheduler's virtual clock under the reserved name '~clock', whose row every fair claim
-- locks first, so claimers take their pages one after the other.
ALTER TABLE job_requests ADD COLUMN IF NOT EXISTS tenant TEXT NOT NULL DEFAULT 'default';
ALTER TABLE job_requests ADD COLUMN IF NOT EXISTS claimed_at DOUBLE PRECISION;
CREATE TABLE IF NOT EXISTS tenants (
    name       TEXT PRIMARY KEY,
    weight     DOUBLE PRECISION NOT NULL DEFAULT 1,
    min_share  DOUBLE PRECISION,
    max_share  DOUBLE PRECISION,
    pass       DOUBLE PRECISION NOT NULL DEFAULT 0,
    claimed    BIGINT NOT NULL DEFAULT 0,
    set_at     DOUBLE PRECISION,
    updated_at DOUBLE PRECISION
);
INSERT INTO tenants (name) VALUES ('~clock') ON CONFLICT (name) DO NOTHING;
