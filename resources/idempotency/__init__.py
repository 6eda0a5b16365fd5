"""The idempotency ledger: a key names one business intent, and its effect happens once.

The work is done by :class:`IdempotencyStore` (:mod:`resources.idempotency.store`: claims and
the owner's writes), which extends :class:`LedgerViews` (:mod:`.views`: reads and retention);
the records, statuses and their transitions are in :mod:`.records`, the lease keepers in
:mod:`.keepers`, each dialect's way of claiming in :mod:`.dialects`, and every statement in
``queries.sql`` (with ``queries.postgresql.sql`` / ``queries.sqlite.sql`` where they differ).
"""

from resources.errors import AlreadyInProgress, IdempotencyConflict, LeaseLost, StoredFailure
from resources.idempotency.keepers import BatchLeaseKeeper, Keeper, LeaseKeeper
from resources.idempotency.records import (
    BeginOutcome,
    Claim,
    Completed,
    Record,
    Status,
    idempotency_records,
    payload_hash,
)
from resources.idempotency.store import IdempotencyStore
from resources.idempotency.views import LedgerViews

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
    "LedgerViews",
    "Record",
    "Status",
    "StoredFailure",
    "idempotency_records",
    "payload_hash",
]
