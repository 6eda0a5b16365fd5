-- Named statements of engine/requests (RequestStore), the owner of job_requests, job_rejections,
-- request_cancels and request_sources. A block in queries.postgresql.sql or queries.sqlite.sql
-- wins for its dialect (row locks, index hints, the shape of a claim). Filled at import:
-- {columns} (job_requests' columns), {job_requests.columns} (the same named with their table), {read_request} (the
-- read_request block), {claimable} and {ready} (the blocks of those names). Filled by the caller
-- from code constants, never from input: {plain} (not_debounced or nothing), {types} (of_types
-- or nothing), {set} (to_launched or to_running), {i}, {branches}, {filters}, {attempt},
-- {where}, {order}, {limit}, {column}, {dead_lettered}.

-- read_request --
-- A request with its cancel and source (the side tables of 0140): what readers select; the
-- statements that read requests append their WHERE to it.
SELECT {job_requests.columns}, c.cancel_state, c.cancel_reason, c.cancel_by, c.cancel_requested_at,
    c.cancel_decided_at, c.cancel_detail, s.source
FROM job_requests
LEFT JOIN request_cancels c ON c.request_id = job_requests.id
LEFT JOIN request_sources s ON s.request_id = job_requests.id;

-- ready --
-- A pending request that may be claimed now (not given back for a retry later).
(available_at IS NULL OR available_at <= :now);

-- claimable --
-- Pending requests ({plain}: outside a debounce group, which leave through the group claim;
-- while 'coalesced' may not be written every pending request is plain), and launched ones whose
-- tick may have failed before Dagster launched their runs. The leading status IN lets both
-- databases read the partial index job_requests_claim in claim order and stop after a page,
-- instead of sorting the backlog.
status IN ('pending', 'launched') AND ((status = 'pending' {plain} AND {ready})
    OR (status = 'launched' AND updated_at <= :cutoff));

-- not_debounced --
-- {plain} of a claim that leaves debounced requests to their group's claim.
AND debounce_key IS NULL;

-- of_types --
-- {types} of a claim limited to some job types (:types expanding).
AND job_type IN :types;

-- to_launched --
-- What the intake sensor's claim writes ({set}): a run is launched next.
status = 'launched', updated_at = :now, claimed_at = COALESCE(claimed_at, :now);

-- to_running --
-- What a resident worker's claim writes ({set}): its run (:owner) takes the request now, an
-- attempt.
status = 'running', updated_at = :now, claimed_at = COALESCE(claimed_at, :now),
    run_id = :owner, attempts = attempts + 1, available_at = NULL;

-- insert_request --
-- A new request, unless its key is stored already (then no row back).
INSERT INTO job_requests
    (job_type, key, payload, payload_hash, status, queue, correlation_id, created_at,
     updated_at, attempts, traceparent, priority, claim_rank, dedupe_window, debounce_key,
     debounce_wait, debounce_max_wait, coalesced_count, amends, tenant, run_id)
VALUES (:job_type, :key, :payload, :hash, :status, :queue, :cid, :now, :now, 0, :traceparent,
        :priority, :rank, :dedupe_window, :debounce_key, :debounce_wait, :debounce_max_wait, 0,
        :amends, :tenant, :run_id)
ON CONFLICT (key) DO NOTHING
RETURNING {columns};

-- request_row_by_key --
-- The stored request of a key, without its side tables (the duplicate an insert ran into).
SELECT {columns} FROM job_requests WHERE key = :key;

-- insert_source --
-- How a request nobody enqueued came in (launchpad, a replay).
INSERT INTO request_sources (request_id, source) VALUES (:id, :s);

-- insert_rejection --
-- Keep one refused request (the values arrive bounded and storable: RequestStore.reject).
INSERT INTO job_rejections
    (job_type, key, payload, payload_size, payload_sha256, field, error, source, created_at)
VALUES (:job_type, :key, :payload, :size, :sha, :field, :error, :source, :now)
RETURNING id;

-- claim_debounce_winner --
-- The newest request of a due debounce group, claimed ({set}) with the group's payload and
-- count, while still pending.
UPDATE job_requests SET {set}, payload = :payload, payload_hash = :hash,
    coalesced_count = coalesced_count + :n
WHERE id = :id AND status = 'pending'
RETURNING {columns};

