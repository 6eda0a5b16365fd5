"""The numbers behind "observability gives evidence, not assumptions" (docs/design.md, invariant 6).

:class:`MetricsCollector` reads the records the other parts already write and turns them into
one :class:`MetricsSnapshot`:

- ``job_requests``: queue depth (pending + launched), lag (age of the oldest pending request) and
  cancels asked in the window by state;
- ``job_attempts``: processing time p50/p95/p99 per job type, attempts by outcome, retries by
  reason, the duplicate detection rate (suppressed duplicates per executed job), lease takeovers
  (the redelivery rate), lock waits and lock failures;
- ``dlq_records`` (when the DLQ is installed): inflow by error class and open records;
- ``job_requests`` by tenant: depth, wait p50/p99 and share of claims (the top tenants, the rest
  as ``~other``: bounded label cardinality);
- Redis: cache hit / stale / miss / rebuild counts per key pattern, and lock counters.

Guarantees: every number comes from a bounded recent window (``window_seconds``), and
percentiles follow the nearest-rank rule (:func:`percentile`), picked in Python, never
interpolated by the database, so SQLite and Postgres give the same answer for the same rows. The
attempt numbers come from per-minute aggregates written with each attempt
(:meth:`engine.attempts.AttemptRecorder.totals`): a snapshot reads those, the rows of the
window's first partial minute, and the rows of the few histogram bins that hold the requested
percentiles, never every attempt of the window. A source that is missing (a table not migrated
yet, Redis down) leaves its metrics out and is named in ``snapshot.missing``; it never fails the
whole snapshot.

The snapshot is exposed three ways: the ``sekali_metrics`` asset's metadata (plotted by the
Dagster UI), ``sekali metrics serve`` (prometheus-client, through :class:`SnapshotCollector`) and
``sekali metrics show``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import inspect

from engine.attempts import AttemptRecorder, nearest_rank
from engine.durations import DurationModel, LeasedType, lease_table
from engine.requests import RequestStore
from engine.tenants import OTHER
from resources.dlq import DlqViews
from resources.locks import lock_stats
from resources.storage.db import Database

log = logging.getLogger(__name__)

Clock = Callable[[], float]
StatsProvider = Callable[[], Mapping[str, Mapping[str, float]]]
"""Returns ``{group: {counter: value}}``: cache stats per key pattern, or lock stats per name."""

QUANTILES = (0.5, 0.95, 0.99)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: the smallest value with at least ``q`` of the data at or below it.

    Chosen because it always returns an observed value and needs no interpolation convention
    that two readers could disagree on. ``nan`` for no data.
    """
    if not values:
        return math.nan
    return float(sorted(values)[nearest_rank(q, len(values)) - 1])


@dataclass(frozen=True)
class Sample:
    """One metric value with its labels, Prometheus style."""

    name: str
    value: float
    labels: tuple[tuple[str, str], ...] = ()
    help: str = ""

    def key(self) -> str:
        """A flat name for places without labels (asset metadata): ``name[a=x,b=y]``."""
        if not self.labels:
            return self.name
        return self.name + "[" + ",".join(f"{k}={v}" for k, v in self.labels) + "]"


@dataclass
class MetricsSnapshot:
    """Every metric at one instant. ``missing`` names sources that could not be read."""

    taken_at: float
    window_seconds: float
    samples: list[Sample] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    def add(self, name: str, value: float, help: str = "", **labels: str) -> None:
        self.samples.append(Sample(name, float(value), tuple(sorted(labels.items())), help))

    def get(self, name: str, default: float | None = None, **labels: str) -> float | None:
        """The value of ``name`` with exactly these labels, or ``default``."""
        wanted = tuple(sorted(labels.items()))
        for sample in self.samples:
            if sample.name == name and sample.labels == wanted:
                return sample.value
        return default

    def flat(self) -> dict[str, float]:
        """``{flat name: value}``; NaN (no data) is left out so plots have no holes of junk."""
        return {s.key(): s.value for s in self.samples if not math.isnan(s.value)}

    def as_dict(self) -> dict[str, Any]:
        return {
            "taken_at": self.taken_at,
            "window_seconds": self.window_seconds,
            "metrics": self.flat(),
            "missing": list(self.missing),
        }


def _existing_tables(db: Database) -> set[str]:
    with db.engine.connect() as conn:
        return set(inspect(conn).get_table_names())


_SOURCE_TABLES = frozenset(
    {"job_requests", "job_attempts", "job_attempt_rollups", "dlq_records", "tenants"}
)
TOP_TENANTS = 10
"""Tenants with their own label (the most waiting or claimed); the others are one ``~other``."""


