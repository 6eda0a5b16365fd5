-- A rejection keeps a bounded excerpt of what was refused (job_rejections.payload), with the
-- size and sha256 of the whole and the way in that refused it (enqueue, cli, run_config,
-- dlq_replay, micro_batch, fan_out).
ALTER TABLE job_rejections ADD COLUMN payload_size BIGINT;
ALTER TABLE job_rejections ADD COLUMN payload_sha256 TEXT;
ALTER TABLE job_rejections ADD COLUMN source TEXT;
