"""The one exception root of sekali and its few subclasses.

Every error says what happened and what to do next, and carries the data a caller needs to act
(the key, the lock name, the existing record). Each one is classified as permanent (never retry:
fix the input or the code, then replay) or transient (retry with backoff); the retry policy reads
``permanent`` and nothing else, so a new error class only has to set it.
"""

from __future__ import annotations

import json
from typing import Any


class SekaliError(Exception):
    """Root of every error raised by sekali. ``permanent`` decides whether a retry may help."""

    permanent: bool = False

    @property
    def kind(self) -> str:
        return "permanent" if self.permanent else "transient"


class TransientJobError(SekaliError):
    """A failure that may pass (timeout, connection reset, 5xx): retry with backoff and jitter."""

    permanent = False

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class PermanentJobError(SekaliError):
    """A failure that will not pass by retrying (bad input, a rule of the business refused it).

    Never retried; the request is kept in the DLQ with this reason. Fix the cause, then replay.
    """

    permanent = True


class ValidationError(PermanentJobError):
    """Bad input, naming the field (and ``limit``, the limit it broke, when there is one).
    Permanent: the request is kept, never retried. Fix the input and send it again.
    ``rejection_id``: the ``job_rejections`` row that keeps it, once the boundary wrote it.

    The message is ``field: problem``, and ``problem`` says what is wrong with what was sent
    (``limit: must be an integer, got "lots"``; ``required`` only when it is absent)."""

    rejection_id: int | None = None

    def __init__(self, field: str, problem: str, value: Any = None, *, limit: str | None = None
                 ) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem
        self.value = value
        self.limit = limit


def shown(value: Any, limit: int = 40) -> str:
    """A refused value as an error quotes it: its JSON text, cut to ``limit`` characters."""
    try:
        text = json.dumps(value, ensure_ascii=False, default=str)
    except ValueError:  # a structure too deep to encode is named by its type
        text = type(value).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


class IdempotencyConflict(PermanentJobError):
    """The key was used before with a different payload.

    A key names one business intent; the same key with another payload is a bug in the producer
    (two intents sharing a key), not a replay. Use a new key for a new intent.
    """

    def __init__(self, key: str, stored_hash: str | None, given_hash: str | None) -> None:
        super().__init__(
            f"idempotency key {key!r} was first used with another payload "
            f"(stored {stored_hash}, given {given_hash}); use a new key for a new intent"
        )
        self.key = key
        self.stored_hash = stored_hash
        self.given_hash = given_hash


class AlreadyInProgress(TransientJobError):
    """Another worker holds a live lease on this key. Retry after the lease can have ended."""

    def __init__(self, key: str, lease_expires_at: float | None, retry_after: float) -> None:
        super().__init__(
            f"idempotency key {key!r} is in progress under another owner's live lease; "
            f"retry in {retry_after:.1f}s",
            retry_after=retry_after,
        )
        self.key = key
        self.lease_expires_at = lease_expires_at


class RunEndedAroundRequest(TransientJobError):
    """The run that held this request ended (its worker killed or cut off, its launch failed,
    it was canceled) before any step decided on the request: nothing of the request itself
    failed. Replay it (its key keeps any effect that already happened from happening twice)."""

    def __init__(self, run_id: str, how: str) -> None:
        super().__init__(f"run {run_id} {how} before any step decided on this request; "
                         "nothing of the request failed: replay it")
        self.run_id = run_id


class NotYetSettled(TransientJobError):
    """An earlier attempt's effect has an unknown outcome (its call went out, no answer came
    back), and the downstream may still be processing it: looking it up now could miss it.

    Not a failure of this attempt: retry after ``retry_after`` seconds, when the settle window
    has passed and a lookup is conclusive. Doing the effect again before then could do it twice.
    """

    def __init__(self, message: str, *, settles_at: float, retry_after: float) -> None:
        super().__init__(message, retry_after=retry_after)
        self.settles_at = settles_at


