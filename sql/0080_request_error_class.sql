-- The class a request's failure was recorded with (permanent, transient, data_bug, unknown),
-- decided once by the failure path from the exception itself; the DLQ sweep reads it instead of
-- guessing from the error's name.
ALTER TABLE job_requests ADD COLUMN error_class TEXT;
