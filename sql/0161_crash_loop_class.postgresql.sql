-- ``crash_loop`` admitted as a DLQ failure class (a key whose worker died mid-run too often:
-- resources/retry/classify.py). The wider CHECK is added NOT VALID (metadata only) and validated
-- under SHARE UPDATE EXCLUSIVE, which writers pass. A reader of the previous release reads the
-- class as ``unknown`` (FailureClass.parse), so the new value is safe before the contract step.
-- sekali: online
ALTER TABLE dlq_records DROP CONSTRAINT IF EXISTS dlq_records_error_class_check,
    ADD CONSTRAINT dlq_records_error_class_check CHECK (
        error_class IN ('permanent', 'transient', 'data_bug', 'unknown', 'crash_loop')) NOT VALID;
ALTER TABLE dlq_records VALIDATE CONSTRAINT dlq_records_error_class_check;
