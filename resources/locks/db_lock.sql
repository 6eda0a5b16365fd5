-- Named statements of resources/locks/db_lock.py (DbLock), the owner of lock_leases, and of
-- its lock_row. A block in db_lock.postgresql.sql wins on Postgres. {table} and {key_column}
-- are identifiers checked by lock_row, never input.

-- acquire --
-- Take the lease when it is free or expired, with the next fence; no row back when it is held.
INSERT INTO lock_leases AS l (name, owner_token, expires_at, fence, acquired_at, updated_at)
VALUES (:name, :token, :expires, 1, :now, :now)
ON CONFLICT (name) DO UPDATE
SET owner_token = excluded.owner_token, expires_at = excluded.expires_at, fence = l.fence + 1,
    acquired_at = excluded.acquired_at, updated_at = excluded.updated_at
WHERE l.owner_token IS NULL OR l.expires_at <= :now
RETURNING fence;

-- extend --
-- Extend a live lease its owner holds.
UPDATE lock_leases SET expires_at = :expires, updated_at = :now
WHERE name = :name AND owner_token = :token AND expires_at > :now;

-- release --
-- Free a lease its owner holds.
UPDATE lock_leases SET owner_token = NULL, expires_at = NULL, updated_at = :now
WHERE name = :name AND owner_token = :token;

-- owner --
-- Who holds a lease, until when.
SELECT owner_token, expires_at FROM lock_leases WHERE name = :name;

-- lock_row --
-- One business row, for the rest of the caller's transaction (SQLite's BEGIN IMMEDIATE already
-- holds the write lock: a plain read).
SELECT * FROM {table} WHERE {key_column} = :key;

-- lock_rows --
-- Business rows of :keys (expanding), for the rest of the caller's transaction (a plain read on
-- SQLite, as lock_row).
SELECT * FROM {table} WHERE {key_column} IN :keys ORDER BY {key_column};
