-- Named statements of resources/dlq (DlqViews reads, DlqStore writes), the owner of dlq_records,
-- dlq_failures and dlq_audit. A block in queries.postgresql.sql or queries.sqlite.sql wins for
-- its dialect. {columns} is dlq_records' column list, filled at import; {column} and
-- {unresolved} in a condition are filled from code (a column name, the unresolved statuses),
-- never from input.

-- record_by_id --
-- One record.
SELECT {columns}
FROM dlq_records
WHERE id = :id;

-- statuses_of_key --
-- The statuses of the records naming idempotency key :k.
SELECT DISTINCT status FROM dlq_records WHERE idempotency_key = :k;

-- record_by_key --
-- The record of one dedupe key.
SELECT {columns}
FROM dlq_records
WHERE dedupe_key = :k;

-- lock_by_id --
-- One record, locked until the transaction ends where the dialect locks rows.
SELECT {columns}
FROM dlq_records
WHERE id = :id;

-- lock_by_key --
-- The record of one dedupe key, locked until the transaction ends where the dialect locks rows.
SELECT {columns}
FROM dlq_records
WHERE dedupe_key = :k;

-- records_by_ids --
-- Several records (:ids expanding).
SELECT {columns}
FROM dlq_records
WHERE id IN :ids;

-- records_of_run --
-- The records a run's failures were counted on, by id.
SELECT {columns}
FROM dlq_records
WHERE id IN (SELECT record_id FROM dlq_failures WHERE run_id = :run)
ORDER BY id;

-- select_records --
-- The records matching {where} (DlqViews.list_records's filters joined by AND; match_all for
-- none), in its {order}, at most its {limit}.
SELECT {columns}
FROM dlq_records
WHERE {where}{order}{limit};

-- match_all --
-- No filter: every record matches.
1 = 1;

-- insert_record --
-- A new open record, unless its dedupe key has one already (then no row back).
INSERT INTO dlq_records (dedupe_key, job_type, idempotency_key, request_id, run_id, step, payload,
    run_config, tags, error_class, error_type, fingerprint, last_error, trace, failure_count,
    replay_count, first_failed_at, last_failed_at, correlation_id, status, status_changed_at,
    created_at, updated_at, trace_id)
VALUES (:dedupe_key, :job_type, :ikey, :request_id, :run_id, :step, :payload, :run_config, :tags,
    :eclass, :etype, :fp, :msg, :trace, 1, 0, :failed_at, :failed_at, :cid, 'open', :now, :now,
    :now, :trace_id)
ON CONFLICT (dedupe_key) DO NOTHING
RETURNING id, dedupe_key, job_type, idempotency_key, request_id, run_id, step, payload,
    run_config, tags, error_class, error_type, fingerprint, last_error, trace, failure_count,
    replay_count, first_failed_at, last_failed_at, correlation_id, status, status_changed_at,
    created_at, updated_at, trace_id;

-- insert_failure --
-- Count one (record, run, step) once: no row changed when it was seen before.
INSERT INTO dlq_failures (record_id, run_id, step, seen_at)
VALUES (:rid, :run, :step, :now)
ON CONFLICT DO NOTHING;

-- failed_again --
-- A later failure of a record: its error, count, last failure and status. A record first seen
-- without a run config or tags (batch, sweep) gets a later run's.
UPDATE dlq_records
SET run_id = :run_id, step = :step, error_class = :eclass,
    run_config = CASE WHEN run_config IS NULL OR run_config = '{}'
        THEN :run_config ELSE run_config END,
    tags = CASE WHEN tags IS NULL OR tags = '{}' THEN :tags ELSE tags END,
    error_type = :etype, fingerprint = :fp, last_error = :msg, trace = :trace,
    failure_count = failure_count + 1,
    last_failed_at = CASE WHEN last_failed_at > :failed_at
        THEN last_failed_at ELSE :failed_at END,
    status = :status,
    status_changed_at = CASE WHEN status = :status THEN status_changed_at ELSE :now END,
    updated_at = :now
WHERE id = :id;