-- coalesce_group --
-- The other pending requests of a claimed group (:ids expanding) end coalesced into it.
UPDATE job_requests SET status = 'coalesced', coalesced_into = :into, updated_at = :now
WHERE id IN :ids AND status = 'pending';

-- coalesced_into --
-- The requests coalesced into one, oldest first.
SELECT {columns} FROM job_requests WHERE coalesced_into = :id ORDER BY created_at, id;

-- set_run_key --
-- The run key a launched request was emitted under.
UPDATE job_requests SET run_key = :rk WHERE id = :id;

-- move_requests --
-- Requests (:ids expanding) whose status is one of :sources (expanding, those that may go to
-- :target) move to :target in one conditional update; {filters} narrows the rows (run key,
-- current version, owner), {attempt} is 1 when the move counts an attempt.
UPDATE job_requests SET status = :target, updated_at = :now,
    run_id = COALESCE(:run_id, run_id),
    last_error = CASE WHEN :target = 'failed' THEN :error
        WHEN :target = 'completed' THEN NULL ELSE COALESCE(:error, last_error) END,
    error_class = CASE WHEN :target = 'failed' THEN :error_class
        WHEN :target = 'completed' THEN NULL
        ELSE COALESCE(:error_class, error_class) END,
    available_at = CASE WHEN :target = 'pending' THEN :available_at
        ELSE available_at END,
    attempts = attempts + {attempt}
WHERE id IN :ids AND status IN :sources{filters}
RETURNING id;

-- refuse_on_completion --
-- In the transaction that completes requests (:ids expanding): a cancel still requested is
-- refused.
UPDATE request_cancels SET cancel_state = 'refused', cancel_decided_at = :now,
    cancel_detail = 'refused: it completed before its next cancel point (the effect happened)'
WHERE request_id IN :ids AND cancel_state = 'requested';

-- holders --
-- The runs that hold requests now.
SELECT DISTINCT run_id FROM job_requests
WHERE status IN ('running', 'launched') AND run_id IS NOT NULL;

-- held_by_runs --
-- The requests the runs :owners (expanding) hold.
SELECT {columns} FROM job_requests
WHERE run_id IN :owners AND status IN ('running', 'launched');

-- supersede --
-- Close a failed request not superseded before: a newer version carries its intent.
UPDATE job_requests SET superseded_by = :by, updated_at = :now
WHERE id = :id AND status = 'failed' AND superseded_by IS NULL;

-- superseded_by --
-- The key of the version that replaced a request.
SELECT superseded_by FROM job_requests WHERE id = :id;

-- lock_request --
-- One request with its cancel and source, its row locked until the transaction ends where the
-- dialect locks rows.
{read_request} WHERE job_requests.id = :id;

-- set_status_seen --
-- A request's status, if it is still the one read (:seen).
UPDATE job_requests SET status = :status, updated_at = :now WHERE id = :id AND status = :seen;

-- upsert_cancel --
-- A request's cancel; replaces one requested while a run that then failed was running.
INSERT INTO request_cancels (request_id, cancel_state, cancel_reason, cancel_by,
    cancel_requested_at, cancel_decided_at, cancel_detail)
VALUES (:id, :state, :reason, :by, :now, :decided, :detail)
ON CONFLICT (request_id) DO UPDATE SET cancel_state = :state, cancel_reason = :reason,
    cancel_by = :by, cancel_requested_at = :now, cancel_decided_at = :decided,
    cancel_detail = :detail;

-- cancel_unheld --
-- A request whose cancel waited for the holder of its key ends cancelled, if its status is
-- still the one read (:seen).
UPDATE job_requests SET status = 'cancelled', updated_at = :now WHERE id = :id AND status = :seen;

-- decide_requested_cancel --
-- A cancel still requested ends cancelled, with what was done.
UPDATE request_cancels SET cancel_state = 'cancelled', cancel_detail = :detail,
    cancel_decided_at = :now
WHERE request_id = :id AND cancel_state = 'requested';

-- waiting_cancels --
-- Requests not running under their row whose cancel is still requested, by id.
SELECT c.request_id FROM request_cancels c
JOIN job_requests r ON r.id = c.request_id
WHERE c.cancel_state = 'requested' AND r.status IN ('pending', 'launched', 'failed')
ORDER BY c.request_id
LIMIT :n;

