-- W3C trace context (a ``traceparent`` string) carried with the work, so one trace follows a
-- request from enqueue to effect across processes: the request, each attempt (a duplicate links
-- to the attempt that made the effect), each outbox event, and the trace id of a DLQ record.
ALTER TABLE job_requests ADD COLUMN traceparent TEXT;
ALTER TABLE job_attempts ADD COLUMN traceparent TEXT;
ALTER TABLE outbox ADD COLUMN traceparent TEXT;
ALTER TABLE dlq_records ADD COLUMN trace_id TEXT;