class SendDeadlinePassed(TransientJobError):
    """A call to a downstream was refused by its own client before the request was written
    (or part-way, on a connection the client then closed: no server can act on a request cut
    short): the caller's send bound (a monotonic time) had passed. Nothing was sent, so no
    outcome is unknown. The caller confirms it still holds its lease and, if so, sends again
    with a new bound.
    """

    def __init__(self, what: str, late_by: float) -> None:
        super().__init__(
            f"{what} not sent: its send bound passed {late_by:.3f}s ago (the worker was paused "
            "or slow after confirming its lease); no request left this process"
        )
        self.late_by = late_by


class LeaseLost(SekaliError):
    """This holder's lease was taken over (it expired and another worker claimed the key), or
    ran out while the holder could not renew it (the store did not answer), so it may be.

    Stop at once: the new owner is doing the work. Nothing this holder writes through the store
    is applied. Not retried by this holder; the new owner finishes the job.
    """

    permanent = False

    def __init__(self, key: str, owner_token: str, *, reason: str | None = None) -> None:
        super().__init__(
            f"lease on {key!r} {reason or 'was taken over'}; owner {owner_token[:8]} must stop "
            "(the new owner continues from the last recovery point)"
        )
        self.key = key
        self.owner_token = owner_token
        self.reason = reason


class StoredFailure(PermanentJobError):
    """The key failed permanently before; its stored failure is returned instead of a re-run.

    An operator resets the key (``sekali dlq replay``) after fixing the cause.
    """

    def __init__(self, key: str, error_class: str | None, message: str | None) -> None:
        super().__init__(
            f"idempotency key {key!r} failed permanently before ({error_class}: {message}); "
            "fix the cause and replay it from the DLQ to run it again"
        )
        self.key = key
        self.error_class = error_class
        self.error_message = message


class RequestCancelled(PermanentJobError):
    """The request was cancelled (``sekali requests cancel``): this attempt stopped at a cancel
    point (``where``), before its next side effect. Never retried; nothing to do. To run the
    intent after all, enqueue it again under a new key."""

    def __init__(self, key: str, where: str, done: tuple[str, ...] = ()) -> None:
        super().__init__(
            f"request {key!r} was cancelled; stopped at {where}, before its next side "
            "effect: enqueue it again under a new key to run it after all"
        )
        self.key = key
        self.where = where
        self.done = done

    @property
    def detail(self) -> str:
        """What the request's record keeps: where it stopped and what was done before."""
        done = ", ".join(self.done) or "nothing"
        return f"cancelled while running: stopped at {self.where}; done before it: {done}"


class CancelUnavailable(SekaliError):
    """The request cannot be cancelled here: the database's readers may not know the
    ``cancelled`` status yet. Run ``sekali db contract`` once no process of the previous
    release runs, then cancel again."""
class CrashLoop(PermanentJobError):
    """A key's worker died mid-run (a takeover of its expired lease) more than ``limit`` times:
    its handler most likely kills the process (``os._exit``, out of memory, a native crash), so
    it is not run again. ``evidence`` lists the dead attempts (run id, worker pid, step
    reached). Find the cause in those runs' logs, fix it, then replay the DLQ record (the replay
    sets the count back to zero), or discard it."""

    def __init__(self, key: str, crashes: int, limit: int, evidence: list[dict[str, Any]]
                 ) -> None:
        reached = next((e["reached"] for e in reversed(evidence) if e.get("reached")), None)
        super().__init__(
            f"idempotency key {key!r} crashed its worker {crashes} times (limit {limit}): not"
            f" run again; last step reached: {reached or 'unknown'}; dead attempts:"
            f" {json.dumps(evidence, default=str)[:3000]}. Find the cause in those runs' logs,"
            " fix it, then replay this record (or discard it)"
        )
        self.key = key
        self.crashes = crashes
        self.limit = limit
        self.evidence = evidence


