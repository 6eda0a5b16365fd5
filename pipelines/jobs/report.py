"""``rebuild_report_cache``: rebuild a report into the anti-stampede cache, key
``report:{report}:{as_of}``.

The idempotency claim keeps a second run of the same intent from rebuilding at all, and the
rebuild goes through :meth:`StampedeCache.refresh`, whose single flight keeps concurrent
rebuilds of one cache key to one loader call across processes. Two versions of one report
(``as_of`` differs: two keys, two cache keys) would still rebuild side by side, each running
the report's queries against the other's load; so the type declares the report exclusive
(``Running.exclusive`` on ``report:{report}``): its rebuilds run one at a time across every
worker, and each records its build in ``report_snapshots`` with the lock's fence, so a rebuild
whose lock expired under it (a pause past the TTL) has its record refused by the database.
``report_snapshots`` (who built it, when) is also how tests count loader calls.
"""

from __future__ import annotations

import json
import os
import socket
import time
import typing
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import text

from engine import (
    Check,
    Debounce,
    Exclusive,
    FlowControl,
    JobContext,
    JobType,
    Keying,
    Presentation,
    Queue,
    Retained,
    Running,
    Upkeep,
    fenced,
    formatted,
    require_str,
)
from resources.errors import ValidationError, shown
from resources.locks import Fence
from resources.storage.db import Database
from resources.storage.retention import Expiry

_QUERIES: dict[str, str] = {
    "orders_by_status": (
        "SELECT payment_status AS k, COUNT(*) AS n FROM orders GROUP BY payment_status"
    ),
    "fulfilment_by_status": (
        "SELECT fulfilment_status AS k, COUNT(*) AS n FROM orders GROUP BY fulfilment_status"
    ),
    "stock_levels": "SELECT sku AS k, on_hand - reserved AS n FROM stock",
}

REPORT_TTL_SECONDS = 3600.0
DEBOUNCE = Debounce(wait=30.0, max_wait=300.0, key="{report}")
"""Rebuild requests of one report coalesce: a burst of ``order.shipped`` events makes one
rebuild 30 s after the last of them, and a steady stream still one every 5 minutes. The newest
request runs (its ``as_of`` names the latest event)."""


ReportName = Literal["fulfilment_by_status", "orders_by_status", "stock_levels"]
assert set(typing.get_args(ReportName)) == set(_QUERIES)


def _report(payload: dict[str, Any], field_name: str) -> str:
    report = require_str(payload, field_name)
    if report not in _QUERIES:
        raise ValidationError(
            field_name, f"must be one of {', '.join(sorted(_QUERIES))}, got {shown(report)}",
            report,
        )
    return report


class ReportRequest(BaseModel):
    """Which report to rebuild, for which version: the key is ``report:{report}:{as_of}``."""

    model_config = ConfigDict(frozen=True, json_schema_extra={"examples": [
        {"report": "stock_levels", "as_of": "2026-11-29T10"},
    ]})

    report: Annotated[ReportName, Check(_report), Field(description="Which report to rebuild.")]
    as_of: Annotated[str, Check(require_str, max_len=64), Field(
        description="The version it is for (e.g. 2026-11-29T10), part of the key.")]


key_for = formatted("report:{report}:{as_of}")


def report_loader(
    db: Database, report: str, as_of: str, fence: Fence | None = None
) -> Callable[[], dict[str, Any]]:
    """The loader the cache calls: query, then record the build in ``report_snapshots``, in a
    transaction fenced with ``fence`` when one is given (a rebuild holding the report's lock;
    warming refreshes without one)."""

    def load() -> dict[str, Any]:
        with fenced(db, fence) if fence is not None else db.transaction() as conn:
            rows = {str(r.k): int(r.n) for r in conn.execute(text(_QUERIES[report]))}
            data = {"report": report, "as_of": as_of, "rows": rows, "built_at": time.time()}
            conn.execute(
                text(
                    "INSERT INTO report_snapshots (report, as_of, built_at, builder, data)"
                    " VALUES (:r, :a, :t, :b, :d)"
                ),
                {"r": report, "a": as_of, "t": data["built_at"],
                 "b": f"{socket.gethostname()}:{os.getpid()}", "d": json.dumps(rows)},
            )
        return data

    return load


def expired_snapshots(older_than: float, now: float | None = None) -> Expiry:
    """Report snapshots built more than ``older_than`` seconds before ``now``: a record of who
    built what when, referenced by nothing. Purge with ``.purge(db)``."""
    return Expiry.of(
        "report_snapshots",
        "report, as_of, built_at, builder",
        "built_at <= :cutoff",
        {"cutoff": (time.time() if now is None else now) - older_than},
    )


def loader_for(db: Database, key: str) -> Callable[[], dict[str, Any]] | None:
    """The loader of a cache key of this job type (``report:{report}:{as_of}``), or None: how
    cache warming refreshes a hot report before it expires."""
    parts = key.split(":", 2)
    if len(parts) != 3 or parts[0] != "report":
        return None
    try:
        p = JOB_TYPE.validate({"report": parts[1], "as_of": parts[2]})
    except ValidationError:  # an unknown report: no loader
        return None
    return report_loader(db, p["report"], p["as_of"])


def cache_key(p: ReportRequest) -> str:
    return f"report:{p.report}:{p.as_of}"


def rebuild_report_cache(ctx: JobContext, p: ReportRequest) -> dict[str, Any]:
    cache = ctx.services.cache
    if cache is None:
        raise RuntimeError("rebuild_report_cache needs the cache (resource 'cache')")
    ctx.attempt.status_before = "stale"
    ctx.check_lease()
    loader = report_loader(ctx.services.db, p.report, p.as_of, ctx.write_fence)
    with ctx.timed("rebuild"):
        value = cache.refresh(cache_key(p), loader, ttl=REPORT_TTL_SECONDS)
    ctx.attempt.status_after = "cached"
    return {"cache_key": cache_key(p), "rows": len(value["rows"]), "built_at": value["built_at"]}


JOB_TYPE = JobType(
    name="rebuild_report_cache",
    queue=Queue.LIGHT,
    payload=ReportRequest,
    handler=rebuild_report_cache,
    side_effect=False,
    keying=Keying(key_for=key_for, resource_id=formatted("{report}")),
    running=Running(max_runtime_seconds=600, needs=frozenset({"cache"}),
                    exclusive=Exclusive(formatted("report:{report}"), wait=60.0)),
    flow=FlowControl(debounce=DEBOUNCE),
    upkeep=Upkeep(
        retained=(Retained("report_snapshots", "report_snapshots", expired_snapshots),),
        cache_loader=loader_for,
    ),
    presentation=Presentation(
        description="Rebuild a report into the cache through the single flight.",
        result_fields=("cache_key", "rows"),
    ),
)
validate = JOB_TYPE.validate
