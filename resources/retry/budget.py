"""The retry budget: a token bucket per downstream, shared by every worker in Redis.

Each retry spends a token, each clean success refunds ``refill_per_success``. When it is empty
sekali gives up on the job with the reason ``"retry budget exhausted"`` (the job is dead-lettered
and replayed later, rate limited) rather than waiting: a waiting run holds a run-worker slot, and
a sick downstream would fill every slot with sleepers. First attempts never spend tokens, so
successes keep arriving (and refilling the bucket) once the downstream is back.
"""

from __future__ import annotations

from resources.storage.redis import RedisClient, Script

# KEYS[1] - the bucket of one downstream
# ARGV[1] - capacity (a missing bucket is full)      ARGV[2] - idle ttl in ms
# returns {1, level} when a token was taken, {0, level} when the bucket is empty
_SPEND = """
local level = tonumber(redis.call('GET', KEYS[1]) or ARGV[1])
if level >= 1 then
    level = level - 1
    redis.call('SET', KEYS[1], tostring(level), 'PX', ARGV[2])
    return {1, tostring(level)}
end
return {0, tostring(level)}
"""

# KEYS[1] - the bucket of one downstream
# ARGV[1] - capacity      ARGV[2] - tokens to add      ARGV[3] - idle ttl in ms
# returns the new level (a full bucket is deleted: missing means full)
_REFUND = """
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


class RetryBudget:
    """A token bucket per downstream in Redis, shared by every worker of every process.

    Guarantee: the number of successful ``try_spend`` calls between refunds never exceeds the
    tokens in the bucket (each spend and refund is one Lua script, atomic in Redis). A missing
    bucket is full, so a fresh or flushed Redis starts generous rather than blocking work. With
    ``refill_per_success = 0.1`` retries are held to about 10% of successful calls in a steady
    state (the gRPC retry-throttling rule). Keys: ``{namespace}:retry-budget:{<downstream>}``
    (hash tag: Redis Cluster safe). An idle bucket's key expires after ``idle_ttl_seconds``
    (back to full).
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
        return f"{self.namespace}:retry-budget:{{{downstream}}}"

    def try_spend(self, downstream: str) -> bool:
        """Take one token for one retry; False when the bucket is empty (do not retry)."""
        ok, _level = self._spend(keys=[self.key(downstream)], args=[self.capacity, self._ttl_ms])
        return bool(int(ok))

    def refund(self, downstream: str, successes: int = 1) -> float:
        """Record clean successes: add ``refill_per_success`` for each, up to capacity (a batch
        refunds its successes in one call). Returns the level."""
        level = self._refund(
            keys=[self.key(downstream)],
            args=[self.capacity, self.refill_per_success * successes, self._ttl_ms],
        )
        return float(level)

    def level(self, downstream: str) -> float:
        raw = self.client.get(self.key(downstream))
        return self.capacity if raw is None else float(raw)

    def reset(self, downstream: str) -> None:
        """Fill the bucket again (operator action after an incident)."""
        self.client.delete(self.key(downstream))
