"""The retry budget: a token bucket per downstream, shared by every worker in Redis.

Each retry spends a token, each clean success refunds ``refill_per_success``. When it is empty
sekali gives up on the job with the reason ``"retry budget exhausted"`` (the job is dead-lettered
and replayed later, rate limited) rather than waiting: a waiting run holds a run-worker slot, and
a sick downstream would fill every slot with sleepers. First attempts never spend tokens, so
successes keep arriving (and refilling the bucket) once the downstream is back.
"""

from __future__ import annotations

from resources.storage.redis import RedisClient, Script, hash_tag

# KEYS[1] - the bucket of one downstream      KEYS[2] - when its failure burst began (ms)
# ARGV[1] - capacity (a missing bucket is full)      ARGV[2] - idle ttl in ms
# returns {1, level} when a token was taken, {0, level} when the bucket is empty
_SPEND = """
local t = redis.call('TIME')
redis.call('SET', KEYS[2], tostring(t[1] * 1000 + math.floor(t[2] / 1000)), 'NX', 'PX', ARGV[2])
local level = tonumber(redis.call('GET', KEYS[1]) or ARGV[1])
if level >= 1 then
    level = level - 1
    redis.call('SET', KEYS[1], tostring(level), 'PX', ARGV[2])
    return {1, tostring(level)}
end
return {0, tostring(level)}
"""

# KEYS[1] - the bucket of one downstream      KEYS[2] - when its failure burst began (ms)
# KEYS[3] - the lengths of its last bursts (seconds, newest first)
# ARGV[1] - capacity      ARGV[2] - tokens to add      ARGV[3] - idle ttl in ms
# ARGV[4] - how many burst lengths to keep
# returns the new level (a full bucket is deleted: missing means full)
_REFUND = """
local began = redis.call('GET', KEYS[2])
if began then
    local t = redis.call('TIME')
    local now = t[1] * 1000 + math.floor(t[2] / 1000)
    redis.call('DEL', KEYS[2])
    redis.call('LPUSH', KEYS[3], tostring(math.max(0, now - tonumber(began)) / 1000))
    redis.call('LTRIM', KEYS[3], 0, tonumber(ARGV[4]) - 1)
    redis.call('PEXPIRE', KEYS[3], ARGV[3])
end
local capacity = tonumber(ARGV[1])
local level = tonumber(redis.call('GET', KEYS[1]) or ARGV[1])
level = math.min(capacity, level + tonumber(ARGV[2]))
if level >= capacity then
    redis.call('DEL', KEYS[1])
else
    redis.call('SET', KEYS[1], tostring(level), 'PX', ARGV[3])
end
return tostring(level)
"""


KEPT_BURSTS = 50
"""Failure-burst lengths kept per downstream (bounded memory in Redis)."""


class RetryBudget:
    """A token bucket per downstream in Redis, shared by every worker of every process.

    Guarantee: the number of successful ``try_spend`` calls between refunds never exceeds the
    tokens in the bucket (each spend and refund is one Lua script, atomic in Redis). A missing
    bucket is full, so a fresh or flushed Redis starts generous rather than blocking work. With
    ``refill_per_success = 0.1`` retries are held to about 10% of successful calls in a steady
    state (the gRPC retry-throttling rule). Keys: ``{namespace}:retry-budget:{<downstream>}``
    (hash tag: Redis Cluster safe). An idle bucket's key expires after ``idle_ttl_seconds``
    (back to full).

    The same two scripts measure the downstream's **failure bursts** at no extra round trip: a
    retry asked for opens a burst (the Redis server's time, if none is open), the next clean
    success closes it and keeps its length among the last :data:`KEPT_BURSTS`
    (:meth:`bursts`): how long the downstream takes to recover, which the retry delays follow
    (:func:`resources.retry.policy.RetryPolicy.following`).
    """

    def __init__(
        self,
        client: RedisClient,
        *,
        capacity: float = 100.0,
        refill_per_success: float = 0.1,
        namespace: str = "sekali",
        idle_ttl_seconds: float = 24 * 3600,
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1 token")
        self.client = client
        self.capacity = float(capacity)
        self.refill_per_success = float(refill_per_success)
        self.namespace = namespace
        self._ttl_ms = int(idle_ttl_seconds * 1000)
        self._spend = Script(client, _SPEND, keeps="the retry budget")
        self._refund = Script(client, _REFUND, keeps="the retry budget")

    def key(self, downstream: str) -> str:
        return f"{self.namespace}:retry-budget:{{{hash_tag(downstream)}}}"

    def _burst_keys(self, downstream: str) -> list[str]:
        tag = hash_tag(downstream)  # one slot for the bucket and its bursts, whatever the name
        return [f"{self.namespace}:retry-burst:{{{tag}}}",
                f"{self.namespace}:retry-bursts:{{{tag}}}"]

    def try_spend(self, downstream: str) -> bool:
        """Take one token for one retry; False when the bucket is empty (do not retry)."""
        ok, _level = self._spend(keys=[self.key(downstream), self._burst_keys(downstream)[0]],
                                 args=[self.capacity, self._ttl_ms])
        return bool(int(ok))

    def refund(self, downstream: str, successes: int = 1) -> float:
        """Record clean successes: add ``refill_per_success`` for each, up to capacity (a batch
        refunds its successes in one call). Returns the level."""
        level = self._refund(
            keys=[self.key(downstream), *self._burst_keys(downstream)],
            args=[self.capacity, self.refill_per_success * successes, self._ttl_ms,
                  KEPT_BURSTS],
        )
        return float(level)

    def bursts(self, downstream: str) -> list[float]:
        """The lengths in seconds of the downstream's last failure bursts, newest first."""
        raw = self.client.lrange(self._burst_keys(downstream)[1], 0, KEPT_BURSTS - 1)
        return [float(v) for v in raw]

    def level(self, downstream: str) -> float:
        raw = self.client.get(self.key(downstream))
        return self.capacity if raw is None else float(raw)

    def reset(self, downstream: str) -> None:
        """Fill the bucket again (operator action after an incident)."""
        self.client.delete(self.key(downstream))