class HandlerTimedOut(PermanentJobError):
    """A handler ran past its job type's ``max_runtime_seconds`` (a downstream that never
    answers, a client without a timeout) and was abandoned: its lease is no longer renewed, its
    sends are refused (the send bound ends at the bound), its key passes to a takeover once the
    last lease has run out, and the abandoned holder counts towards the crash-loop bound.

    Permanent when the handler ran alone (``alone``): it is dead-lettered as ``timed_out``,
    not retried, since a retry would most likely hang again and the abandoned call may still
    be in flight. ``where`` says where the handler was when it was abandoned. Fix the
    downstream or give its client a timeout, then replay the record (the replay takes the key
    over and looks the effect up first). A group of handlers that overran together
    (``handler_many``) names no culprit: transient, each retried alone."""

    def __init__(self, key: str, bound: float, *, where: str = "", alone: bool = True
                 ) -> None:
        at = f"; abandoned at {where}" if where else ""
        who = "its handler" if alone else "the handlers of its batch, run together,"
        super().__init__(
            f"idempotency key {key!r}: {who} ran past the job type's bound of {bound:g} s"
            f" (max_runtime_seconds){at}. Its lease is no longer renewed and its sends are"
            " refused; the key is taken over once the lease runs out. Give the downstream's"
            " client a timeout (or raise the bound), then replay"
        )
        self.key = key
        self.bound = bound
        self.where = where
        self.alone = alone
        self.permanent = alone


class LockNotAcquired(TransientJobError):
    """The lock is held by someone else and the wait ran out. Retry later."""

    def __init__(self, name: str, waited: float) -> None:
        super().__init__(f"lock {name!r} not acquired within {waited:.3f}s; retry later")
        self.name = name
        self.waited = waited


class LockLost(SekaliError):
    """The lock expired or was taken while held. Stop before the next side effect.

    Any fenced write with this holder's (now older) fencing token is rejected, so stopping is
    safe; the job is retried by its policy and the new holder's writes stand.
    """

    permanent = False

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"lock {name!r} lost: {reason}; stop before the next side effect")
        self.name = name
        self.reason = reason


class FencedWriteRejected(SekaliError):
    """A guarded write carried an older fencing token than the resource has seen: a stale holder."""

    permanent = False

    def __init__(self, resource: str, fence: int, highest: int | None) -> None:
        super().__init__(
            f"write to {resource!r} with fencing token {fence} rejected; the resource has seen "
            f"{highest}: this holder is stale and must stop"
        )
        self.resource = resource
        self.fence = fence
        self.highest = highest


class StoreUnavailable(TransientJobError):
    """The database or Redis did not answer (connection refused, timeout, failover). Retry."""


class StoreFull(StoreUnavailable):
    """The store refused a write because it is full: the database's disk (SQLite "database or
    disk is full", Postgres ``disk_full``) or Redis's memory (``maxmemory`` reached under
    ``noeviction``). Nothing was written. Retry later; free space or memory, or raise the limit,
    so the retries succeed."""


class StoreReadOnly(StoreUnavailable):
    """The store accepts no writes now: a read-only Postgres session or hot standby, a read-only
    SQLite file, a Redis replica answering READONLY (a failover under way). Nothing was written.
    Retry once writes reach the primary again; if it lasts, point the URL at the primary."""


class EvictingRedis(SekaliError):
    """The Redis that would keep sekali's locks, fences, concurrency slots, rate buckets or retry
    budget may evict keys under memory pressure (any ``maxmemory-policy`` but ``noeviction``):
    an evicted lock key lets a second holder in while the first still works. Refused at the
    client's first use rather than failing silently later. Permanent until the configuration
    changes: set ``maxmemory-policy noeviction`` (``CONFIG SET`` and ``redis.conf``) or give these
    keys a Redis of their own, then replay what was dead-lettered (docs/locks.md)."""

    permanent = True

    def __init__(self, node: str, policy: str, maxmemory: int, keeps: str) -> None:
        limit = f"maxmemory {maxmemory} bytes" if maxmemory else "no maxmemory set yet"
        super().__init__(
            f"Redis at {node} has maxmemory-policy {policy} ({limit}): it may evict keys under "
            f"memory pressure, and sekali will not keep {keeps} where they can vanish (a second "
            "holder would get what the first still holds). Set maxmemory-policy noeviction on "
            "it (CONFIG SET maxmemory-policy noeviction, and in redis.conf), or point REDIS_URL "
            "at a Redis of their own that never evicts; see docs/locks.md"
        )
        self.node = node
        self.policy = policy
        self.maxmemory = maxmemory
        self.keeps = keeps


