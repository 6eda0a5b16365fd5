-- Per-minute aggregates of job_attempts, so a metrics snapshot sums a few rows per minute instead
-- of reading every attempt of its window. Owned by pipelines/attempts.py (AttemptRecorder), which
-- writes each attempt's change here in the same transaction as the attempt row itself: the row's
-- old contribution is taken out and its new one added (outcome counts, retries by error class,
-- takeovers, lock failures, and histogram bins of durations and lock waits).
-- bucket: started_at floored to the minute; shard: spreads a hot counter over a few rows so
-- concurrent writers do not queue on one row lock (readers sum the shards).
CREATE TABLE IF NOT EXISTS job_attempt_rollups (
    bucket   DOUBLE PRECISION NOT NULL,
    job_type TEXT NOT NULL,
    metric   TEXT NOT NULL
        CHECK (metric IN ('outcome', 'retry', 'takeover', 'lock_failed', 'duration',
                          'lock_wait')),
    label    TEXT NOT NULL,
    bin      INTEGER NOT NULL,
    shard    INTEGER NOT NULL,
    n        BIGINT NOT NULL,
    PRIMARY KEY (bucket, job_type, metric, label, bin, shard)
);
