-- Locks: lease rows for DbLock and the fence registry for fenced writes (resources/locks.py,
-- resources/fencing.py). A lease row is never deleted on release, so its fence only grows.
CREATE TABLE IF NOT EXISTS lock_leases (
    name        TEXT PRIMARY KEY,
    owner_token TEXT,
    expires_at  DOUBLE PRECISION,
    fence       BIGINT NOT NULL DEFAULT 0,
    acquired_at DOUBLE PRECISION,
    updated_at  DOUBLE PRECISION NOT NULL
);

CREATE TABLE IF NOT EXISTS fence_registry (
    resource      TEXT PRIMARY KEY,
    highest_fence BIGINT NOT NULL,
    rejected      BIGINT NOT NULL DEFAULT 0,
    updated_at    DOUBLE PRECISION NOT NULL
);