-- supersede --
-- Close an open record whose request a new version replaced.
UPDATE dlq_records
SET status = 'discarded', status_changed_at = :now, updated_at = :now
WHERE id = :id AND status = 'open';

-- replay_requested_ids --
-- Up to :limit records waiting for their replay, oldest request first.
SELECT id FROM dlq_records
WHERE status = 'replay_requested'
ORDER BY status_changed_at, id
LIMIT :limit;

-- start_replays --
-- Claimed records (:ids expanding) to replaying, with their replay number increased.
UPDATE dlq_records
SET status = 'replaying', replay_count = replay_count + 1, status_changed_at = :now,
    updated_at = :now
WHERE id IN :ids AND status = 'replay_requested';

-- move --
-- One record from one of :sources (expanding) to :target; its class changes when :eclass is set.
UPDATE dlq_records
SET status = :target, status_changed_at = :now, error_class = COALESCE(:eclass, error_class),
    updated_at = :now
WHERE id = :id AND status IN :sources;

-- insert_audit --
-- One line of a record's audit trail.
INSERT INTO dlq_audit (record_id, action, actor, from_status, to_status, detail, at)
VALUES (:rid, :action, :actor, :f, :t, :detail, :at);

-- audit_of --
-- A record's audit trail, oldest first.
SELECT action, actor, from_status, to_status, detail, at
FROM dlq_audit
WHERE record_id = :id
ORDER BY id;

-- failures_of --
-- The runs that failed for a record, each once, in the order they were seen.
SELECT run_id FROM dlq_failures WHERE record_id = :id ORDER BY seen_at;

-- key_page --
-- (id, idempotency key) of the records in :statuses (expanding) with ids in (:after, :hi].
SELECT id, idempotency_key FROM dlq_records
WHERE id > :after AND id <= :hi AND status IN :statuses
ORDER BY id
LIMIT :limit;

-- newest_id --
-- The highest record id (NULL when there is none).
SELECT MAX(id) FROM dlq_records;

-- tally --
-- Records per (status, class) among :statuses (expanding).
SELECT status, error_class, COUNT(*) AS n
FROM dlq_records
WHERE status IN :statuses
GROUP BY status, error_class;

-- change_mark --
-- The newest audit id and how many audit rows sit among the :w ids below it.
SELECT m.top, (SELECT COUNT(*) FROM dlq_audit WHERE id > m.top - :w)
FROM (SELECT COALESCE(MAX(id), 0) AS top FROM dlq_audit) m;

-- counts --
-- Records per status.
SELECT status, COUNT(*) AS n FROM dlq_records GROUP BY status;

-- expired --
-- The condition of a resolved or discarded record past its retention (cutoff bound).
status IN ('resolved', 'discarded') AND status_changed_at <= :cutoff;

-- unresolved_key_reference --
-- True while an unresolved record names the idempotency key in {column}.
EXISTS (SELECT 1 FROM dlq_records d WHERE d.idempotency_key = {column}
        AND d.status IN ({unresolved}));

-- unresolved_request_reference --
-- True while an unresolved record holds the request whose id is in {column}.
EXISTS (SELECT 1 FROM dlq_records d WHERE d.request_id = {column}
        AND d.status IN ({unresolved}));

-- request_reference --
-- True when any record, whatever its status, holds the request in {column}.
EXISTS (SELECT 1 FROM dlq_records d WHERE d.request_id = {column});

-- open_by_class --
-- Records not yet resolved or discarded, per error class.
SELECT error_class, COUNT(*) AS n
FROM dlq_records
WHERE status NOT IN ('resolved', 'discarded')
GROUP BY error_class;

-- inflow_by_class --
-- Records that first failed since :since, per error class.
SELECT error_class, COUNT(*) AS n
FROM dlq_records
WHERE first_failed_at >= :since
GROUP BY error_class;

-- inflow_between --
-- How many records first failed in [:start, :end).
SELECT COUNT(*) FROM dlq_records WHERE first_failed_at >= :start AND first_failed_at < :end;

-- inflow_since --
-- How many records first failed at or after :start.
SELECT COUNT(*) FROM dlq_records WHERE first_failed_at >= :start;
