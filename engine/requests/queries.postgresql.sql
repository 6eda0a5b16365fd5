-- The statements of engine/requests/queries.sql whose Postgres text differs: row locks and the
-- claims. Postgres re-evaluates an IN (SELECT ... LIMIT ... FOR UPDATE SKIP LOCKED) subquery per
-- outer row and can claim more than the limit; a materialised CTE picks the rows exactly once.
-- Claimers skip the rows another claimer holds instead of waiting for them.

-- claim --
-- Up to :limit claimable requests ({claimable}, of {types}) move to {set}, lowest claim_rank
-- first.
WITH picked AS MATERIALIZED (
    SELECT id FROM job_requests
    WHERE {claimable} {types}
    ORDER BY claim_rank, id LIMIT :limit FOR UPDATE SKIP LOCKED
)
UPDATE job_requests SET {set}
FROM picked
WHERE job_requests.id = picked.id
RETURNING {job_requests.columns};

-- due_groups --
-- The debounce groups that are due: the newest request is debounce_wait old (the burst is
-- over) or the oldest is debounce_max_wait old, oldest group first, at most :limit.
SELECT debounce_key, COUNT(*) AS n
FROM job_requests
WHERE status = 'pending' AND debounce_key IS NOT NULL AND {ready} {types}
GROUP BY debounce_key
HAVING MAX(created_at) <= :now - MIN(debounce_wait)
    OR MIN(created_at) <= :now - MIN(debounce_max_wait)
ORDER BY MIN(created_at), debounce_key
LIMIT :limit;

-- debounce_group --
-- The pending requests of one due group, oldest first, locked: every claimer locks a group's
-- rows in the same order; a second claimer waits here, then finds them no longer pending
-- (READ COMMITTED re-reads the locked rows).
SELECT {columns} FROM job_requests
WHERE debounce_key = :k AND status = 'pending' AND {ready}
ORDER BY created_at, id FOR UPDATE;

-- active_tenants --
-- Each tenant with requests waiting (a skip scan: one index probe per tenant, however long its
-- backlog), its claimable requests counted up to the page, and its settings and pass (NULL:
-- never seen). See RequestClaims._claim_fair for why it reads two index ranges.
WITH RECURSIVE active(name) AS (
    SELECT (SELECT tenant FROM job_requests
            WHERE status IN ('pending', 'launched') ORDER BY tenant LIMIT 1)
    UNION ALL
    SELECT (SELECT tenant FROM job_requests
            WHERE status IN ('pending', 'launched') AND tenant > active.name
            ORDER BY tenant LIMIT 1)
    FROM active WHERE active.name IS NOT NULL
)
SELECT a.name, t.weight, t.min_share, t.max_share, t.pass AS pass_,
    (SELECT COUNT(*) FROM (
        SELECT 1 FROM job_requests
        WHERE tenant = a.name AND status IN ('pending', 'launched') AND status = 'pending'
            {plain} {types}
        ORDER BY updated_at LIMIT :limit) p) AS pending,
    (SELECT COUNT(*) FROM (
        SELECT 1 FROM job_requests
        WHERE tenant = a.name AND status IN ('pending', 'launched') AND status = 'launched'
            AND updated_at <= :cutoff {types}
        ORDER BY updated_at DESC LIMIT :limit) d) AS due
FROM active a LEFT JOIN tenants t ON t.name = a.name
WHERE a.name IS NOT NULL;

-- fair_branch --
-- Tenant {i}'s first :n{i} claimable requests in claim order, locked, skipping rows another
-- claimer holds (one branch of fair_claim).
SELECT id FROM (SELECT id FROM job_requests
    WHERE tenant = :t{i} AND {claimable} {types} ORDER BY claim_rank, id LIMIT :n{i}
    FOR UPDATE SKIP LOCKED) p{i};

-- fair_claim --
-- The requests the fair_branch {branches} (UNION ALL) pick move to {set}.
WITH picked AS MATERIALIZED ({branches})
UPDATE job_requests SET {set}
FROM picked
WHERE job_requests.id = picked.id
RETURNING {job_requests.columns};

-- lock_request --
-- One request with its cancel and source, its row locked until the transaction ends.
{read_request} WHERE job_requests.id = :id FOR UPDATE OF job_requests;
