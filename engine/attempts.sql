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

-- duration_bins --
-- The histogram of durations per job type from one bucket on (the duration model's sliding
-- window: completed attempts and those that lost their lease): at most one row per job type
-- and bin, whatever the traffic.
SELECT job_type, bin, SUM(n) AS n
FROM job_attempt_rollups
WHERE metric = 'duration' AND bucket >= :from_bucket
GROUP BY job_type, bin;
