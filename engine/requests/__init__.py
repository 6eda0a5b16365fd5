"""The intake table: one row per accepted job request, unique on its idempotency key.

A request is what a producer asked for (``enqueue``); the intake sensor turns pending requests
into Dagster runs, and the request's status follows its run. The table is the producer-facing
record; the idempotency ledger (``resources/idempotency``) stays the guarantee that the effect
happens once, so a request launched twice (a sensor tick that failed after claiming, a re-emitted
batch) still has one effect.

Guarantees (SQLite and Postgres alike):

- ``enqueue`` is one conditional insert on the unique key: the same key with the same payload
  returns the existing request (``created=False``); with another payload it raises
  :class:`IdempotencyConflict` naming the key. Pass ``conn=`` to write it in your own transaction
  (the transactional outbox): the request exists if and only if your business change commits.
- ``claim_for_launch`` moves a bounded page of requests to ``launched`` in one statement
  (``FOR UPDATE SKIP LOCKED`` on Postgres), so two sensor ticks never claim the same request in
  the same window. A request left ``launched`` longer than ``relaunch_after`` is claimed again:
  that heals a tick that claimed and then failed before Dagster launched its runs; deterministic
  run keys make the re-emission a no-op when the run does exist.
- Every status change is one conditional ``UPDATE`` checked against :data:`TRANSITIONS`.
- Bad input is never lost: :meth:`RequestStore.reject` keeps it in ``job_rejections`` with the
  field, the error and the way in, as a bounded excerpt with the size and sha256 of the whole
  (a 10 MB refusal costs about 1 KiB).

The modules: :mod:`~engine.requests.model` (statuses, transitions, tables, rows, results),
:mod:`~engine.requests.store` (:class:`RequestStore`, made of :mod:`~engine.requests.intake`,
:mod:`~engine.requests.claims`, :mod:`~engine.requests.lifecycle`,
:mod:`~engine.requests.cancels` and :mod:`~engine.requests.views`), and the named statements
in ``queries.sql`` (``queries.postgresql.sql`` / ``queries.sqlite.sql`` where the dialects
differ). Import the public names from here.
"""

from engine.requests.cancels import cancel_requests, cancel_view, close_dead_letters
from engine.requests.model import (
    DEFAULT_PRIORITY_AGING,
    INTRODUCED_BY,
    TRANSITIONS,
    UNTAKEN_BACKOFF,
    Backoff,
    CancelDecision,
    CancelState,
    Clock,
    Debounced,
    EnqueueResult,
    JobRequest,
    Merge,
    RequestStatus,
    dedupe_label,
    job_rejections,
    job_requests,
    request_cancels,
    request_sources,
    state_of,
    windowed_key,
)
from engine.requests.store import RequestStore

__all__ = [
    "DEFAULT_PRIORITY_AGING",
    "INTRODUCED_BY",
    "TRANSITIONS",
    "UNTAKEN_BACKOFF",
    "Backoff",
    "CancelDecision",
    "CancelState",
    "Clock",
    "Debounced",
    "EnqueueResult",
    "JobRequest",
    "Merge",
    "RequestStatus",
    "RequestStore",
    "cancel_requests",
    "cancel_view",
    "close_dead_letters",
    "dedupe_label",
    "job_rejections",
    "job_requests",
    "request_cancels",
    "request_sources",
    "state_of",
    "windowed_key",
]
