-- Named statements of resources/locks/fencing.py, the owner of fence_registry.

-- advance --
-- Record :fence as the resource's highest when it is higher (or the same holder's again); no
-- row back when an older token arrives.
INSERT INTO fence_registry AS f (resource, highest_fence, holder, rejected, updated_at)
VALUES (:resource, :fence, :holder, 0, :now)
ON CONFLICT (resource) DO UPDATE
SET highest_fence = excluded.highest_fence, holder = excluded.holder,
    updated_at = excluded.updated_at
WHERE f.highest_fence < excluded.highest_fence
   OR (f.highest_fence = excluded.highest_fence AND f.holder = excluded.holder)
RETURNING highest_fence;

-- count_rejection --
-- Count one refused write of a resource; its highest fence back.
UPDATE fence_registry SET rejected = rejected + 1 WHERE resource = :resource
RETURNING highest_fence;

-- status --
-- What the registry knows of one resource.
SELECT resource, highest_fence, rejected FROM fence_registry WHERE resource = :resource;

-- fenced_row_update --
-- fenced_update: the row of {table} whose {column} is :v, updated only while its
-- {fence_column} is not above :fence, which it then records.
UPDATE {table} SET {assignments}, {fence_column} = :fence
WHERE {column} = :v AND {fence_column} <= :fence;

-- row_fence --
-- The fence a row of {table} last recorded.
SELECT {fence_column} FROM {table} WHERE {column} = :v;
