-- The statements of engine/requests/queries.sql whose SQLite text differs: the claims. SQLite
-- runs each claim as one statement under the write lock (BEGIN IMMEDIATE), so the rows a
-- subquery picks are still claimable when they are updated; INDEXED BY names the index a claim
-- reads, since without statistics the planner would OR two other indexes and sort the whole
-- backlog.

-- claim --
-- Up to :limit claimable requests ({claimable}, of {types}) move to {set}, lowest claim_rank
-- first.
UPDATE job_requests SET {set}
WHERE id IN (
    SELECT id FROM job_requests INDEXED BY job_requests_claim
    WHERE {claimable} {types}
    ORDER BY claim_rank, id LIMIT :limit
)
RETURNING {columns};

-- due_groups --
-- The debounce groups that are due: the newest request is debounce_wait old (the burst is
-- over) or the oldest is debounce_max_wait old, oldest group first, at most :limit.
SELECT debounce_key, COUNT(*) AS n
FROM job_requests INDEXED BY job_requests_debounce
WHERE status = 'pending' AND debounce_key IS NOT NULL AND {ready} {types}
GROUP BY debounce_key
HAVING MAX(created_at) <= :now - MIN(debounce_wait)
    OR MIN(created_at) <= :now - MIN(debounce_max_wait)
ORDER BY MIN(created_at), debounce_key
LIMIT :limit;

-- debounce_group --
-- The pending requests of one due group, oldest first (the write lock already excludes every
-- other claimer).
SELECT {columns} FROM job_requests
WHERE debounce_key = :k AND status = 'pending' AND {ready}
ORDER BY created_at, id;

-- active_tenants --
-- Each tenant with requests waiting (a skip scan: one index probe per tenant, however long its
-- backlog), its claimable requests counted up to the page, and its settings and pass (NULL:
-- never seen). See RequestClaims._claim_fair for why it reads two index ranges.
WITH RECURSIVE active(name) AS (
    SELECT (SELECT tenant FROM job_requests INDEXED BY job_requests_tenant_claim
            WHERE status IN ('pending', 'launched') ORDER BY tenant LIMIT 1)
    UNION ALL
    SELECT (SELECT tenant FROM job_requests INDEXED BY job_requests_tenant_claim
            WHERE status IN ('pending', 'launched') AND tenant > active.name
            ORDER BY tenant LIMIT 1)
    FROM active WHERE active.name IS NOT NULL
)
SELECT a.name, t.weight, t.min_share, t.max_share, t.pass AS pass_,
    (SELECT COUNT(*) FROM (
        SELECT 1 FROM job_requests INDEXED BY job_requests_tenant_waiting
        WHERE tenant = a.name AND status IN ('pending', 'launched') AND status = 'pending'
            {plain} {types}
        ORDER BY updated_at LIMIT :limit) p) AS pending,
    (SELECT COUNT(*) FROM (
        SELECT 1 FROM job_requests INDEXED BY job_requests_tenant_waiting
        WHERE tenant = a.name AND status IN ('pending', 'launched') AND status = 'launched'
            AND updated_at <= :cutoff {types}
        ORDER BY updated_at DESC LIMIT :limit) d) AS due
FROM active a LEFT JOIN tenants t ON t.name = a.name
WHERE a.name IS NOT NULL;

-- fair_branch --
-- Tenant {i}'s first :n{i} claimable requests in claim order (one branch of fair_claim).
SELECT id FROM (SELECT id FROM job_requests INDEXED BY job_requests_tenant_claim
    WHERE tenant = :t{i} AND {claimable} {types} ORDER BY claim_rank, id LIMIT :n{i});

-- fair_claim --
-- The requests the fair_branch {branches} (UNION ALL) pick move to {set}.
UPDATE job_requests SET {set}
WHERE id IN ({branches})
RETURNING {columns};