class MetricsCollector:
    """Computes a :class:`MetricsSnapshot` from the SQL records and the Redis stats.

    ``cache_stats`` returns ``{key pattern: {hits, stale_hits, misses, loads, ...}}`` (the cache's
    ``stats()``); ``lock_stats`` returns ``{lock name or "all": {acquired, failed, ...}}``. Both
    are optional. Read-only: collecting never changes any record.
    """

    def __init__(
        self,
        db: Database,
        *,
        cache_stats: StatsProvider | None = None,
        lock_stats: StatsProvider | None = None,
        window_seconds: float = 3600.0,
        clock: Clock = time.time,
        leases: tuple[Mapping[str, LeasedType], float] | None = None,
    ) -> None:
        self.db = db
        self.leases = leases
        self.requests = RequestStore(db)
        self.attempts = AttemptRecorder(db)
        self.cache_stats = cache_stats
        self.lock_stats = lock_stats
        self.window_seconds = window_seconds
        self._tables: set[str] = set()
        self.clock = clock

    def collect(self) -> MetricsSnapshot:
        now = self.clock()
        snap = MetricsSnapshot(taken_at=now, window_seconds=self.window_seconds)
        tables = self._tables or _existing_tables(self.db)
        if tables >= _SOURCE_TABLES:
            self._tables = tables  # tables are never dropped: stop asking once all are there
        since = now - self.window_seconds
        for needed, part in (
            (("job_requests",), self._queue),
            (("job_attempts", "job_attempt_rollups"), self._attempts),
            (("job_attempts", "job_attempt_rollups"), self._durations),
            (("dlq_records",), self._dlq),
            (("job_requests", "tenants"), self._tenants),
        ):
            absent = [table for table in needed if table not in tables]
            if absent:
                if absent[0] not in snap.missing:
                    snap.missing.append(absent[0])
            else:
                part(snap, now, since)
        for name, provider, part2 in (
            ("cache_stats", self.cache_stats, self._cache),
            ("lock_stats", self.lock_stats, self._locks),
        ):
            if provider is None:
                continue
            try:
                part2(snap, provider())
            except Exception:  # noqa: BLE001 - one source down must not hide the others
                log.warning("metrics source %s unavailable", name, exc_info=True)
                snap.missing.append(name)
        return snap

    # -- sources ----------------------------------------------------------------------------

    def _queue(self, snap: MetricsSnapshot, now: float, since: float) -> None:
        for state, n in sorted(self.requests.cancel_stats(since).items()):
            snap.add("sekali_request_cancels", n,
                     "cancels asked in the window, by state (requested, cancelled, refused)",
                     state=state)
        rows = self.requests.queue_stats()
        depth: Counter[str] = Counter()
        oldest: dict[str, float] = {}
        for row in rows:
            depth[row["job_type"]] += int(row["n"])
            if row["status"] == "pending":
                oldest[row["job_type"]] = float(row["oldest"])
        help_depth = "requests waiting for a run (pending + launched)"
        help_lag = "age of the oldest pending request"
        for job_type in sorted(depth):
            snap.add("sekali_queue_depth", depth[job_type], help_depth, job_type=job_type)
            lag = max(0.0, now - oldest[job_type]) if job_type in oldest else 0.0
            snap.add("sekali_queue_lag_seconds", lag, help_lag, job_type=job_type)
        snap.add("sekali_queue_depth_total", sum(depth.values()), help_depth)
        snap.add(
            "sekali_queue_lag_max_seconds",
            max((now - t for t in oldest.values()), default=0.0),
            help_lag,
        )

    def _tenants(self, snap: MetricsSnapshot, _now: float, since: float) -> None:
        """Per tenant: requests waiting, the wait of those claimed in the window (p50, p99:
        enqueue to first claim) and their share of the window's claims. Bounded cardinality:
        the :data:`TOP_TENANTS` tenants with the most waiting and claimed have their own label,
        the rest are summed (waits pooled) under ``~other``."""
        waiting = self.requests.waiting_by_tenant()
        waits: dict[str, list[float]] = {}
        for tenant, waited in self.requests.tenant_waits(since):
            waits.setdefault(tenant, []).append(max(0.0, waited))
        ranked = sorted(set(waiting) | set(waits),
                        key=lambda t: (-(waiting.get(t, 0) + len(waits.get(t, ()))), t))
        top = set(ranked[:TOP_TENANTS])
        depth: Counter[str] = Counter()
        pooled: dict[str, list[float]] = {}
        for tenant in ranked:
            label = tenant if tenant in top else OTHER
            depth[label] += waiting.get(tenant, 0)
            pooled.setdefault(label, []).extend(waits.get(tenant, ()))
        claimed = sum(len(v) for v in pooled.values())
        for label in sorted(depth):
            snap.add("sekali_tenant_queue_depth", depth[label],
                     "pending requests per tenant", tenant=label)
            for q in (0.5, 0.99):
                snap.add("sekali_tenant_wait_seconds", percentile(pooled[label], q),
                         "enqueue to first claim, requests claimed in the window",
                         tenant=label, quantile=f"{q:g}")
            snap.add("sekali_tenant_claim_share",
                     len(pooled[label]) / claimed if claimed else 0.0,
                     "share of the window's claims per tenant", tenant=label)

    def _attempts(self, snap: MetricsSnapshot, _now: float, since: float) -> None:
        totals = self.attempts.totals(since)
        outcomes = totals.by("outcome")
        for (job_type, outcome), n in sorted(outcomes.items()):
            snap.add(
                "sekali_attempts", n, "attempts in the window by outcome",
                job_type=job_type, outcome=outcome,
            )
        job_types = sorted({jt for jt, _ in outcomes})
        quantiles = self.attempts.nearest_rank(totals, "duration", QUANTILES, job_types)
        for job_type in job_types:
            for q, value in zip(QUANTILES, quantiles[job_type], strict=True):
                snap.add(
                    "sekali_processing_seconds", value,
                    "duration of completed attempts (nearest rank)",
                    job_type=job_type, quantile=str(q),
                )
            snap.add(
                "sekali_processing_seconds_count",
                sum(totals.histogram("duration", job_type).values()),
                "completed attempts behind the percentiles", job_type=job_type,
            )
            executed = outcomes[(job_type, "completed")]
            suppressed = outcomes[(job_type, "duplicate_suppressed")]
            snap.add(
                "sekali_duplicate_detection_rate", suppressed / executed if executed else 0.0,
                "suppressed duplicates per executed job", job_type=job_type,
            )
        executed = sum(n for (_, o), n in outcomes.items() if o == "completed")
        suppressed = sum(n for (_, o), n in outcomes.items() if o == "duplicate_suppressed")
        snap.add("sekali_jobs_executed", executed, "completed attempts in the window")
        snap.add("sekali_duplicates_suppressed", suppressed, "duplicates answered from the store")
        snap.add(
            "sekali_duplicate_detection_rate_total", suppressed / executed if executed else 0.0,
            "suppressed duplicates per executed job",
        )
        retries: Counter[str] = Counter()
        for (_, reason), n in totals.by("retry").items():
            retries[reason] += n
        for reason, n in sorted(retries.items()):
            snap.add("sekali_retries", n, "retried attempts by error class", reason=reason)
        snap.add("sekali_retries_total", sum(retries.values()), "retried attempts")
        takeovers = sum(totals.by("takeover").values())
        attempts = sum(outcomes.values())
        snap.add("sekali_lease_takeovers", takeovers, "attempts that took over an expired lease")
        snap.add(
            "sekali_lease_takeover_rate", takeovers / attempts if attempts else 0.0,
            "takeovers per attempt (the redelivery rate)",
        )
        waits = sum(totals.histogram("lock_wait").values())
        snap.add("sekali_lock_acquired", waits, "attempts that got their lock")
        snap.add(
            "sekali_lock_failed", sum(totals.by("lock_failed").values()),
            "attempts that gave up waiting for a lock",
        )
        for q, value in zip(
            QUANTILES, self.attempts.nearest_rank(totals, "lock_wait", QUANTILES)[None], strict=True
        ):
            snap.add("sekali_lock_wait_seconds", value, "wait for the lock", quantile=str(q))

    def _durations(self, snap: MetricsSnapshot, _now: float, _since: float) -> None:
        """The duration model's window (:mod:`engine.durations`) per job type: p50/p99/p99.9,
        samples, and with ``leases`` (the job types and the store's lease) the lease in force
        and its heartbeat, labelled ``source`` observed or declared."""
        job_types, default = self.leases or ({}, 60.0)
        model = DurationModel(self.attempts, clock=self.clock)
        for job_type, row in lease_table(model, job_types, default).items():
            for label, key in (("0.5", "p50"), ("0.99", "p99"), ("0.999", "p999")):
                snap.add("sekali_duration_window_seconds", float(row[key]),
                         "completed attempts' duration in the duration model's window (upper "
                         "bin edge)", job_type=job_type, quantile=label)
            snap.add("sekali_duration_window_samples", float(row["samples"]),
                     "completed attempts in the duration model's window", job_type=job_type)
            if "lease_seconds" in row:
                source = "observed" if row["lease_observed"] else "declared"
                snap.add("sekali_lease_in_force_seconds", float(row["lease_seconds"]),
                         "the lease a claim of this job type takes now", job_type=job_type,
                         source=source)
                snap.add("sekali_heartbeat_seconds", float(row["heartbeat_seconds"]),
                         "how often a holder renews its lease", job_type=job_type)

    def _dlq(self, snap: MetricsSnapshot, _now: float, since: float) -> None:
        views = DlqViews(self.db)
        inflow = views.inflow_by_class(since)
        open_rows = views.open_by_class()
        for error_class, n in sorted(inflow.items()):
            snap.add(
                "sekali_dlq_inflow", n, "new DLQ records in the window by class",
                error_class=error_class,
            )
        snap.add("sekali_dlq_inflow_total", sum(inflow.values()), "new DLQ records")
        for error_class, n in sorted(open_rows.items()):
            snap.add(
                "sekali_dlq_open", n, "DLQ records not resolved or discarded",
                error_class=error_class,
            )
        snap.add("sekali_dlq_open_total", sum(open_rows.values()), "open DLQ records")

    def _cache(self, snap: MetricsSnapshot, stats: Mapping[str, Mapping[str, float]]) -> None:
        for pattern in sorted(stats):
            row = stats[pattern]
            hits = float(row.get("hits", 0))
            stale = float(row.get("stale_hits", 0))
            misses = float(row.get("misses", 0))
            loads = float(row.get("loads", 0))
            reads = hits + stale + misses
            for result, n in (("hit", hits), ("stale", stale), ("miss", misses)):
                snap.add(
                    "sekali_cache_reads", n, "cache reads by result", pattern=pattern,
                    result=result,
                )
                snap.add(
                    "sekali_cache_rate", n / reads if reads else 0.0,
                    "share of reads by result", pattern=pattern, result=result,
                )
            snap.add("sekali_cache_rebuilds", loads, "loader calls", pattern=pattern)
            snap.add(
                "sekali_cache_rebuild_rate", loads / reads if reads else 0.0,
                "loader calls per read", pattern=pattern,
            )

    def _locks(self, snap: MetricsSnapshot, stats: Mapping[str, Mapping[str, float]]) -> None:
        for name in sorted(stats):
            for counter, value in sorted(stats[name].items()):
                snap.add(
                    "sekali_lock_stat", float(value), "lock counters shared in Redis",
                    lock=name, stat=counter,
                )


