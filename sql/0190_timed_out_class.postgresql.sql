-- sekali: replaces 0161_crash_loop_class
-- ``timed_out`` admitted as a DLQ failure class (a handler that overran its job type's
-- ``max_runtime_seconds`` and was abandoned by the engine: resources/retry/classify.py). The
-- wider CHECK is added NOT VALID (metadata only) and validated under SHARE UPDATE EXCLUSIVE,
-- which writers pass. A reader of the previous release reads the class as ``unknown``
-- (FailureClass.parse), so the new value is safe before the contract step.
-- sekali: online
ALTER TABLE dlq_records DROP CONSTRAINT IF EXISTS dlq_records_error_class_check,
    ADD CONSTRAINT dlq_records_error_class_check CHECK (
        error_class IN ('permanent', 'transient', 'data_bug', 'unknown', 'crash_loop',
                        'timed_out')) NOT VALID;
ALTER TABLE dlq_records VALIDATE CONSTRAINT dlq_records_error_class_check;
