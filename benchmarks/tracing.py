"""What tracing costs when it is off: the ledger pair (begin + complete) through the spans the
runtime opens around it (``sekali.execute``, ``ledger.claim``, ``ledger.complete``, attribute
updates), against the same pair with no span code at all, in the same run, on SQLite; the
ratio is the median over rounds that alternate which goes first.

Off means no ``OTEL_*`` variable: every ``span()`` is one shared no-op context manager, so the
cost is a few function calls per request. Target: the traced-off pair at >= 0.97 of the bare one.
Run: ``python -m benchmarks.tracing [--quick] [--json]`` or ``sekali bench --only tracing``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

from benchmarks.suite import module_main
from resources.idempotency import Claim, IdempotencyStore
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from resources.telemetry.tracing import set_attributes, span, tracing_enabled

TARGET = 0.97


def _bare(store: IdempotencyStore, key: str) -> None:
    claim = store.begin(key, payload={"k": key})
    assert isinstance(claim, Claim)
    store.complete(claim, {"ok": True})


def _traced_off(store: IdempotencyStore, key: str) -> None:
    with span("sekali.execute", job_type="bench", idempotency_key=key, attempt=0):
        set_attributes(idempotency_key=key, resource_id=key)
        with span("ledger.claim", idempotency_key=key):
            claim = store.begin(key, payload={"k": key})
        assert isinstance(claim, Claim)
        set_attributes(fence=claim.fence, takeover=claim.takeover)
        with span("ledger.complete", idempotency_key=key, fence=claim.fence):
            store.complete(claim, {"ok": True})
        set_attributes(outcome="completed")


def _spans_alone(n: int) -> float:
    """Seconds per request of the span code itself (the same calls as ``_traced_off``, no I/O)."""
    started = time.perf_counter()
    for i in range(n):
        key = f"k{i}"
        with span("sekali.execute", job_type="bench", idempotency_key=key, attempt=0):
            set_attributes(idempotency_key=key, resource_id=key)
            with span("ledger.claim", idempotency_key=key):
                pass
            set_attributes(fence=1, takeover=False)
            with span("ledger.complete", idempotency_key=key, fence=1):
                pass
            set_attributes(outcome="completed")
    return (time.perf_counter() - started) / n


def _rate(store: IdempotencyStore, fn: Callable[[IdempotencyStore, str], None], n: int) -> float:
    prefix = uuid.uuid4().hex[:8]
    started = time.perf_counter()
    for i in range(n):
        fn(store, f"bench:{prefix}:{i}")
    return n / (time.perf_counter() - started)


def run(quick: bool = False) -> dict[str, Any]:
    assert not tracing_enabled(), "run this benchmark with no OTEL_* variable set"
    n, rounds = (300, 6) if quick else (1000, 12)
    bare, traced, ratios = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        db = Database.from_url(f"sqlite:///{tmp}/bench.db")
        upgrade(db)
        store = IdempotencyStore(db)
        _rate(store, _bare, n // 10)  # warm up
        for i in range(rounds):  # interleaved, order alternating, so drift hits both alike
            first, second = (_bare, _traced_off) if i % 2 == 0 else (_traced_off, _bare)
            rates = {fn: _rate(store, fn, n) for fn in (first, second)}
            bare.append(rates[_bare])
            traced.append(rates[_traced_off])
            ratios.append(rates[_traced_off] / rates[_bare])
        db.dispose()
    ratio = statistics.median(ratios)
    per_request = statistics.median(_spans_alone(20_000) for _ in range(5))
    share = per_request * statistics.median(bare)
    return {
        "span_code_us_per_request": round(per_request * 1e6, 2),
        "span_code_share_of_pair": round(share, 5),
        "pairs_per_s_bare": round(statistics.median(bare), 1),
        "pairs_per_s_traced_off": round(statistics.median(traced), 1),
        "ratio": round(ratio, 3),
        "summary": [
            {
                "metric": "ledger pair with tracing off (spans present, no OTEL_* set)",
                "value": round(statistics.median(traced), 1),
                "unit": "pairs/s",
                "baseline": round(statistics.median(bare), 1),
                "ratio": round(ratio, 3),
                "target": TARGET,
                "ok": ratio >= TARGET,
            },
            {
                "metric": "span code alone per request, tracing off, as a share of a pair",
                "value": round(per_request * 1e6, 2),
                "unit": "us",
                "baseline": None,
                "ratio": round(1 - share, 4),
                "target": TARGET,
                "ok": 1 - share >= TARGET,
            },
        ],
    }


def render(result: dict[str, Any]) -> None:
    print(
        f"bare {result['pairs_per_s_bare']:.0f} pairs/s, traced-off "
        f"{result['pairs_per_s_traced_off']:.0f} pairs/s: ratio {result['ratio']:.3f} "
        f"(target >= {TARGET}); the span code alone costs "
        f"{result['span_code_us_per_request']:.2f} us per request, "
        f"{100 * result['span_code_share_of_pair']:.2f}% of a pair"
    )


def main() -> None:
    module_main(__doc__, run, render)


if __name__ == "__main__":
    main()
