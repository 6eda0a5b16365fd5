-- The DLQ records a run's failures went to (resources/dlq/store.py DlqStore.records_of_run: the
-- run-failure sensor links a failed run to the records its steps wrote at the decision); built
-- concurrently.
-- sekali: online
CREATE INDEX CONCURRENTLY IF NOT EXISTS dlq_failures_run ON dlq_failures (run_id);
