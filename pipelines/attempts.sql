-- Named statements of pipelines/attempts.py (AttemptRecorder), the owner of job_attempts.

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
