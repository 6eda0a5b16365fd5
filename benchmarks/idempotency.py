"""What the idempotency store costs over the bare minimum a ledger must do.

Measured in one run on the same database and the same engine (autocommit on Postgres):

- ``begin`` + ``complete`` pairs per second, against the floor of two raw statements that any
  ledger needs: an ``INSERT`` of a row and an ``UPDATE`` of it, in a table of the same shape,
  each through ``Database.statement()`` and SQLAlchemy (the store runs its hot statements on the
  driver directly, so it can beat this floor).
- the replay path (``begin`` on a completed key), against a raw ``SELECT`` of the row by key.

on SQLite (a file) and Postgres (a schema made for the run on the test database, dropped after),
with 1 and 8 worker threads. Rounds of floor and store alternate; the headline is the median of
the per-round ratios, with their spread (``benchmarks.spread``), so the ratio compares like with
like on a shared, noisy machine. Statements per operation are counted
with a ``before_cursor_execute`` listener and connection-pool pings separately (``pool_pre_ping``
costs a round trip per checkout on Postgres, for the store and the floor alike).

``--quick``: rounds of 0.3 s instead of 2.5 s, three of each instead of five. The per-round
ratio of a 0.3 s round is noisier than a 2.5 s round's (a scheduler hiccup is a larger share
of it); the headline stays the median of three interleaved rounds' ratios, with their spread,
so a noisy quick figure shows as a wide spread rather than as a wrong median.

Run: ``python -m benchmarks.idempotency [--quick]``.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from sqlalchemy import event, text

from benchmarks.backends import BackendUnavailable, postgres_schema
from benchmarks.spread import REPETITIONS, Interleaved
from benchmarks.suite import module_main
from resources.idempotency import Claim, IdempotencyStore
from resources.storage.db import Database
from resources.storage.driver import DriverConnection, Sql
from resources.storage.migrations import upgrade

TARGETS = {("postgresql", 1): 0.85, ("postgresql", 8): 0.8, ("sqlite", 1): 0.7}
"""begin+complete pairs per second over the floor's, per (backend, threads)."""

FLOOR_DDL = """
CREATE TABLE IF NOT EXISTS bench_floor (
    key TEXT PRIMARY KEY, payload_hash TEXT, status TEXT NOT NULL, owner_token TEXT,
    lease_expires_at DOUBLE PRECISION, fence BIGINT NOT NULL DEFAULT 1,
    attempt INTEGER NOT NULL DEFAULT 1, recovery_point TEXT, recovery_data TEXT, result TEXT,
    error_class TEXT, error_message TEXT, created_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL, retention_expires_at DOUBLE PRECISION
)"""
FLOOR_INSERT = text(
    "INSERT INTO bench_floor (key, payload_hash, status, owner_token, lease_expires_at, fence,"
    " attempt, created_at, updated_at)"
    " VALUES (:key, :hash, 'in_progress', :owner, :expires, 1, 1, :now, :now)"
)
FLOOR_UPDATE = text(
    "UPDATE bench_floor SET status = 'completed', result = :result, lease_expires_at = NULL,"
    " retention_expires_at = :retain, updated_at = :now"
    " WHERE key = :key AND owner_token = :owner AND status = 'in_progress'"
)
FLOOR_SELECT = text("SELECT * FROM bench_floor WHERE key = :key")
PAYLOAD = {"order": 12345, "amount": "19.99", "currency": "EUR"}
RESULT = {"charge_id": "ch_0123456789", "status": "succeeded"}


