"""The dead letter queue: what failed for good, kept with its reason until a person decides."""

from resources.dlq.fingerprints import failure_line, fingerprint, normalise_message, top_frame
from resources.dlq.records import (
    MIN_RETENTION_SECONDS,
    SUPERSEDED,
    UNRESOLVED,
    DlqRecord,
    DlqRecordNotFound,
    DlqStatus,
    FailureInfo,
    RecordedFailure,
    ReplayDecision,
    RetentionTooShort,
    dedupe_key_for,
    dlq_audit,
    dlq_failures,
    dlq_records,
    sources_of,
)
from resources.dlq.store import DlqStore
from resources.dlq.views import DlqViews, parse_age
from resources.retry.classify import FailureClass

__all__ = [
    "MIN_RETENTION_SECONDS",
    "DlqRecord",
    "DlqRecordNotFound",
    "DlqStatus",
    "DlqStore",
    "DlqViews",
    "FailureClass",
    "FailureInfo",
    "RecordedFailure",
    "ReplayDecision",
    "RetentionTooShort",
    "SUPERSEDED",
    "UNRESOLVED",
    "dedupe_key_for",
    "failure_line",
    "dlq_audit",
    "dlq_failures",
    "dlq_records",
    "fingerprint",
    "normalise_message",
    "parse_age",
    "sources_of",
    "top_frame",
]