-- mark_cancelled --
-- The op stopped at a cancel point: the request ends cancelled, only if its cancel was asked.
UPDATE job_requests SET status = 'cancelled', updated_at = :now,
    run_id = COALESCE(:run_id, run_id)
WHERE id = :id AND status IN ('running', 'launched', 'pending', 'failed')
    AND EXISTS (SELECT 1 FROM request_cancels c WHERE c.request_id = :id
        AND c.cancel_state IN ('requested', 'cancelled'));

-- record_cancelled --
-- A request's cancel is decided cancelled, with what was done.
UPDATE request_cancels SET cancel_state = 'cancelled', cancel_detail = :detail,
    cancel_decided_at = :now
WHERE request_id = :id;

-- cancel_state_of_key --
-- The cancel state of the request stored under a key.
SELECT c.cancel_state FROM job_requests r
JOIN request_cancels c ON c.request_id = r.id
WHERE r.key = :key;

-- cancel_states_of_keys --
-- The cancel state of each request stored under one of :keys (expanding) that has one.
SELECT r.key, c.cancel_state FROM job_requests r
JOIN request_cancels c ON c.request_id = r.id
WHERE r.key IN :keys;

-- request_by_id --
-- One request with its cancel and source.
{read_request} WHERE job_requests.id = :id;

-- request_by_key --
-- The request stored under a key, with its cancel and source.
{read_request} WHERE job_requests.key = :key;

-- requests_by_ids --
-- Several requests (:ids expanding) with their cancels and sources, by id.
{read_request} WHERE job_requests.id IN :ids ORDER BY job_requests.id;

-- find_requests --
-- Requests matching {where} (the *_filter blocks given, joined by AND; match_all for none),
-- newest first.
{read_request} WHERE {where} ORDER BY job_requests.id DESC LIMIT :limit;

-- status_filter --
-- A filter of find_requests: a status among :statuses.
status IN :statuses;

-- job_type_filter --
-- A filter of find_requests: requests of job type :jt.
job_type = :jt;

-- tenant_filter --
-- A filter of find_requests: requests of tenant :tenant.
tenant = :tenant;

-- match_all --
-- No filter: every row matches.
1 = 1;

-- counts --
-- Requests per status.
SELECT status, COUNT(*) AS n FROM job_requests GROUP BY status;

-- counts_of_type --
-- Requests of one job type per status.
SELECT status, COUNT(*) AS n FROM job_requests WHERE job_type = :jt GROUP BY status;

-- open_dead_letters_of --
-- The requests among :ids (expanding) that an open DLQ record (:open, expanding) keeps.
SELECT DISTINCT request_id FROM dlq_records WHERE request_id IN :ids AND status IN :open;

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

-- expired_requests --
-- Finished requests last changed before :cutoff: completed, coalesced, cancelled, and failed
-- ones {dead_lettered} says the DLQ holds (a condition over job_requests.id).
updated_at <= :cutoff AND (status IN ('completed', 'coalesced', 'cancelled')
    OR (status = 'failed' AND {dead_lettered}));

-- unfinished_key_reference --
-- True while a request that has not finished carries the key in {column}.
EXISTS (SELECT 1 FROM job_requests r
    WHERE r.key = {column} AND r.status NOT IN ('completed', 'coalesced', 'cancelled'));

-- unfinished_request_reference --
-- True while the request whose id is in {column} exists and has not finished.
EXISTS (SELECT 1 FROM job_requests r
    WHERE r.id = {column} AND r.status NOT IN ('completed', 'coalesced', 'cancelled'));

-- rejections --
-- Refused requests matching {where} (the rejection_*_filter blocks given, joined by AND;
-- match_all for none), by id {order} (ASC or DESC), at most {limit}.
SELECT id, job_type, key, payload, field, error, created_at, payload_size, payload_sha256, source
FROM job_rejections WHERE {where}
ORDER BY id {order}{limit};

-- rejection_job_type_filter --
-- A filter of rejections: refusals of job type :job_type.
job_type = :job_type;

-- rejection_source_filter --
-- A filter of rejections: refusals that came in by :source.
source = :source;

-- rejection_by_id --
-- One refused request.
SELECT id, job_type, key, payload, field, error, created_at, payload_size, payload_sha256, source
FROM job_rejections
WHERE id = :id;
