-- Named statements of engine/attempts.py (AttemptRecorder), the owner of job_attempts.

-- recent --
-- The newest attempts started since a moment, for the metrics window.
SELECT job_type, outcome, duration_seconds, lock_wait_seconds, takeover, error_class, error_kind,
       attempt, started_at, ended_at
FROM job_attempts
WHERE started_at >= :since
ORDER BY started_at DESC
LIMIT :limit;

-- since --
-- Every attempt started since a moment, oldest first, for the diagnosis checklist.
SELECT attempt_id, job_type, idempotency_key, attempt, started_at, ended_at, duration_seconds,
       lock_wait_seconds, takeover, durations, outcome, error_class, correlation_id, request_id
FROM job_attempts
WHERE started_at >= :since
ORDER BY started_at;

-- latest_for_key --
-- The job type and run of the newest attempt of one key.
SELECT job_type, run_id
FROM job_attempts
WHERE idempotency_key = :key
ORDER BY started_at DESC
LIMIT 1;

-- effect_run --
-- The run of the attempt that made the effect of one key (its completed attempt).
SELECT run_id
FROM job_attempts
WHERE idempotency_key = :key AND outcome = 'completed'
ORDER BY started_at
LIMIT 1;

-- first_started --
-- When the first attempt of one step of one run began (the retry policy's time budget).
SELECT MIN(started_at)
FROM job_attempts
WHERE run_id = :run AND step = :step;

-- effect_traceparent --
-- The trace context of the attempt that made the effect of one key.
SELECT traceparent
FROM job_attempts
WHERE idempotency_key = :key AND outcome = 'completed'
ORDER BY started_at
LIMIT 1;

-- rollup_totals --
-- The per-minute aggregates from one bucket on, summed per job type, metric, label and bin.
SELECT job_type, metric, label, bin, SUM(n) AS n
FROM job_attempt_rollups
WHERE bucket >= :from_bucket
GROUP BY job_type, metric, label, bin;

-- contributions_between --
-- What the attempts started in [since, until) contribute (the window's partial first minute).
SELECT job_type, outcome, error_class, takeover, lock_wait_seconds, duration_seconds
FROM job_attempts
WHERE started_at >= :since AND started_at < :until;

-- all_contributions --
-- What every attempt contributes, with its start (rebuilding the aggregates).
SELECT job_type, outcome, error_class, takeover, lock_wait_seconds, duration_seconds, started_at
FROM job_attempts;

-- ranked_in_bins --
-- The values at given ranks inside histogram bins, among the attempts started since a moment
-- (the rows behind a percentile), ranked by the database so only the answers travel.
-- {value}: the column; {rows}: which attempts count; {bins}: "WHEN <bin's condition> THEN <n>"
-- per wanted bin; {picks}: "(k = <n> AND rn = <rank, at most the bin's count>)" joined by OR.
WITH binned AS (
    SELECT {value} AS value, CASE {bins} END AS k
    FROM job_attempts
    WHERE started_at >= :since AND {rows}
), ranked AS (
    SELECT k, value,
           ROW_NUMBER() OVER (PARTITION BY k ORDER BY value) AS rn,
           COUNT(*) OVER (PARTITION BY k) AS cnt
    FROM binned
    WHERE k IS NOT NULL
)
SELECT k, rn, value
FROM ranked
WHERE {picks};

-- write_postgres --
-- Postgres: upsert the rows (:rows, a JSON array) and add their deltas to the rollups
-- (:deltas) in one statement: one round trip, one commit. {fields} and {upsert} are the
-- table's columns, filled at import.
WITH written AS (
    INSERT INTO job_attempts ({fields})
    SELECT {fields}
    FROM jsonb_populate_recordset(NULL::job_attempts, CAST(:rows AS jsonb))
    ON CONFLICT (attempt_id) DO UPDATE SET {upsert}
    RETURNING 1
)
INSERT INTO job_attempt_rollups AS r (bucket, job_type, metric, label, bin, shard, n)
SELECT d.bucket, d.job_type, d.metric, d.label, d.bin, d.shard, d.n
FROM jsonb_to_recordset(CAST(:deltas AS jsonb)) AS d(
    bucket double precision, job_type text, metric text, label text, bin integer,
    shard integer, n bigint)
ORDER BY d.bucket, d.job_type, d.metric, d.label, d.bin, d.shard
ON CONFLICT (bucket, job_type, metric, label, bin, shard) DO UPDATE SET n = r.n + excluded.n;

-- write_row --
-- SQLite: upsert one attempt row ({fields}, {params} and {upsert} filled at import).
INSERT INTO job_attempts ({fields})
VALUES ({params})
ON CONFLICT (attempt_id) DO UPDATE SET {upsert};

-- write_rollup --
-- SQLite: add one delta to a rollup.
INSERT INTO job_attempt_rollups AS r (bucket, job_type, metric, label, bin, shard, n)
VALUES (:bucket, :job_type, :metric, :label, :bin, :shard, :n)
ON CONFLICT (bucket, job_type, metric, label, bin, shard) DO UPDATE SET n = r.n + excluded.n;

-- for_key --
-- Every attempt of one key, oldest first ({fields} filled at import).
SELECT {fields} FROM job_attempts WHERE idempotency_key = :key ORDER BY started_at, attempt;

-- all_attempts --
-- Every attempt, oldest first ({fields} filled at import).
SELECT {fields} FROM job_attempts ORDER BY started_at;

-- all_of_type --
-- Every attempt of one job type, oldest first ({fields} filled at import).
SELECT {fields} FROM job_attempts WHERE job_type = :jt ORDER BY started_at;

-- expired --
-- The condition of an attempt started before :cutoff.
started_at <= :cutoff;

-- duration_bins --
-- The histogram of durations per job type from one bucket on (the duration model's sliding
-- window: completed attempts and those that lost their lease): at most one row per job type
-- and bin, whatever the traffic.
SELECT job_type, bin, SUM(n) AS n
FROM job_attempt_rollups
WHERE metric = 'duration' AND bucket >= :from_bucket
GROUP BY job_type, bin;