class SnapshotCollector(Collector):
    """A prometheus-client collector that serves :class:`MetricsSnapshot` samples as gauges.

    Every sample keeps its name, help and labels, so rules and dashboards see the snapshot's
    names. Most values are counts, rates or percentiles over the snapshot's window;
    ``sekali_cache_*`` and ``sekali_lock_stat`` are cumulative counters read from Redis (use
    ``rate()`` on them; they restart at zero when Redis loses its data). Three gauges are added:
    ``sekali_metrics_missing_sources`` (sources that could not be read),
    ``sekali_metrics_window_seconds`` (so rules can turn window counts into rates) and, when
    given, ``sekali_lease_seconds`` (so rules can compare durations with the lease).

    At most one snapshot is computed per ``min_interval`` seconds and concurrent scrapes share
    it, so a burst of scrapes costs one set of queries. A failing snapshot raises out of
    :meth:`collect`: the scrape fails and Prometheus's ``up`` shows it, instead of old numbers
    passing for new ones.
    """

    def __init__(
        self,
        snapshot: Callable[[], MetricsSnapshot],
        *,
        min_interval: float = 1.0,
        lease_seconds: float | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        self._snapshot = snapshot
        self.min_interval = min_interval
        self.lease_seconds = lease_seconds
        self.clock = clock
        self._lock = threading.Lock()
        self._cached: tuple[float, MetricsSnapshot] | None = None

    def snapshot(self) -> MetricsSnapshot:
        """The latest snapshot, computed afresh when the cached one is ``min_interval`` old."""
        with self._lock:
            now = self.clock()
            if self._cached is None or now - self._cached[0] >= self.min_interval:
                self._cached = (now, self._snapshot())
            return self._cached[1]

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        families: dict[str, GaugeMetricFamily] = {}
        for sample in snap.samples:
            family = families.get(sample.name)
            if family is None:
                family = families[sample.name] = GaugeMetricFamily(sample.name, sample.help)
            family.add_sample(sample.name, dict(sample.labels), sample.value)
        yield from families.values()
        yield GaugeMetricFamily(
            "sekali_metrics_missing_sources", "metric sources that could not be read",
            value=len(snap.missing),
        )
        yield GaugeMetricFamily(
            "sekali_metrics_window_seconds", "the window the windowed metrics count over",
            value=snap.window_seconds,
        )
        if self.lease_seconds is not None:
            yield GaugeMetricFamily(
                "sekali_lease_seconds", "the idempotency lease a claim holds",
                value=self.lease_seconds,
            )


def redis_lock_stats(client: Any) -> StatsProvider:
    """A provider of the locks' shared counters (``resources.locks.lock_stats``) per pattern."""

    def provider() -> dict[str, dict[str, float]]:
        return lock_stats(client)

    return provider