class Counter:
    """Statements (through SQLAlchemy or on the driver directly) and pool pings on one engine,
    while ``active``."""

    def __init__(self, db: Database) -> None:
        self.statements: list[str] = []
        self.pings = 0
        self.active = False
        event.listen(db.engine, "before_cursor_execute", self._on_execute)
        for name in ("rows", "row", "run"):
            setattr(DriverConnection, name, self._counting(getattr(DriverConnection, name)))
        dialect = db.engine.dialect
        original = dialect.do_ping

        def counting_ping(dbapi_connection: Any) -> bool:
            if self.active:
                self.pings += 1
            return original(dbapi_connection)

        dialect.do_ping = counting_ping  # type: ignore[method-assign]

    def _on_execute(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if self.active:
            self.statements.append(statement.split()[0].upper())

    def _counting(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def counted(driver: DriverConnection, sql: Sql, params: Any) -> Any:
            if self.active:
                self.statements.append(sql.text.split()[0].upper())
            return method(driver, sql, params)

        return counted

    def measure(self, fn: Callable[[], Any], times: int = 20) -> dict[str, Any]:
        self.statements, self.pings, self.active = [], 0, True
        try:
            for _ in range(times):
                fn()
        finally:
            self.active = False
        kinds: dict[str, int] = {}
        for s in self.statements:
            kinds[s] = kinds.get(s, 0) + 1
        return {
            "statements_per_op": len(self.statements) / times,
            "pings_per_op": self.pings / times,
            "statement_kinds": {k: v / times for k, v in sorted(kinds.items())},
        }


def throughput(op: Callable[[str], None], threads: int, seconds: float, label: str) -> float:
    """Operations per second of ``op(key)`` from ``threads`` threads, each with its own keys."""
    counts = [0] * threads
    start = threading.Barrier(threads + 1)
    stop_at: list[float] = []

    def worker(n: int) -> None:
        start.wait()
        i = 0
        while time.perf_counter() < stop_at[0]:
            op(f"{label}:{n}:{i}")
            i += 1
        counts[n] = i

    pool = [threading.Thread(target=worker, args=(n,)) for n in range(threads)]
    for t in pool:
        t.start()
    began = time.perf_counter()
    stop_at.append(began + seconds)
    start.wait()
    for t in pool:
        t.join()
    return sum(counts) / (time.perf_counter() - began)


def bench_backend(url: str, quick: bool) -> dict[str, Any]:
    db = Database.from_url(url, pool_size=10, max_overflow=0)
    upgrade(db)
    with db.transaction() as conn:
        conn.exec_driver_sql(FLOOR_DDL)
    store = IdempotencyStore(db, lease_seconds=60.0)
    counter = Counter(db)
    seconds = 0.3 if quick else 2.5
    rounds = REPETITIONS if quick else REPETITIONS + 2

    def store_pair(key: str) -> None:
        claim = store.begin(key, payload=PAYLOAD)
        assert isinstance(claim, Claim)
        store.complete(claim, RESULT)

    def floor_pair(key: str) -> None:
        now = time.time()
        owner = uuid.uuid4().hex
        with db.statement() as conn:
            conn.execute(
                FLOOR_INSERT,
                {"key": key, "hash": "h" * 64, "owner": owner, "expires": now + 60, "now": now},
            )
        with db.statement() as conn:
            updated = conn.execute(
                FLOOR_UPDATE,
                {
                    "key": key,
                    "owner": owner,
                    "result": json.dumps(RESULT),
                    "now": now,
                    "retain": now + 86400,
                },
            ).rowcount
        assert updated == 1

    replay_keys = [f"replay:{i}" for i in range(200)]
    for key in replay_keys:
        store_pair(key)
        floor_pair(key)

    def store_replay(key: str) -> None:
        out = store.begin(replay_keys[hash(key) % len(replay_keys)], payload=PAYLOAD)
        assert not isinstance(out, Claim)

    def floor_replay(key: str) -> None:
        with db.statement() as conn:
            row = conn.execute(FLOOR_SELECT, {"key": replay_keys[hash(key) % 200]}).first()
        assert row is not None

    results: dict[str, Any] = {
        "dialect": db.dialect,
        "seconds_per_round": seconds,
        "rounds": rounds,
        "by_threads": {},
    }
    for threads in (1, 8):
        samples: dict[str, list[float]] = {
            k: [] for k in ("floor_pair", "store_pair", "floor_replay", "store_replay")
        }
        for r in range(rounds):
            tag = f"t{threads}r{r}"
            samples["floor_pair"].append(throughput(floor_pair, threads, seconds, f"f{tag}"))
            samples["store_pair"].append(throughput(store_pair, threads, seconds, f"s{tag}"))
            samples["floor_replay"].append(throughput(floor_replay, threads, seconds, "x"))
            samples["store_replay"].append(throughput(store_replay, threads, seconds, "y"))
        med = {k: statistics.median(v) for k, v in samples.items()}
        pair = Interleaved(tuple(samples["floor_pair"]), tuple(samples["store_pair"])).ratio
        replay = Interleaved(tuple(samples["floor_replay"]), tuple(samples["store_replay"])).ratio
        results["by_threads"][threads] = {
            **{f"{k}_per_s": round(v, 1) for k, v in med.items()},
            "pair_ratio": round(pair.median, 3),
            "pair_ratio_spread": pair.as_dict(),
            "replay_ratio": round(replay.median, 3),
            "samples": {k: [round(x, 1) for x in v] for k, v in samples.items()},
        }

    seq = iter(range(10**9))
    results["round_trips"] = {
        "store_begin_new": counter.measure(
            lambda: store.begin(f"rt:new:{next(seq)}", payload=PAYLOAD)
        ),
        "store_begin_replay": counter.measure(lambda: store_replay("rt")),
        "store_begin_complete": counter.measure(lambda: store_pair(f"rt:pair:{next(seq)}")),
        "floor_insert_update": counter.measure(lambda: floor_pair(f"rt:floor:{next(seq)}")),
        "floor_select": counter.measure(lambda: floor_replay("rt")),
    }
    db.dispose()
    return results


def run(quick: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {
        "target_pair_ratio": {f"{b}_{t}t": v for (b, t), v in TARGETS.items()},
        "backends": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        out["backends"]["sqlite"] = bench_backend(f"sqlite:///{tmp}/bench.db", quick)
    try:
        with postgres_schema() as url:
            out["backends"]["postgresql"] = bench_backend(url, quick)
    except BackendUnavailable as exc:
        out["skipped"] = {"postgresql": str(exc)}

    summary = []
    for backend, res in out["backends"].items():
        for threads, row in res["by_threads"].items():
            target = TARGETS.get((backend, threads))
            summary.append(
                {
                    "metric": f"{backend} begin+complete, {threads} thread(s)",
                    "value": row["store_pair_per_s"],
                    "unit": "pairs/s",
                    "baseline": row["floor_pair_per_s"],
                    "ratio": row["pair_ratio"],
                    "target": target,
                    "ok": row["pair_ratio"] >= target if target is not None else None,
                }
            )
            summary.append(
                {
                    "metric": f"{backend} replay (begin on completed), {threads} thread(s)",
                    "value": row["store_replay_per_s"],
                    "unit": "ops/s",
                    "baseline": row["floor_replay_per_s"],
                    "ratio": row["replay_ratio"],
                    "target": None,
                    "ok": None,
                }
            )
    if "postgresql" in out["backends"]:
        pg_replay = out["backends"]["postgresql"]["round_trips"]["store_begin_replay"]
        summary.append(
            {
                "metric": "postgresql replay statements per begin",
                "value": pg_replay["statements_per_op"],
                "unit": "statements",
                "baseline": None,
                "ratio": None,
                "target": 1,
                "ok": pg_replay["statements_per_op"] == 1,
            }
        )
    out["summary"] = summary
    pairs = {
        (b, t): row["pair_ratio_spread"] for b, res in out["backends"].items()
        for t, row in res["by_threads"].items()
    }
    names = {"idempotency_pg_pair_ratio_1t": ("postgresql", 1),
             "idempotency_pg_pair_ratio_8t": ("postgresql", 8),
             "idempotency_sqlite_pair_ratio_1t": ("sqlite", 1),
             "idempotency_sqlite_pair_ratio_8t": ("sqlite", 8)}
    out["headline"] = {
        name: pairs[at]["median"] if at in pairs else None for name, at in names.items()
    }
    out["headline_spread"] = {name: pairs[at] for name, at in names.items() if at in pairs}
    return out


def render(result: dict[str, Any]) -> None:
    print(
        f"{'backend':<11}{'thr':>4}{'store pairs/s':>15}{'floor pairs/s':>15}{'ratio':>7}"
        f"{'store replay/s':>16}{'floor select/s':>16}{'ratio':>7}"
    )
    for backend, res in result["backends"].items():
        for threads, row in res["by_threads"].items():
            print(
                f"{backend:<11}{threads:>4}{row['store_pair_per_s']:>15.0f}"
                f"{row['floor_pair_per_s']:>15.0f}{row['pair_ratio']:>7.2f}"
                f"{row['store_replay_per_s']:>16.0f}{row['floor_replay_per_s']:>16.0f}"
                f"{row['replay_ratio']:>7.2f}"
            )
    print("\nstatements (and pool pings) per operation:")
    for backend, res in result["backends"].items():
        for name, rt in res["round_trips"].items():
            print(
                f"  {backend:<11}{name:<22}{rt['statements_per_op']:>5.1f} statements"
                f"  {rt['pings_per_op']:>4.1f} pings   {rt['statement_kinds']}"
            )
    targets = ", ".join(f"{b} {t} thread(s) >= {v}" for (b, t), v in TARGETS.items())
    print(f"\ntargets (begin+complete over the floor): {targets}; replay in one statement")



def main() -> None:
    module_main(__doc__, run, render)


if __name__ == "__main__":
    main()
