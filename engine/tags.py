"""Every run tag sekali writes or reads, by name. Nothing else spells a tag.

sekali's own tags (``sekali/...``) make runs findable by business intent in the Dagster UI's
runs list (filter by ``sekali/key``) and carry what the DLQ sensors need to find a failed
request again. Dagster's own tags (``dagster/...``) that sekali sets or reads are named here too.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Final

# sekali's own
KEY: Final = "sekali/key"
"""The idempotency key the run serves (one request)."""
REQUEST_ID: Final = "sekali/request_id"
REQUEST_IDS: Final = "sekali/request_ids"
"""Comma-separated ``job_requests`` ids of a batch run."""
JOB_TYPE: Final = "sekali/job_type"
QUEUE: Final = "sekali/queue"
"""``heavy`` or ``light``: the run queue's tag concurrency limits read it."""
INTAKE: Final = "sekali/intake"
"""How the intake sensor launched the run: ``per_request``, ``fan_out`` or ``micro_batch``."""
CORRELATION_ID: Final = "sekali/correlation_id"
DLQ_ID: Final = "sekali/dlq_id"
"""The DLQ record a replay run serves (with ``sekali/dlq_replay``), or the one(s) a failed run was
dead-lettered as (comma-separated for a batch run): the record names that run back."""
DLQ_REPLAY: Final = "sekali/dlq_replay"
"""Which replay of that record (its replay count)."""
CHAOS: Final = "sekali/chaos"
TRACEPARENT: Final = "sekali/traceparent"
"""W3C trace context of the request the run serves: the run continues that trace."""
TRACE_ID: Final = "sekali/trace_id"
"""The trace's id, shown on the run page: search for it in the trace UI."""
OUTCOME: Final = "sekali/outcome"
"""How the run's request ended, a :class:`RunOutcome`; set from inside the op."""
ORIGINAL_RUN: Final = "sekali/original_run"
"""On a ``duplicate``: the run whose attempt made the effect."""
PRIORITY: Final = "sekali/priority"
"""The request's own priority (the highest of a batch's); Dagster's queue reads ``PRIORITY_RUN``."""
COALESCED: Final = "sekali/coalesced"
"""How many debounced requests were coalesced into the one(s) this run serves."""
AMENDS: Final = "sekali/amends"
"""On the run of an amended version (``key#vN``): the key of the version it replaces."""
CANCEL: Final = "sekali/cancel"
"""On the run of a request someone cancelled: how the cancel ended (``cancelled``, ``refused``),
with ``sekali/cancelled_by`` saying who."""
CANCELLED_BY: Final = "sekali/cancelled_by"
TENANT: Final = "sekali/tenant"
"""The tenant (fairness key) of the run's requests; ``~several`` on a batch that mixes them."""
SEVERAL_TENANTS: Final = "~several"
WORKER: Final = "sekali/worker"
"""On a resident worker's run: which worker slot of its queue it fills (``light/0``); the
supervisor keeps one run per slot alive, and the DLQ sensors leave these runs alone."""
DEDUPE_WINDOW: Final = "sekali/dedupe_window"
"""How long the run's key means one intent: ``until_finished`` or seconds (``86400s``)."""


class RunOutcome(StrEnum):
    """The values of ``sekali/outcome``: what a person filtering the runs list asks for."""

    EFFECT = "effect"
    """This run made the effect."""
    DUPLICATE = "duplicate"
    """The key was already done: no effect here, ``sekali/original_run`` names the run that did."""
    RETRIED = "retried"
    """The last attempt failed and a retry follows (the tag changes when it ends)."""
    DEAD_LETTERED = "dead_lettered"
    """In the DLQ (``sekali/dlq_id`` names the record): a transient failure out of retries, a
    run that died, or a permanent failure once the DLQ recorded it."""
    FAILED = "failed"
    """A permanent failure (bad input, refused by the downstream), until the DLQ records it
    (then ``dead_lettered``); never retried."""
    CANCELLED = "cancelled"
    """The request was cancelled: the run stopped before its next side effect (or never
    started one); no DLQ record, never retried."""


# Dagster's
MAX_RUNTIME: Final = "dagster/max_runtime"
"""Run monitoring ends a run still going after this many seconds: set by :func:`run_bound`."""
RUN_MARGIN_SECONDS: Final = 120.0
"""What a run adds to its handlers' bounds in ``dagster/max_runtime``: its start (a fresh
interpreter importing Dagster and the definitions) and settling its requests."""
PRIORITY_RUN: Final = "dagster/priority"
"""Dagster's run queue launches higher values first; the intake sets the request's priority."""
RUN_KEY: Final = "dagster/run_key"
"""Set by Dagster on runs launched from a RunRequest."""
WILL_RETRY: Final = "dagster/will_retry"
MAX_RETRIES: Final = "dagster/max_retries"
"""Run retries Dagster may make of this run (``0`` on a worker run: its supervisor relaunches)."""
FAILURE_REASON: Final = "dagster/failure_reason"
RETRY_ON_ASSET_OR_OP_FAILURE: Final = "dagster/retry_on_asset_or_op_failure"
DAGSTER_PREFIX: Final = "dagster/"

NO_RUN_RETRY: Final = {RETRY_ON_ASSET_OR_OP_FAILURE: "false"}
"""The op gives up on its own (the DLQ replays it): the run-retry daemon must not re-run it."""


def run_bound(handler_bounds: float) -> str:
    """The ``dagster/max_runtime`` of a run whose handlers may take ``handler_bounds`` seconds
    in all: above them by :data:`RUN_MARGIN_SECONDS`. The engine ends a hung handler at its own
    bound (``timed_out``, :func:`engine.runtime.execute_request`); run monitoring is the
    backstop for a run whose process stopped answering, and must not decide first (it would
    cancel the run, and the request would be settled by another path)."""
    return str(int(handler_bounds + RUN_MARGIN_SECONDS))


def run_correlation_id(configured: str | None, tags: Mapping[str, str], run_id: str) -> str:
    """The correlation id of a run's request: the op config's, else the run tag, else the run's
    own id (a Launchpad run given none). The op and the DLQ record it leaves both use this, so a
    replay or an amended version continues the same chain."""
    return configured or tags.get(CORRELATION_ID) or run_id
