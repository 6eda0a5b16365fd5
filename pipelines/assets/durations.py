"""The picture of what sekali tunes: ``sekali_durations``, an asset whose materialisation shows,
per job type, the duration histogram of the model's window with the lease in force and the
p99 / p99.9 lines (:mod:`engine.durations`), and per queue the arrivals against the capacity of
the worker runs that were alive, minute by minute (:mod:`engine.capacity`).

Both pictures are PNGs drawn with matplotlib (Agg, no screen) and carried in the metadata as
markdown images, so the asset page shows them; the numbers behind them are there too (the same
as ``sekali doctor --json`` check 17). ``sekali_durations_job`` materialises it on demand;
``health_sensor`` does not (a picture per five minutes would fill the event log).
"""

import base64
import io
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after the backend is chosen

from engine import tags as tag
from engine.attempts import HISTOGRAM_EDGES, AttemptRecorder, bin_bounds
from engine.capacity import CapacityPolicy
from engine.delivery import DeliveryPolicy
from engine.durations import DurationModel, lease_table
from engine.registry import JOB_TYPES
from engine.requests import RequestStore
from resources.storage.db import shared_database
from resources.storage.settings import Settings
from sensors.workers import WORKER_JOB

DURATIONS_ASSET = "sekali_durations"
MINUTES = 30
"""How far back the arrivals-against-capacity picture looks."""


def png_markdown(fig: Any, title: str) -> dg.MetadataValue:
    """``fig`` as a PNG inside a markdown image (the asset page renders it); the figure is
    closed."""
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    data = base64.b64encode(buffer.getvalue()).decode()
    return dg.MetadataValue.md(f"![{title}](data:image/png;base64,{data})")


def plot_durations(bins: Mapping[str, Mapping[int, int]],
                   leases: Mapping[str, Mapping[str, Any]]) -> Any:
    """One panel per job type with samples: its histogram (log-scaled seconds), and vertical
    lines at p99, p99.9 and the lease in force."""
    names = [n for n in sorted(bins) if sum(bins[n].values())] or ["(no completed attempts)"]
    fig, axes = plt.subplots(len(names), 1, figsize=(8, 2.4 * len(names)), squeeze=False)
    for ax, name in zip(axes[:, 0], names, strict=True):
        counts = bins.get(name, {})
        for b, n in sorted(counts.items()):
            lo, hi = bin_bounds(b)
            lo = HISTOGRAM_EDGES[0] / 1.2 if math.isinf(lo) else lo
            hi = lo * 1.2 if math.isinf(hi) else hi
            ax.bar(lo, n, width=hi - lo, align="edge", color="#4c72b0")
        row = leases.get(name, {})
        for key, label, colour in (("p99", "p99", "#dd8452"), ("p999", "p99.9", "#c44e52"),
                                   ("lease_seconds", "lease", "#2ca02c")):
            value = float(row.get(key, math.nan))
            if not math.isnan(value):
                ax.axvline(value, color=colour, linestyle="--", label=f"{label} {value:.3g}s")
        ax.set_xscale("log")
        ax.set_title(f"{name}: {row.get('samples', 0)} completed in the window; "
                     f"lease {row.get('lease_why', 'n/a')}", fontsize=8)
        ax.set_xlabel("duration (s)")
        ax.set_ylabel("attempts")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    return fig


def workers_per_minute(instance: dg.DagsterInstance, minutes: Sequence[float]
                       ) -> dict[str, list[int]]:
    """Per queue, how many worker runs were alive at each minute (from Dagster's run records:
    a run counts from its start to its end, or now)."""
    since, now = minutes[0], time.time()
    out: dict[str, list[int]] = {}
    for record in instance.get_run_records(dg.RunsFilter(job_name=WORKER_JOB), limit=2000):
        start = record.start_time
        if start is None:
            continue
        end = record.end_time or now
        if end < since:
            continue
        queue = record.dagster_run.tags.get(tag.QUEUE, "?")
        alive = out.setdefault(queue, [0] * len(minutes))
        for i, minute in enumerate(minutes):
            if start <= minute + 60 and end >= minute:
                alive[i] += 1
    return out


