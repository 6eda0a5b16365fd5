-- The DLQ's per-tick tally (resources/dlq/store.py DlqStore.tally: records per status and class)
-- read from a covering index, built without stopping writers.
-- sekali: online
CREATE INDEX CONCURRENTLY IF NOT EXISTS dlq_records_status_class
    ON dlq_records (status, error_class);