class AsyncReplication(SekaliError):
    """The Postgres primary replicates asynchronously (or does not flush its commits): a
    failover to a lagging standby rolls back keys completed in its lag while their effects
    (a charge, a mail) stay, and the requests run again. Refused at a process's first use of
    the database. Make a standby synchronous (``synchronous_standby_names`` and
    ``synchronous_commit = on``), or accept the risk with ``SEKALI_ACCEPT_ASYNC_REPLICATION=1``
    and keep the job types' first send looking up first (docs/chaos.md, ``pg-failover``)."""

    permanent = True

    def __init__(self, found: str) -> None:
        super().__init__(
            f"the database may lose completed keys in a failover: {found}. Make a standby "
            "synchronous (synchronous_standby_names naming it, synchronous_commit=on), or set "
            "SEKALI_ACCEPT_ASYNC_REPLICATION=1 to accept it (every job type with a side effect "
            "should then look its effect up before the first send); see docs/chaos.md, "
            "pg-failover"
        )
        self.found = found


class CacheLoadTimeout(TransientJobError):
    """A cache miss waited for another process's rebuild and the wait ran out (no stale value).

    The holder may be slow or dead (its lock expires by itself). Retry later; if loads often take
    longer than ``wait_timeout``, raise it, or set ``stale_ttl`` so callers get a stale value.
    """

    def __init__(self, key: str, waited: float) -> None:
        super().__init__(
            f"cache key {key!r}: waited {waited:.2f}s for another caller's load and got no value; "
            "retry later, or raise wait_timeout / set stale_ttl",
            retry_after=1.0,
        )
        self.key = key
        self.waited = waited


class CacheLoaderFailed(TransientJobError):
    """The load this caller waited for failed in another caller (or is negatively cached).

    Carries the failing load's error class and message; the error is not retried at once by every
    waiter (no second stampede). Retry later; fix the loader's dependency if it keeps failing.
    """

    def __init__(self, key: str, error_class: str, error_message: str) -> None:
        super().__init__(
            f"cache key {key!r}: the load failed with {error_class}: {error_message}; retry later"
        )
        self.key = key
        self.error_class = error_class
        self.error_message = error_message


class LimitNotAcquired(TransientJobError):
    """Every slot of a concurrency limit stayed taken until the wait ran out. Retry later.

    Contention, not a fault of the downstream: it spends no retry budget. If it happens often,
    the limit is too low for the traffic of that key, or holders keep their slot too long.
    """

    def __init__(self, name: str, key: str, limit: int, waited: float) -> None:
        super().__init__(
            f"concurrency limit {name!r} for key {key!r}: all {limit} slot(s) stayed taken for "
            f"{waited:.3f}s; retry later, or raise the limit if this key is always this busy"
        )
        self.name = name
        self.key = key
        self.limit = limit
        self.waited = waited


class RateLimited(TransientJobError):
    """A shared rate limit has no token for this call within the wait the caller accepts.

    ``retry_after`` says when enough tokens will have accrued (seconds); the retry policy waits
    at least that long. Our own pacing, not a fault of the downstream: it spends no retry budget.
    """

    retry_after: float

    def __init__(self, name: str, retry_after: float, cost: float = 1.0) -> None:
        super().__init__(
            f"rate limit {name!r}: no token for a call of cost {cost:g} before {retry_after:.3f}s;"
            " retry after that, or raise the rate if the downstream allows more",
            retry_after=retry_after,
        )
        self.name = name
        self.cost = cost
