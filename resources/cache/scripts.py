"""The Lua scripts of the anti-stampede cache, and the Redis key layout they share.

Every per-key script touches only keys carrying the same hash tag ``{<namespace>:<key>}``, so each
runs in one slot (Redis Cluster safe). The stats and hot-key keys carry ``{<namespace>}``.

Every key has a TTL: per cache key as listed; the namespace's stats hash, hot-key sorted set and
decay time are refreshed to ``stats_ttl`` on each flush, and the stats hash and the sorted set
are capped (:mod:`resources.cache.stats`).

Key layout for cache key K in namespace N (tag T = ``{N:K}``)::

    sekali:cache:T          envelope JSON, Redis TTL = hard expiry
    sekali:cache:T:lock     rebuild lock, value = the rebuilder's random token (SET NX PX)
    sekali:cache:T:ver      invalidation version (max(INCR, server clock in us) by invalidate)
    sekali:cache:T:waiters  how many callers registered to wait for the current rebuild
    sekali:cache:T:signal   wake-up list: the rebuilder LPUSHes one per registered waiter
    sekali:cache:T:err      marker of the last failed load (token, class, message), short-lived
    sekali:cache:T:neg      negative-cache marker, only when ``negative_ttl`` is set
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "sekali:cache:"


@dataclass(frozen=True)
class KeyLayout:
    """The Redis keys of one cache key; all share one hash tag."""

    env: str
    lock: str
    ver: str
    waiters: str
    signal: str
    err: str
    neg: str

    @classmethod
    def of(cls, namespace: str, key: str) -> KeyLayout:
        env = f"{PREFIX}{{{namespace}:{key}}}"
        return cls(
            env=env,
            lock=env + ":lock",
            ver=env + ":ver",
            waiters=env + ":waiters",
            signal=env + ":signal",
            err=env + ":err",
            neg=env + ":neg",
        )


def namespace_keys(namespace: str) -> tuple[str, str, str]:
    """(stats hash, hot-key sorted set, decay guard) of a namespace."""
    base = f"{PREFIX}{{{namespace}}}"
    return base + ":stats", base + ":hot", base + ":hot:decayed"


# The envelope starts with {"s":soft,"h":hard,"d":delta, so Lua reads the header without decoding
# the value. XFetch: refresh early when now + delta * r >= soft, r = -beta * ln(U) from the caller.
# KEYS[1] - envelope   KEYS[2] - rebuild lock   KEYS[3] - invalidation version
# KEYS[4] - waiter count   KEYS[5] - last load error   KEYS[6] - negative-cache marker
# ARGV[1] - now (s)   ARGV[2] - XFetch r   ARGV[3] - lock token   ARGV[4] - lock ttl ms
# ARGV[5] - waiter ttl ms   ARGV[6] - '1' forces a refresh   ARGV[7] - error to wait on, or ''
# returns {state, envelope, got_lock, version, holder, error}: state 'fresh' | 'early' | 'stale'
# (a value, and the lock when got_lock = 1) | 'miss' (no value) | 'neg' | 'failed'
FETCH = """
local raw = redis.call('GET', KEYS[1])
local now = tonumber(ARGV[1])
local force = ARGV[6] == '1'
if raw then
  local s, h, d = string.match(raw, '^{"s":([^,]+),"h":([^,]+),"d":([^,]+),')
  s = tonumber(s); h = tonumber(h); d = tonumber(d)
  if now < h then
    if (not force) and now + d * tonumber(ARGV[2]) < s then
      return {'fresh', raw}
    end
    local state = 'early'
    if now >= s then state = 'stale' end
    local got = 0
    if redis.call('SET', KEYS[2], ARGV[3], 'NX', 'PX', ARGV[4]) then got = 1 end
    return {state, raw, got, redis.call('GET', KEYS[3]) or '0'}
  end
end
local neg = redis.call('GET', KEYS[6])
if neg then return {'neg', false, 0, '0', false, neg} end
if ARGV[7] ~= '' then
  local err = redis.call('GET', KEYS[5])
  if err and string.find(err, ARGV[7], 1, true) then
    return {'failed', false, 0, '0', false, err}
  end
end
if redis.call('SET', KEYS[2], ARGV[3], 'NX', 'PX', ARGV[4]) then
  return {'miss', false, 1, redis.call('GET', KEYS[3]) or '0'}
end
redis.call('INCR', KEYS[4])
redis.call('PEXPIRE', KEYS[4], ARGV[5])
local holder = redis.call('GET', KEYS[2]) or false
return {'miss', false, 0, '0', holder, redis.call('GET', KEYS[5]) or false}
"""
FETCH_KEYS = ("env", "lock", "ver", "waiters", "err", "neg")

# notify(waiters, signal, px, msg): push one wake-up per counted waiter onto the signal list;
# msg is '1' (look again) or '<token> <envelope>' (the value the waiters waited for).
_NOTIFY = """
local function notify(waiters, signal, px, msg)
  local n = tonumber(redis.call('GET', waiters) or '0')
  redis.call('DEL', waiters)
  for i = 1, n do redis.call('LPUSH', signal, msg or '1') end
  if n > 0 then redis.call('PEXPIRE', signal, px) end
