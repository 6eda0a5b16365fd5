"""Counters in one Redis hash with a hard bound on its fields and a lifetime when idle.

The cache and lock stats add per-pattern counters (``HINCRBYFLOAT``) from every process. Folding
names into patterns (:func:`resources.telemetry.patterns.key_pattern`) keeps the number of
fields small for names it understands; this keeps it bounded for every other name. One script
per flush:

- a field already in the hash is incremented;
- a new field is added only while the hash holds fewer than ``max_fields`` fields; past that its
  amount goes to its overflow field (``~overflow`` in place of the pattern), one per counter
  name, so totals stay right and the hash holds at most ``max_fields`` plus one field per name;
- the key's TTL is set to ``ttl_seconds`` on every write: stats of a namespace nobody uses any
  more expire instead of staying for ever.
"""

from __future__ import annotations

from collections.abc import Iterable

import redis
from redis.cluster import RedisCluster

OVERFLOW = "~overflow"
"""The pattern that counts everything past the cap."""
TTL_SECONDS = 7 * 86400.0
MAX_FIELDS = 4096

# KEYS[1] - the counters hash
# ARGV[1] - ttl in ms   ARGV[2] - most fields a new field may join
# ARGV[3..] - triples: field, its overflow field, amount
# returns how many amounts went to overflow fields
_ADD = """
local cap = tonumber(ARGV[2])
local n = redis.call('HLEN', KEYS[1])
local spilled = 0
for i = 3, #ARGV, 3 do
  local field = ARGV[i]
  if redis.call('HEXISTS', KEYS[1], field) == 0 then
    if n >= cap then
      field = ARGV[i + 1]
      spilled = spilled + 1
      if redis.call('HEXISTS', KEYS[1], field) == 0 then n = n + 1 end
    else
      n = n + 1
    end
  end
  redis.call('HINCRBYFLOAT', KEYS[1], field, ARGV[i + 2])
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return spilled
"""


class BoundedCounters:
    """The counters hash at ``key``; see the module docstring for the bounds."""

    def __init__(
        self,
        client: redis.Redis | RedisCluster,
        key: str,
        *,
        ttl_seconds: float = TTL_SECONDS,
        max_fields: int = MAX_FIELDS,
    ) -> None:
        if ttl_seconds <= 0 or max_fields < 1:
            raise ValueError("ttl_seconds must be positive and max_fields at least 1")
        self.key = key
        self.ttl_ms = int(ttl_seconds * 1000)
        self.max_fields = max_fields
        self._add = client.register_script(_ADD)

    def add(self, amounts: Iterable[tuple[str, str, float]]) -> int:
        """Add each ``(field, overflow field, amount)``; returns how many overflowed."""
        args: list[str | float] = [self.ttl_ms, self.max_fields]
        for field, overflow, amount in amounts:
            args += [field, overflow, amount]
        if len(args) == 2:
            return 0
        return int(self._add(keys=[self.key], args=args))
