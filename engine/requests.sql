-- Named statements of engine/requests.py (RequestStore), the owner of job_requests.

-- failed_without_dlq_record --
-- Failed requests that no DLQ record points at (the DLQ links back through request_id).
SELECT id, job_type, key, payload, payload_hash, status, queue, correlation_id, run_key, run_id,
       created_at, updated_at, attempts, last_error, error_class, traceparent, priority,
       claim_rank, dedupe_window, debounce_key, debounce_wait, debounce_max_wait, coalesced_into,
       coalesced_count, superseded_by, amends, tenant, claimed_at
FROM job_requests r
WHERE r.status = 'failed'
  AND NOT EXISTS (SELECT 1 FROM dlq_records d WHERE d.request_id = r.id)
ORDER BY r.id
LIMIT :limit;

-- failed_in_run --
-- The requests one run marked failed, in id order.
SELECT id, job_type, key, payload, payload_hash, status, queue, correlation_id, run_key, run_id,
       created_at, updated_at, attempts, last_error, error_class, traceparent, priority,
       claim_rank, dedupe_window, debounce_key, debounce_wait, debounce_max_wait, coalesced_into,
       coalesced_count, superseded_by, amends, tenant, claimed_at
FROM job_requests
WHERE run_id = :run AND status = 'failed'
ORDER BY id;

-- queue_stats --
-- Waiting requests per job type and status, with the oldest one's creation time.
SELECT job_type, status, COUNT(*) AS n, MIN(created_at) AS oldest
FROM job_requests
WHERE status IN ('pending', 'launched')
GROUP BY job_type, status;

-- correlation_ids_since --
-- The correlation id of each request created since a moment.
SELECT id, correlation_id
FROM job_requests
WHERE created_at >= :since;

-- insert_rejection --
-- Keep one refused request (the values arrive bounded and storable: RequestStore.reject).
INSERT INTO job_rejections
    (job_type, key, payload, payload_size, payload_sha256, field, error, source, created_at)
VALUES (:job_type, :key, :payload, :size, :sha, :field, :error, :source, :now)
RETURNING id;

-- cancel_stats --
-- Cancels asked since a moment, per state (requested, cancelled, refused).
SELECT cancel_state, COUNT(*) AS n
FROM request_cancels
WHERE cancel_requested_at >= :since
GROUP BY cancel_state;

-- tenant_waits --
-- How long the requests claimed since a moment waited, with their tenant, newest first.
SELECT tenant, claimed_at - created_at AS waited
FROM job_requests
WHERE claimed_at >= :since
ORDER BY claimed_at DESC
LIMIT :limit;

-- oldest_waiting_by_tenant --
-- Per tenant with pending requests (the fair claim's backlog, as the operator sees it): how
-- many, and the oldest one's creation time.
SELECT tenant, COUNT(*) AS n, MIN(created_at) AS oldest
FROM job_requests
WHERE status = 'pending'
GROUP BY tenant;

-- overtaking --
-- Requests of other tenants, created after a moment, that were claimed since then.
SELECT COUNT(*)
FROM job_requests
WHERE claimed_at >= :since AND created_at > :since AND tenant <> :tenant;

-- arrivals --
-- Requests created per job type since a moment (the arrival rate the workers are sized for).
SELECT job_type, COUNT(*) AS n
FROM job_requests
WHERE created_at >= :since
GROUP BY job_type;

-- arrivals_between --
-- Requests created per job type in [since, until) (a minute of the arrivals-against-capacity
-- picture).
SELECT job_type, COUNT(*) AS n
FROM job_requests
WHERE created_at >= :since AND created_at < :until
GROUP BY job_type;