def plot_arrivals(minutes: Sequence[float], arrivals: Mapping[str, list[float]],
                  capacity: Mapping[str, list[float]]) -> Any:
    """Per queue, arrivals per second against the alive workers' capacity, minute by minute."""
    queues = sorted(set(arrivals) | set(capacity)) or ["(no queue)"]
    fig, axes = plt.subplots(len(queues), 1, figsize=(8, 2.4 * len(queues)), squeeze=False)
    x = [(m - minutes[-1]) / 60 for m in minutes]
    for ax, queue in zip(axes[:, 0], queues, strict=True):
        ax.step(x, arrivals.get(queue, [0.0] * len(x)), where="post", label="arrivals/s")
        ax.step(x, capacity.get(queue, [0.0] * len(x)), where="post", label="capacity/s")
        ax.set_title(f"{queue}: arrivals against the capacity of its worker runs", fontsize=8)
        ax.set_xlabel("minutes ago")
        ax.legend(fontsize=7)
    return fig


def durations_metadata(db: Any, instance: dg.DagsterInstance, lease_seconds: float,
                       now: float | None = None) -> dict[str, Any]:
    """Everything the asset shows (usable without a run: tests, the CLI)."""
    now = time.time() if now is None else now
    attempts = AttemptRecorder(db)
    model = DurationModel(attempts, clock=lambda: now)
    bins = attempts.duration_bins(now - model.policy.window_seconds)
    leases = lease_table(model, JOB_TYPES, lease_seconds)
    delivery, policy, requests = DeliveryPolicy.from_env(), CapacityPolicy.from_env(), \
        RequestStore(db)
    start = math.floor(now / 60) * 60 - (MINUTES - 1) * 60
    minutes = [start + 60 * i for i in range(MINUTES)]
    per_minute = [requests.arrivals(m, m + 60) for m in minutes]
    alive = workers_per_minute(instance, minutes)
    stats = model.stats()
    arrivals: dict[str, list[float]] = {}
    capacity: dict[str, list[float]] = {}
    for queue in delivery.queues():
        types = delivery.resident(queue)
        arrivals[queue] = [sum(m.get(t, 0) for t in types) / 60 for m in per_minute]
        means = [stats[t].mean for t in types if t in stats and not math.isnan(stats[t].mean)]
        duration = max(means) if means else policy.unknown_duration
        capacity[queue] = [n / duration for n in alive.get(queue, [0] * MINUTES)]
    return {
        "durations": png_markdown(plot_durations(bins, leases), "durations per job type"),
        "arrivals_vs_capacity": png_markdown(plot_arrivals(minutes, arrivals, capacity),
                                             "arrivals against capacity"),
        "leases": dg.MetadataValue.json(_finite(leases)),
        "window_seconds": dg.MetadataValue.float(model.policy.window_seconds),
    }


def _finite(leases: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    return {jt: {k: (None if isinstance(v, float) and math.isnan(v) else v)
                 for k, v in row.items()} for jt, row in leases.items()}


@dg.asset(
    name=DURATIONS_ASSET,
    group_name="observability",
    required_resource_keys={"app_db", "idempotency"},
    description="Per job type the duration histogram with the lease in force and its p99 / "
    "p99.9, and per queue the arrivals against the capacity of its worker runs (pictures).",
)
def sekali_durations(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
    app_db = context.resources.app_db
    db = (app_db.get_database() if app_db is not None
          else shared_database(Settings.from_env().database_url))
    lease = float(context.resources.idempotency.lease_seconds)
    return dg.MaterializeResult(metadata=durations_metadata(db, context.instance, lease))


durations_job = dg.define_asset_job("sekali_durations_job", selection=[DURATIONS_ASSET])
assets = [sekali_durations]
jobs = [durations_job]
