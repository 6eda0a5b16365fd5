"""Fair share across tenants at intake: how well the claim follows the weights, what a small
tenant waits behind a large one's backlog, and what fairness costs a claim.

For each app-database backend (embedded SQLite, Postgres):

- ``small tenant wait``: a large tenant (weight 3) enqueues 5,000 requests, then a small one
  (weight 1) enqueues 100; the intake ticks every 5 s (the sensor's interval), claiming pages
  of 200 (its default page), on the stores' injected clock. The small tenant's wait (enqueue to
  claim) p99, with fairness and without (``claim_rank`` order alone, as before fair share).
- ``share error``: four tenants (weights 1, 2, 3, 4) with a deep backlog each, and a tenant
  with a guaranteed minimum of 0.4 under a burst of three others; 3,000 claims in pages of 50.
  The largest gap between a tenant's claimed share and its share by the settings, over every
  window of 200 consecutive claims (the scheduler's bound: ``(2 + s * N) / 200``).
- ``claim cost``: draining 5,000 requests of four tenants in pages of 200, with fairness over
  without, the same rows, three interleaved repetitions, the median ratio.

    .venv/bin/python -m benchmarks.fairness [--quick]
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from sqlalchemy import text

from benchmarks.intake import each_backend
from benchmarks.spread import Spread, headline_of, interleaved
from benchmarks.suite import module_main
from engine.health.metrics import percentile
from engine.requests import RequestStore
from engine.tenants import TenantSetting, TenantStore, effective_shares
from resources.storage.db import Database
from resources.storage.migrations import upgrade

TICK = 5.0
NEVER = 1e9
"""No re-claim of launched requests: the runs they went out in are taken to have started (25
ticks of claims are past the default ``relaunch_after``, which would re-claim the first pages)."""
WINDOW = 200


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _fill(db: Database, backlog: list[tuple[str, int]], at: float) -> None:
    """Empty the intake and the scheduler's state, then write each ``(tenant, n)`` in order."""
    with db.transaction() as conn:
        conn.execute(text("DELETE FROM job_requests"))
        conn.execute(text("DELETE FROM tenants WHERE name <> '~clock'"))
        conn.execute(text("UPDATE tenants SET pass = 0"))
        rows = []
        for tenant, n in backlog:
            rows += [{"k": f"bench:{tenant}:{i}", "t": at + len(rows) * 1e-6, "tenant": tenant}
                     for i in range(n)]
        conn.execute(
            text(
                "INSERT INTO job_requests (job_type, key, payload, payload_hash, status, queue,"
                " created_at, updated_at, attempts, priority, claim_rank, coalesced_count,"
                " tenant) VALUES ('bench', :k, '{}', 'h', 'pending', 'light', :t, :t, 0, 0, :t,"
                " 0, :tenant)"
            ),
            rows,
        )
    db.sql_dialect.refresh_statistics(db, "job_requests")  # as autovacuum would


def _settings(db: Database, weights: dict[str, float], mins: dict[str, float] | None = None,
              ) -> dict[str, TenantSetting]:
    store = TenantStore(db)
    for name, weight in weights.items():
        store.set(name, weight=weight, min_share=(mins or {}).get(name))
    return {n: TenantSetting(n, w, (mins or {}).get(n)) for n, w in weights.items()}


def _small_wait(db: Database, *, fair: bool, big: int, small: int) -> float:
    clock = Clock(1_000_000.0)
    _fill(db, [("big", big), ("small", small)], clock.now)
    _settings(db, {"big": 3, "small": 1})
    store = RequestStore(db, clock=clock, fair=fair)
    waits = []
    while len(waits) < small:
        clock.now += TICK
        claimed = store.claim_for_launch(200, relaunch_after=NEVER)
        waits += [r.claimed_at - r.created_at for r in claimed
                  if r.tenant == "small" and r.claimed_at is not None]
        if not claimed:
            raise RuntimeError("the intake ran dry before the small tenant was served")
    return percentile(waits, 0.99)


