"""The idempotency ledger: a key names one business intent, and its effect happens once.

The work is done by :class:`IdempotencyStore` (:mod:`resources.idempotency.store`).
"""

from resources.errors import AlreadyInProgress, IdempotencyConflict, LeaseLost, StoredFailure
from resources.idempotency.store import (
    BatchLeaseKeeper,
    BeginOutcome,
    Claim,
    Completed,
    IdempotencyStore,
    Keeper,
    LeaseKeeper,
    Record,
    Status,
    idempotency_records,
    payload_hash,
)

__all__ = [
    "AlreadyInProgress",
    "BatchLeaseKeeper",
    "BeginOutcome",
    "Claim",
    "Completed",
    "IdempotencyConflict",
    "IdempotencyStore",
    "Keeper",
    "LeaseKeeper",
    "LeaseLost",
    "Record",
    "Status",
    "StoredFailure",
    "idempotency_records",
    "payload_hash",
]
