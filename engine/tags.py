"""Every run tag sekali writes or reads, by name. Nothing else spells a tag.

sekali's own tags (``sekali/...``) make runs findable by business intent in the Dagster UI's
runs list (filter by ``sekali/key``) and carry what the DLQ sensors need to find a failed
request again. Dagster's own tags (``dagster/...``) that sekali sets or reads are named here too.
"""

from __future__ import annotations

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
"""The DLQ record a replay run serves."""
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
    """A transient failure out of retries, or a run that died: in the DLQ, to be replayed."""
    FAILED = "failed"
    """A permanent failure (bad input, refused by the downstream): in the DLQ, never retried."""


# Dagster's
MAX_RUNTIME: Final = "dagster/max_runtime"
PRIORITY_RUN: Final = "dagster/priority"
"""Dagster's run queue launches higher values first; the intake sets the request's priority."""
RUN_KEY: Final = "dagster/run_key"
"""Set by Dagster on runs launched from a RunRequest."""
WILL_RETRY: Final = "dagster/will_retry"
FAILURE_REASON: Final = "dagster/failure_reason"
RETRY_ON_ASSET_OR_OP_FAILURE: Final = "dagster/retry_on_asset_or_op_failure"
DAGSTER_PREFIX: Final = "dagster/"

NO_RUN_RETRY: Final = {RETRY_ON_ASSET_OR_OP_FAILURE: "false"}
"""The op gives up on its own (the DLQ replays it): the run-retry daemon must not re-run it."""