def _share_error(
    db: Database, weights: dict[str, float], mins: dict[str, float], claims: int
) -> float:
    clock = Clock(2_000_000.0)
    _fill(db, [(t, claims // 2 + 100) for t in weights], clock.now)  # every share is < 0.45
    shares = effective_shares(weights, _settings(db, weights, mins))
    store = RequestStore(db, clock=clock)
    sequence: list[str] = []
    while len(sequence) < claims:
        clock.now += 1
        sequence += [r.tenant for r in store.claim_for_launch(50, relaunch_after=NEVER)]
    worst = 0.0
    counts = Counter(sequence[:WINDOW])
    for start in range(len(sequence) - WINDOW + 1):
        if start:
            counts[sequence[start - 1]] -= 1
            counts[sequence[start + WINDOW - 1]] += 1
        worst = max(worst, *(abs(counts[t] / WINDOW - s) for t, s in shares.items()))
    return worst


def _drain_seconds(db: Database, *, fair: bool, n: int) -> float:
    clock = Clock(3_000_000.0)
    _fill(db, [(f"t{i}", n // 4) for i in range(4)], clock.now)
    store = RequestStore(db, clock=clock, fair=fair)
    started, total = time.perf_counter(), 0
    while True:
        got = len(store.claim_for_launch(200, relaunch_after=NEVER))
        if not got:
            break
        total += got
    seconds = time.perf_counter() - started
    assert total == n // 4 * 4, total
    return seconds


def _backend(url: str, quick: bool) -> dict[str, Any]:
    db = Database.from_url(url)
    upgrade(db)
    big, claims, n = (2_000, 1_200, 2_000) if quick else (5_000, 3_000, 5_000)
    try:
        fair_wait = _small_wait(db, fair=True, big=big, small=100)
        plain_wait = _small_wait(db, fair=False, big=big, small=100)
        weighted = _share_error(db, {"a": 1, "b": 2, "c": 3, "d": 4}, {}, claims)
        minimum = _share_error(db, {"payments": 1, "bulk1": 1, "bulk2": 1, "bulk3": 1},
                               {"payments": 0.4}, claims)
        cost = interleaved(
            lambda _i: _drain_seconds(db, fair=False, n=n),
            lambda _i: _drain_seconds(db, fair=True, n=n),
        )
    finally:
        db.dispose()
    return {
        "small_tenant_wait_p99_s": round(fair_wait, 3),
        "small_tenant_wait_p99_s_without": round(plain_wait, 3),
        "share_error_max_weights": round(weighted, 4),
        "share_error_max_minimum": round(minimum, 4),
        "claim_cost": cost.as_dict(),
        "claim_cost_ratio": cost.ratio,
    }


def run(quick: bool = False) -> dict[str, Any]:
    backends = each_backend(lambda url: _backend(url, quick))
    ok = {name: res for name, res in backends.items() if "error" not in res}
    summary = []
    for name, res in ok.items():
        summary += [
            {"metric": f"{name} small tenant wait p99, fair over arrival order", "unit": "s",
             "value": res["small_tenant_wait_p99_s"],
             "baseline": res["small_tenant_wait_p99_s_without"],
             "ratio": round(res["small_tenant_wait_p99_s"]
                            / res["small_tenant_wait_p99_s_without"], 3),
             "target": None, "ok": None},
            {"metric": f"{name} claim cost, fair over claim_rank order", "unit": "s",
             "value": res["claim_cost"]["subject_runs"],
             "baseline": res["claim_cost"]["floor_runs"],
             "ratio": round(res["claim_cost_ratio"].median, 3), "target": 1.5,
             "ok": res["claim_cost_ratio"].median <= 1.5},
        ]
    worst_ratio: Spread | None = None
    if ok:
        worst_ratio = max((r["claim_cost_ratio"] for r in ok.values()), key=lambda s: s.median)
    error = max((max(r["share_error_max_weights"], r["share_error_max_minimum"])
                 for r in ok.values()), default=None)
    wait = max((r["small_tenant_wait_p99_s"] for r in ok.values()), default=None)
    heads = headline_of({"fairness_claim_cost_ratio": worst_ratio})
    heads["headline"]["fairness_share_error_max"] = error
    heads["headline"]["fairness_small_tenant_wait_p99_s"] = wait
    for res in backends.values():
        if "claim_cost_ratio" in res:
            res["claim_cost_ratio"] = res["claim_cost_ratio"].as_dict()
    return {"backends": backends, "summary": summary, **heads}


def render(result: dict[str, Any]) -> None:
    for name, res in result["backends"].items():
        if "error" in res:
            print(f"{name:<10} error: {res['error']}")
            continue
        print(f"{name:<10} small tenant wait p99 {res['small_tenant_wait_p99_s']} s "
              f"(without fairness {res['small_tenant_wait_p99_s_without']} s); share error max "
              f"{res['share_error_max_weights']} (weights), {res['share_error_max_minimum']} "
              f"(minimum); claim cost ratio {res['claim_cost_ratio']['median']}")
    print("headline:", result["headline"])


def main() -> None:
    module_main(__doc__, run, render)


if __name__ == "__main__":
    main()