end
"""

# Write only while holding the lock AND while the invalidation version is the one read when the
# lock was taken: a rebuild that began before an invalidate can never store its older value.
# KEYS[1] - envelope   KEYS[2] - rebuild lock   KEYS[3] - invalidation version
# KEYS[4] - waiter count   KEYS[5] - signal list   KEYS[6] - load error   KEYS[7] - negative marker
# ARGV[1] - lock token   ARGV[2] - version read with the lock   ARGV[3] - envelope
# ARGV[4] - envelope ttl ms   ARGV[5] - signal ttl ms
# returns 'ok' (stored; each waiter is pushed "<token> <envelope>") | 'lost' (the lock is not
# ours) | 'invalidated' (a newer version); on those two each waiter is pushed '1' (look again)
WRITE = (
    _NOTIFY
    + """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then
  notify(KEYS[4], KEYS[5], ARGV[5])
  return 'lost'
end
redis.call('DEL', KEYS[2])
if (redis.call('GET', KEYS[3]) or '0') ~= ARGV[2] then
  notify(KEYS[4], KEYS[5], ARGV[5])
  return 'invalidated'
end
redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[4])
redis.call('DEL', KEYS[6], KEYS[7])
notify(KEYS[4], KEYS[5], ARGV[5], ARGV[1] .. ' ' .. ARGV[3])
return 'ok'
"""
)
WRITE_KEYS = ("env", "lock", "ver", "waiters", "signal", "err", "neg")

# A failed load leaves a marker the waiters read, optionally a negative-cache marker, and either
# releases the lock (miss) or keeps it for a back-off (failed refresh: the stale value stays).
# KEYS[1] - rebuild lock   KEYS[2] - waiter count   KEYS[3] - signal list   KEYS[4] - load error
# KEYS[5] - negative marker
# ARGV[1] - lock token   ARGV[2] - error text   ARGV[3] - error ttl ms   ARGV[4] - negative ttl ms
# ARGV[5] - back-off ms (0: release the lock)   ARGV[6] - signal ttl ms
# returns 1 when recorded, 0 when the lock was not ours
FAIL = (
    _NOTIFY
    + """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  notify(KEYS[2], KEYS[3], ARGV[6])
  return 0
end
redis.call('SET', KEYS[4], ARGV[2], 'PX', ARGV[3])
if tonumber(ARGV[4]) > 0 then redis.call('SET', KEYS[5], ARGV[2], 'PX', ARGV[4]) end
if tonumber(ARGV[5]) > 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
else
  redis.call('DEL', KEYS[1])
end
notify(KEYS[2], KEYS[3], ARGV[6])
return 1
"""
)
FAIL_KEYS = ("lock", "waiters", "signal", "err", "neg")

# A version counter that expired, or lost its recent values (Redis restarted from an older
# snapshot, a failover to a lagging replica), would hand out versions again, and one could match
# a rebuild that read it before. Each version is max(counter + 1, server clock in microseconds),
# written back, so versions only grow (the clock gains a million a second; see RedisLock).
# KEYS[1] - envelope   KEYS[2] - version counter   KEYS[3] - error marker   KEYS[4] - negative
# ARGV[1] - how long the version counter is kept, in ms
# returns the new version
INVALIDATE = """
local t = redis.call('TIME')
local v = math.max(redis.call('INCR', KEYS[2]), tonumber(t[1]) * 1000000 + tonumber(t[2]))
redis.call('SET', KEYS[2], string.format('%.0f', v), 'PX', ARGV[1])
redis.call('DEL', KEYS[1], KEYS[3], KEYS[4])
return v
"""
INVALIDATE_KEYS = ("env", "ver", "err", "neg")

# Halve the hot-key scores once per period, whichever process flushes first.
# KEYS[1] - hot-key sorted set   KEYS[2] - time of the last decay
# ARGV[1] - now (s)   ARGV[2] - period (s)   ARGV[3] - score below which a key is dropped
# ARGV[4] - ttl of the decay time in ms (as the sorted set's: both go when the namespace idles)
# returns the number of periods this call decayed (0: another process already did)
DECAY = """
local now = tonumber(ARGV[1])
local last = redis.call('GET', KEYS[2])
if not last then
  redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[4])
  return 0
end
if now - tonumber(last) < tonumber(ARGV[2]) then return 0 end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[4])
local periods = math.floor((now - tonumber(last)) / tonumber(ARGV[2]))
redis.call('ZUNIONSTORE', KEYS[1], 1, KEYS[1], 'WEIGHTS', tostring(0.5 ^ periods))
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[3])
return periods
"""


def keys_for(layout: KeyLayout, names: tuple[str, ...]) -> list[str]:
    return [getattr(layout, name) for name in names]
