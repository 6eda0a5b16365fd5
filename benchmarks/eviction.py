"""What an evicting Redis does to sekali's locks, slots and rate buckets (the numbers behind
docs/locks.md, "Eviction"): how much data written by others a private redis-server with
``maxmemory`` = used + 1 MiB takes under each evicting policy before a held lock, a held
limit-1 slot and a drained burst-5 bucket are gone.

The clients pass their eviction check on a ``noeviction`` server first (as a deployment whose
policy is changed later would), then the policy is switched: the check at first use cannot see
that, ``sekali doctor`` can. Private servers only, on free ports; nothing shared is touched.

    .venv/bin/python -m benchmarks.eviction [--json]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import redis

from resources.flow import ConcurrencyLimiter, RateLimiter
from resources.locks import MemoryLockStats, RedisLock
from resources.storage.redis import redis_client
from sandbox.redis_server import RedisServer, free_port

POLICIES = ("allkeys-lru", "allkeys-lfu", "allkeys-random", "volatile-lru", "volatile-lfu",
            "volatile-random", "volatile-ttl")
HEADROOM = 1024 * 1024
VALUE = 8192
LIMIT = 32 * 1024 * 1024


def measure(policy: str, others_with_ttl: bool, folder: Path) -> dict[str, Any]:
    """KiB written by others before each of sekali's keys was evicted (None: kept), and when the
    server first refused a write (``OOM``: nothing left it may evict)."""
    server = RedisServer(folder, port=free_port()).start()
    admin = server.plain()
    try:
        client = redis_client(server.url)
        lock = RedisLock(client, "order:o1", ttl=600, auto_renew=False,
                         observer=MemoryLockStats())
        lock.acquire()
        limiter = ConcurrencyLimiter(client, "order", limit=1, auto_renew=False, lease=600)
        limiter.acquire("o1", blocking_timeout=0)
        bucket = RateLimiter(client, "gateway", rate=0.001, burst=5)
        for _ in range(5):
            bucket.try_acquire()
        keys = {"lock": lock.key, "slot": limiter.redis_keys("o1")[0], "bucket": bucket.key}
        server.config_set("maxmemory-policy", policy)
        used = int(admin.info("memory")["used_memory"])
        server.config_set("maxmemory", str(used + HEADROOM))
        gone: dict[str, int | None] = dict.fromkeys(keys)
        refused_at = None
        written = 0
        while written < LIMIT and any(v is None for v in gone.values()):
            try:
                admin.set(f"other:{written}", b"x" * VALUE, ex=3600 if others_with_ttl else None)
            except redis.exceptions.OutOfMemoryError:
                refused_at = written
                break
            written += VALUE
            for name, key in keys.items():
                if gone[name] is None and not admin.exists(key):
                    gone[name] = written
        for name, key in keys.items():  # evicted in the same write as the refusal
            if gone[name] is None and not admin.exists(key):
                gone[name] = written
        return {
            "policy": policy,
            "others_with_ttl": others_with_ttl,
            **{f"{name}_gone_after_kib": None if at is None else at // 1024
               for name, at in gone.items()},
            "refused_at_kib": None if refused_at is None else refused_at // 1024,
        }
    finally:
        admin.close()
        server.stop()


def run() -> list[dict[str, Any]]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="sekali-eviction-") as tmp:
        for i, policy in enumerate(POLICIES):
            for with_ttl in (False, True):
                rows.append(measure(policy, with_ttl, Path(tmp) / f"{i}-{int(with_ttl)}"))
    return rows


def main(argv: list[str] | None = None) -> int:
    rows = run()
    if "--json" in (argv if argv is not None else sys.argv[1:]):
        print(json.dumps(rows, indent=2))
        return 0
    print("policy           others' keys  lock      slot      bucket    first OOM  (KiB written)")
    for r in rows:
        print(f"{r['policy']:16s} {'with TTL' if r['others_with_ttl'] else 'no TTL':12s}"
              + "".join(f"  {str(r[f'{n}_gone_after_kib'] or 'kept'):8s}"
                        for n in ("lock", "slot", "bucket"))
              + f"  {r['refused_at_kib'] or '-'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
