"""The production diagnosis checklist, as plain checks over the evidence sekali records.

Each check reads real records (``job_attempts``, ``idempotency_records``, ``job_requests``,
``dlq_records``, the live schema, the cache envelopes in Redis, the downstream's own ledger) and
returns a :class:`Finding`: did it pass, what exactly was found, and what to change. The same
findings feed the Dagster asset checks (``pipelines/assets/observability.py``) and
``sekali doctor``.

A finding's ``severity`` is ``ERROR`` when a failure means an invariant is (or can be) broken
(a real duplicate effect, a lease shorter than the work, a side effect without a key, an ack
before the result is stored, a missing unique constraint) and ``WARN`` when it means trouble is
coming (retry storms, expiry clusters, a growing DLQ, broken correlation). Checks with too little
data pass and say so: no evidence is not a failure.

A check never changes anything, and one that cannot run (a source is down) fails with what it
could not read, so a broken probe is never mistaken for a healthy system.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy import inspect, text

from engine.attempts import AttemptRecorder
from engine.capacity import CapacityPolicy, measure
from engine.delivery import DeliveryPolicy
from engine.durations import AdaptivePolicy, DurationModel, lease_table
from engine.health.metrics import percentile
from engine.requests import RequestStore
from engine.upkeep.reconciliation import retention_expiries
from engine.upkeep.retention import backlog
from engine.worker import WorkerTargets
from resources.dlq import MIN_RETENTION_SECONDS, UNRESOLVED, DlqStore, DlqViews
from resources.errors import ValidationError
from resources.idempotency import IdempotencyStore, LedgerViews, Status
from resources.outbox.publisher import held_by_dead_letters
from resources.storage.db import Database
from resources.storage.queries import load_queries
from resources.storage.redis import RedisClient, memory_policies
from resources.storage.replication import ACCEPT_ENV, accepted, read_replication
from resources.storage.settings import RetentionSettings

log = logging.getLogger(__name__)
_Q = load_queries(Path(__file__).with_suffix(".sql"))

Clock = Callable[[], float]
ERROR = "ERROR"
WARN = "WARN"


@dataclass(frozen=True)
class Finding:
    """The result of one check. ``found`` says what the evidence showed; ``fix`` what to do."""

    check: str
    title: str
    severity: str
    passed: bool
    found: str
    fix: str
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def verdict(self) -> str:
        return "PASS" if self.passed else f"FAIL ({self.severity})"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "verdict": self.verdict}


class CacheLike(Protocol):
    namespace: str

    def hot_keys(self, n: int = 10) -> list[tuple[str, float]]: ...

    def envelope(self, key: str) -> Any: ...


@dataclass(frozen=True)
class EffectLedger:
    """Where a downstream records its effects, so a real duplicate can be told from a log line.

    ``intent_column`` names the business intent an effect belongs to (a reference the job type
    derives from its key, a Message-ID); two rows with one intent are two effects.
    """

    name: str
    db: Database
    table: str
    intent_column: str
    correlation_column: str | None = None
    time_column: str | None = None

    def rows(self, since: float | None = None) -> list[tuple[str, str | None]]:
        names = {"intent": self.intent_column, "correlation": self.correlation_column or "NULL",
                 "table": self.table, "time_column": self.time_column}
        name = "intent_rows_since" if since is not None and self.time_column else "intent_rows"
        with self.db.statement() as conn:
            result = conn.execute(text(_Q[name].format(**names)), {"since": since})
            return [(str(r[0]), r[1]) for r in result]


@dataclass
class DiagnosisSetup:
    """Everything the checks look at. Build it from settings (``sekali doctor``), a Dagster
    resource, or directly in a test."""

    db: Database
    job_types: Mapping[str, Any]
    lease_seconds: float
    lock_ttl_seconds: float | None = None
    lock_auto_renew: bool = True
    caches: Sequence[CacheLike] = ()
    effect_ledgers: Sequence[EffectLedger] = ()
    redis: RedisClient | None = None
    window_seconds: float = 24 * 3600.0
    clock: Clock = time.time
    lease_margin: float = 0.8
    min_samples: int = 10
    hot_keys: int = 20
    expiry_cluster_seconds: float = 1.0
    dlq_open_limit: int = 100
    retention: RetentionSettings = field(default_factory=RetentionSettings)
    retention_slack_seconds: float = 86400.0
    reconciliation_watch_seconds: float = 2 * 86400.0 + 600.0
    tenant_starved_seconds: float = 600.0
    adaptive: AdaptivePolicy = field(default_factory=AdaptivePolicy.from_env)
    capacity: CapacityPolicy = field(default_factory=CapacityPolicy.from_env)
    critical_section_keys: tuple[str, ...] = (
        "lock_held", "critical_section", "transaction", "lock_order",
    )

    _memo: dict[str, Any] = field(default_factory=dict, repr=False)

    def since(self) -> float:
        return self.clock() - self.window_seconds

    def forget(self) -> None:
        """Drop what was read; :func:`diagnose` calls it so each run reads fresh evidence once."""
        self._memo.clear()

    def tables(self) -> set[str]:
        if "tables" not in self._memo:
            with self.db.engine.connect() as conn:
                self._memo["tables"] = set(inspect(conn).get_table_names())
        return set(self._memo["tables"])

    def attempts(self) -> list[dict[str, Any]]:
        """The attempts of the window, read once per diagnosis run (rows are shared: read-only)."""
        if "attempts" not in self._memo:
            self._memo["attempts"] = self._read_attempts()
        return list(self._memo["attempts"])

    def _read_attempts(self) -> list[dict[str, Any]]:
        return AttemptRecorder(self.db).since(self.since())

    def leases(self) -> dict[str, dict[str, Any]]:
        """Per job type: the observed durations and the lease in force, and why
        (:func:`engine.durations.lease_table`), read once per diagnosis run."""
        if "leases" not in self._memo:
            model = DurationModel(AttemptRecorder(self.db), self.adaptive, clock=self.clock)
            self._memo["leases"] = lease_table(model, self.job_types, self.lease_seconds)
        return dict(self._memo["leases"])


@dataclass(frozen=True)
class Check:
    name: str
    title: str
    run: Callable[[DiagnosisSetup], Finding]


def _finding(
    check: str, severity: str, passed: bool, found: str, fix: str, **evidence: Any
) -> Finding:
    return Finding(check, TITLES[check], severity, passed, found, fix, evidence)


def _fmt(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds:.3f}s"


def _sample(items: Iterable[Any], n: int = 5) -> list[Any]:
    return sorted(items)[:n]


# -- 1 ------------------------------------------------------------------------------------------


def check_real_duplicates(s: DiagnosisSetup) -> Finding:
    """Two completed attempts, or two downstream effects, for one intent is a real duplicate;
    many attempt rows with one ``completed`` among them is only a duplicate log line."""
    attempts = s.attempts()
    completed = Counter(a["idempotency_key"] for a in attempts if a["outcome"] == "completed"
                        and a["idempotency_key"])
    twice = {k: n for k, n in completed.items() if n > 1}
    rows_per_key = Counter(a["idempotency_key"] for a in attempts if a["idempotency_key"])
    logged_more = sum(1 for n in rows_per_key.values() if n > 1)
    suppressed = sum(1 for a in attempts if a["outcome"] == "duplicate_suppressed")
    effects: dict[str, dict[str, int]] = {}
    for ledger in s.effect_ledgers:
        per_intent = Counter(intent for intent, _ in ledger.rows(s.since()))
        dup = {k: n for k, n in per_intent.items() if n > 1}
        if dup:
            effects[ledger.name] = dup
    evidence = {
        "keys_completed_twice": len(twice),
        "duplicate_effects": {k: len(v) for k, v in effects.items()},
        "keys_logged_more_than_once": logged_more,
        "duplicates_suppressed": suppressed,
    }
    if twice or effects:
        parts = []
        if twice:
            parts.append(f"{len(twice)} keys completed more than once (e.g. {_sample(twice)})")
        for name, dup in effects.items():
            parts.append(f"{len(dup)} intents with more than one effect in {name} "
                         f"(e.g. {_sample(dup)})")
        return _finding(
            "real_duplicates", ERROR, False,
            "REAL duplicate effects: " + "; ".join(parts) + ".",
            "A side effect ran twice for one intent. Check that the job claims its idempotency "
            "key before the effect and that the downstream call carries the key (or looks the "
            "intent up by reference when the downstream ignores keys); compensate the extra "
            "effects (refund, cancel) through the reconciliation job.",
            **evidence,
        )
    ledgers = ", ".join(ledger.name for ledger in s.effect_ledgers)
    effect_text = (f"{ledgers} shows at most one effect per intent" if ledgers
                   else "no downstream ledger was given to count effects")
    return _finding(
        "real_duplicates", ERROR, True,
        f"{logged_more} keys appear in more than one attempt row and {suppressed} duplicates "
        f"were suppressed; no key completed twice and {effect_text}: repeated lines are "
        "duplicate logs, not duplicate effects.",
        "Nothing to change. Count effects per intent, never log lines, when a duplicate is "
        "reported.",
        **evidence,
    )


# -- 2 ------------------------------------------------------------------------------------------


def check_lease_vs_duration(s: DiagnosisSetup) -> Finding:
    """The lease must outlast the work between heartbeats: p99 above ``lease_margin * lease``
    means some jobs finish near or past it and are taken over while still running."""
    per_type: defaultdict[str, list[float]] = defaultdict(list)
    for a in s.attempts():
        if a["outcome"] == "completed" and a["duration_seconds"] is not None:
            per_type[a["job_type"]].append(float(a["duration_seconds"]))
    leases = s.leases()
    stats = {}
    bad = {}
    for job_type, values in sorted(per_type.items()):
        lease = float(leases.get(job_type, {}).get("lease_seconds", s.lease_seconds))
        p99 = percentile(values, 0.99)
        past = sum(1 for v in values if v >= lease)
        stats[job_type] = {"p99": p99, "n": len(values), "past_lease": past, "lease": lease}
        if p99 > s.lease_margin * lease:
            bad[job_type] = stats[job_type]
    if bad:
        worst = max(v["p99"] for v in bad.values())
        desc = ", ".join(
            f"{jt} p99={_fmt(v['p99'])} against its lease {v['lease']:g}s ({v['past_lease']}/"
            f"{v['n']} ran past the lease)"
            for jt, v in bad.items()
        )
        return _finding(
            "lease_vs_duration", ERROR, False,
            f"{desc}: above {s.lease_margin:g} x lease, so "
            "another worker can take the key over while the first still works.",
            f"Raise IdempotencyResource.lease_seconds to at least {math.ceil(worst * 2):d}s "
            "(2 x the worst p99) or the type's LeaseBounds (its ceiling clamps the adaptive "
            "lease), or heartbeat in long steps (IdempotencyStore.keep_alive) so "
            "the lease is renewed; also check dagster/max_runtime covers the job.",
            lease_seconds=s.lease_seconds, job_types=stats,
        )
    found = (
        f"declared lease {s.lease_seconds:g}s; p99 / lease in force per job type: "
        + (", ".join(f"{jt}={_fmt(v['p99'])} / {v['lease']:g}s" for jt, v in stats.items())
           or "no data")
        + f" (all under {s.lease_margin:g} x lease)."
    )
    return _finding(
        "lease_vs_duration", ERROR, True, found,
        "Nothing to change; recheck after adding a slower job type.",
        lease_seconds=s.lease_seconds, job_types=stats,
    )


# -- 3 ------------------------------------------------------------------------------------------


def _validation_errors() -> frozenset[str]:
    names, todo = set(), [ValidationError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return frozenset(names)


def _refused_input(attempt: Mapping[str, Any], refusals: frozenset[str]) -> bool:
    """An attempt the validation boundary refused (bad payload or key; ``refusals``: the
    names of :func:`_validation_errors`): it ends before any claim, so it has no key and no
    effect by design."""
    return attempt["error_class"] in refusals


_LEDGER_COLUMNS = {"key", "status", "owner_token", "lease_expires_at", "fence", "attempt"}


def check_idempotency_coverage(s: DiagnosisSetup) -> Finding:
    """Every job type with a side effect derives a key, every such attempt carried one, and the
    store is reachable and migrated."""
    problems: list[str] = []
    no_key = sorted(
        name for name, jt in s.job_types.items()
        if getattr(jt, "side_effect", True)
        and not callable(getattr(getattr(jt, "keying", None), "key_for", None))
    )
    if no_key:
        problems.append(f"job types with a side effect but no key_for: {no_key}")
    tables = s.tables()
    if "idempotency_records" not in tables:
        problems.append("the idempotency store has no idempotency_records table (not migrated)")
    else:
        with s.db.engine.connect() as conn:
            cols = {c["name"] for c in inspect(conn).get_columns("idempotency_records")}
        if not cols >= _LEDGER_COLUMNS:
            problems.append(
                f"idempotency_records lacks columns {sorted(_LEDGER_COLUMNS - cols)}"
            )
    keyless: Counter[str] = Counter()
    refused: Counter[str] = Counter()
    if "job_attempts" in tables:
        side = {n for n, jt in s.job_types.items() if getattr(jt, "side_effect", True)}
        refusals = _validation_errors()
        for a in s.attempts():
            if a["job_type"] in side and not a["idempotency_key"]:
                # a payload the boundary refused never got a key, a claim or an effect
                (refused if _refused_input(a, refusals) else keyless)[a["job_type"]] += 1
        if keyless:
            problems.append(f"attempts of side-effecting job types without a key: "
                            f"{dict(keyless)}")
    evidence = {"job_types_without_key": no_key, "keyless_attempts": dict(keyless),
                "refused_inputs": dict(refused)}
    if problems:
        return _finding(
            "idempotency_coverage", ERROR, False, "; ".join(problems) + ".",
            "Give every side-effecting job type a key_for naming the business intent "
            "(e.g. points:{account_id}) and claim it in the store before the effect; run "
            "`sekali db upgrade` so the store's table exists.",
            **evidence,
        )
    side_count = sum(1 for jt in s.job_types.values() if getattr(jt, "side_effect", True))
    blind = sorted(n for n, jt in s.job_types.items() if getattr(jt, "missing_lookup", False))
    return _finding(
        "idempotency_coverage", ERROR, True,
        f"all {side_count} side-effecting job types derive a key; the store is migrated and "
        "every recorded attempt of them carried its key"
        + (f" ({sum(refused.values())} refused at the validation boundary before any key or"
           " effect, as designed)." if refused else ".")
        + (f" Without a lookup (an unknown outcome cannot be asked at the downstream): "
           f"{blind}." if blind else ""),
        f"Declare lookup= on {', '.join(blind)} (docs/job-types.md, \"The lookup hook\")."
        if blind else "Nothing to change.",
        job_types_without_lookup=blind, **evidence,
    )


# -- 4 ------------------------------------------------------------------------------------------


def _critical_section(a: dict[str, Any], keys: tuple[str, ...]) -> float | None:
    durations = a["durations"] or {}
    held = [float(durations[k]) for k in keys if k in durations]
    if held:
        return max(held)
    if a["lock_wait_seconds"] is not None and a["duration_seconds"] is not None:
        return max(0.0, float(a["duration_seconds"]) - float(a["lock_wait_seconds"]))
    return None


def exclusive_types(job_types: Mapping[str, Any]) -> list[str]:
    """The job types that declare ``Running.exclusive``: the engine holds a lock around their
    handlers, and they write with its fence."""
    return sorted(n for n, jt in job_types.items()
                  if getattr(getattr(jt, "running", None), "exclusive", None) is not None)


def check_lock_ttl(s: DiagnosisSetup) -> Finding:
    """A lock whose TTL is shorter than the critical section expires while held: without
    renewal another worker enters; with renewal only a stalled watchdog does. Either way the
    one fence (:mod:`resources.locks.fencing`) refuses the stale holder's write: the lock's
    for the job types that declare a resource exclusive, the claim's for the others. Without a
    lock backend those job types cannot run."""
    exclusive = exclusive_types(s.job_types)
    if s.lock_ttl_seconds is None:
        if exclusive:
            return _finding(
                "lock_ttl", ERROR, False,
                f"no lock backend configured (NoLock), but {exclusive} declare "
                "running.exclusive: their requests fail (MissingLocks).",
                "Set LockResource.backend to redis or db: the engine holds that lock around "
                "their handlers and they write with its fence (ctx.write_fence).",
                exclusive=exclusive)
        return _finding("lock_ttl", WARN, True, "no lock backend configured (NoLock); no job "
                        "type declares running.exclusive (each writes with its claim's fence).",
                        "Nothing to change.")
    held = [
        v for a in s.attempts()
        if a["outcome"] == "completed"
        and (v := _critical_section(a, s.critical_section_keys)) is not None
    ]
    p99 = percentile(held, 0.99)
    renew = "on" if s.lock_auto_renew else "off"
    evidence = {"ttl": s.lock_ttl_seconds, "auto_renew": s.lock_auto_renew,
                "p99_critical_section": p99, "samples": len(held), "exclusive": exclusive}
    if held and p99 > s.lease_margin * s.lock_ttl_seconds and not s.lock_auto_renew:
        return _finding(
            "lock_ttl", ERROR, False,
            f"lock TTL {s.lock_ttl_seconds:g}s with renewal off, but the p99 critical section "
            f"is {_fmt(p99)} over {len(held)} attempts: locks expire while held.",
            f"Turn LockResource.auto_renew on, or raise ttl_seconds to at least "
            f"{math.ceil(p99 * 2):d}s; a stale holder is still refused at its write (the one "
            "fence: the lock's for exclusive job types, the claim's for the others).",
            **evidence,
        )
    if held and p99 > s.lock_ttl_seconds:
        return _finding(
            "lock_ttl", WARN, False,
            f"the p99 critical section ({_fmt(p99)}) outlasts the lock TTL "
            f"({s.lock_ttl_seconds:g}s); only renewal keeps the lock held.",
            f"Raise ttl_seconds to at least {math.ceil(p99 * 2):d}s so one missed renewal "
            "does not lose the lock.",
            **evidence,
        )
    return _finding(
        "lock_ttl", ERROR, True,
        f"lock TTL {s.lock_ttl_seconds:g}s (renewal {renew}); p99 critical section "
        f"{_fmt(p99)} over {len(held)} attempts; exclusive job types (writing with the lock's "
        f"fence): {exclusive or 'none'}.",
        "Nothing to change.", **evidence,
    )


# -- 5 ------------------------------------------------------------------------------------------


def _max_share_in_window(times: Sequence[float], width: float) -> float:
    if not times:
        return 0.0
    ordered = sorted(times)
    best, lo = 0, 0
    for hi, t in enumerate(ordered):
        while t - ordered[lo] > width:
            lo += 1
        best = max(best, hi - lo + 1)
    return best / len(ordered)


def check_retry_synchronisation(s: DiagnosisSetup) -> Finding:
    """Retries of one cohort with (nearly) the same delay hit the downstream in waves. The
    signature of missing jitter: for a given attempt number, delays that barely vary."""
    attempts = s.attempts()
    ended = {(a["idempotency_key"], a["attempt"]): a["ended_at"] for a in attempts}
    delays: defaultdict[int, list[float]] = defaultdict(list)
    starts: list[float] = []
    for a in attempts:
        if a["attempt"] and a["attempt"] > 0 and a["idempotency_key"]:
            starts.append(a["started_at"])
            prev = ended.get((a["idempotency_key"], a["attempt"] - 1))
            if prev is not None:
                delays[a["attempt"]].append(a["started_at"] - prev)
    cvs = {}
    for number, values in sorted(delays.items()):
        if len(values) >= s.min_samples:
            mean = statistics.fmean(values)
            cvs[number] = statistics.pstdev(values) / mean if mean > 0 else 0.0
    share = _max_share_in_window(starts, 1.0)
    evidence = {"retries": len(starts), "delay_cv_by_attempt": cvs, "max_share_in_1s": share}
    synced = {n: cv for n, cv in cvs.items() if cv < 0.1}
    if synced:
        return _finding(
            "retry_synchronisation", WARN, False,
            f"{len(starts)} retries; their delays barely vary (coefficient of variation "
            f"{', '.join(f'attempt {n}: {cv:.3f}' for n, cv in synced.items())}) and up to "
            f"{share:.0%} of them started within one second: retries without jitter, a cohort "
            "that failed together retries together.",
            "Use RetryPolicy(jitter='full') (or 'decorrelated') with a cap, and the shared "
            "RetryBudget per downstream; never Dagster's PLUS_MINUS backoff for cohorts.",
            **evidence,
        )
    if not cvs:
        found = f"{len(starts)} retries in the window: too few per attempt number to judge."
    else:
        found = (f"{len(starts)} retries with spread delays (coefficient of variation "
                 f"{', '.join(f'{cv:.2f}' for cv in cvs.values())}): jittered.")
    return _finding("retry_synchronisation", WARN, True, found, "Nothing to change.", **evidence)


# -- 6 ------------------------------------------------------------------------------------------


def check_cache_expiry_clusters(s: DiagnosisSetup) -> Finding:
    """Hot keys that expire in the same second rebuild in the same second: the stampede the
    single flight contains per key but not across keys."""
    if not s.caches:
        return _finding("cache_expiry_clusters", WARN, True, "no cache configured.",
                        "Nothing to change.")
    now = s.clock()
    clustered: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    for cache in s.caches:
        softs, ttls = [], []
        for key, _score in cache.hot_keys(s.hot_keys):
            env = cache.envelope(key)
            if env is None or env.hard <= now:
                continue
            softs.append(float(env.soft))
            ttls.append(float(env.ttl))
        share = _max_share_in_window(softs, s.expiry_cluster_seconds)
        distinct = len({round(t, 3) for t in ttls})
        summary[cache.namespace] = {"hot_keys": len(softs), "max_share": share,
                                    "distinct_ttls": distinct}
        if len(softs) >= max(5, s.min_samples // 2) and share > 0.5:
            clustered[cache.namespace] = summary[cache.namespace]
    if clustered:
        desc = "; ".join(
            f"namespace {ns}: {v['max_share']:.0%} of {v['hot_keys']} hot keys expire within "
            f"{s.expiry_cluster_seconds:g}s ({v['distinct_ttls']} distinct TTLs)"
            for ns, v in clustered.items()
        )
        return _finding(
            "cache_expiry_clusters", WARN, False,
            desc + ": uniform TTLs written together expire together and rebuild together.",
            "Pass jitter (e.g. 0.1) to get_or_load so TTLs spread, add a stale_ttl so readers "
            "are served while one rebuild runs, and let cache_warming_schedule refresh hot "
            "keys before they expire.",
            caches=summary,
        )
    return _finding(
        "cache_expiry_clusters", WARN, True,
        "hot keys' expiries are spread: "
        + ", ".join(f"{ns}: {v['hot_keys']} hot keys, at most {v['max_share']:.0%} in "
                    f"{s.expiry_cluster_seconds:g}s" for ns, v in summary.items()) + ".",
        "Nothing to change.", caches=summary,
    )


# -- 7 ------------------------------------------------------------------------------------------


def check_ack_timing(s: DiagnosisSetup, *, tolerance: float = 0.05) -> Finding:
    """The ack (the step ending ``completed``) must come after the result is stored: an ack
    first means a crash in between loses the result and the retry repeats the effect."""
    attempts = [a for a in s.attempts() if a["outcome"] == "completed" and a["idempotency_key"]]
    records = {key: (str(r.status), float(r.updated_at)) for key, r in LedgerViews(s.db).records(
        sorted({a["idempotency_key"] for a in attempts})).items()}
    unrecorded, late = [], []
    for a in attempts:
        rec = records.get(a["idempotency_key"])
        if rec is None or rec[0] != "completed":
            unrecorded.append(a["idempotency_key"])
        elif a["ended_at"] is not None and rec[1] > a["ended_at"] + tolerance:
            late.append(a["idempotency_key"])
    evidence = {"completed_attempts": len(attempts), "without_stored_result": len(unrecorded),
                "stored_after_ack": len(late)}
    if unrecorded or late:
        parts = []
        if unrecorded:
            parts.append(f"{len(unrecorded)} attempts ended completed while their key is not "
                         f"completed in the store (e.g. {_sample(unrecorded, 3)})")
        if late:
            parts.append(f"{len(late)} stored their result after the step had already "
                         f"succeeded (e.g. {_sample(late, 3)})")
        return _finding(
            "ack_timing", ERROR, False, "; ".join(parts) + ": the ack came first.",
            "Call IdempotencyStore.complete (in the business transaction, conn=...) before the "
            "op returns; never record the result in a later step, a hook or a sensor.",
            **evidence,
        )
    return _finding(
        "ack_timing", ERROR, True,
        f"all {len(attempts)} completed attempts stored their result before the step ended.",
        "Nothing to change.", **evidence,
    )


# -- 8 ------------------------------------------------------------------------------------------

_DLQ_FIX = {
    "permanent": "Fix the input or the producer that sends it, then replay the records "
                 "(`sekali dlq replay`) or discard them.",
    "transient": "The downstream was sick longer than the retries: check it and the retry "
                 "budget, then replay once it is healthy.",
    "data_bug": "A bug in the job's code met this data: fix and deploy, then replay.",
    "unknown": "Unclassified errors: classify them in resources/retry.py, fix the cause, "
               "then replay.",
    "crash_loop": "A handler kills its worker (os._exit, out of memory, a native crash): read "
                  "the dead runs named in the records, fix, then replay.",
    "timed_out": "A handler hung past its job type's max_runtime_seconds (each record says "
                 "where): give that downstream's client a timeout shorter than the bound (or "
                 "raise the bound), then replay; the replay takes the key over.",
}


def check_dlq(s: DiagnosisSetup) -> Finding:
    """The DLQ is not a trash can: what dominates it and whether it grows say what to fix."""
    if "dlq_records" not in s.tables():
        return _finding("dlq", WARN, True, "no DLQ table (not installed).", "Nothing to change.")
    now = s.clock()
    half = s.window_seconds / 2
    views = DlqViews(s.db)
    by_class = views.open_by_class()
    recent = views.inflow_between(now - half)
    earlier = views.inflow_between(now - 2 * half, now - half)
    total = sum(by_class.values())
    dominant = max(by_class, key=lambda c: by_class[c]) if by_class else None
    growing = recent >= s.min_samples and recent > 1.5 * earlier
    evidence = {"open_by_class": by_class, "inflow_recent": int(recent),
                "inflow_earlier": int(earlier), "dominant": dominant}
    if total == 0:
        return _finding("dlq", WARN, True, "the DLQ has no open records.", "Nothing to change.",
                        **evidence)
    share = by_class[dominant] / total if dominant else 0.0
    found = (f"{total} open records, {share:.0%} {dominant}; inflow {recent} in the last "
             f"{half / 3600:g}h against {earlier} before")
    if growing or total > s.dlq_open_limit:
        why = "growing" if growing else f"over {s.dlq_open_limit} open"
        return _finding("dlq", WARN, False, f"{found}: {why}.", _DLQ_FIX.get(dominant or "", ""),
                        **evidence)
    return _finding("dlq", WARN, True, f"{found}: stable.",
                    "Work the open records: " + _DLQ_FIX.get(dominant or "", ""), **evidence)


# -- 9 ------------------------------------------------------------------------------------------

UNIQUE_REQUIRED: tuple[tuple[str, tuple[str, ...], bool], ...] = (
    ("idempotency_records", ("key",), True),
    ("job_requests", ("key",), True),
    ("outbox", ("event_id",), False),
    ("inbox", ("consumer", "event_id"), False),
    ("dlq_records", ("dedupe_key",), False),
)
"""(table, columns that must be unique, table required): the platform's. The job types add
theirs (``unique``, checked when the table exists). The database is the guarantee."""


def unique_required(job_types: Mapping[str, Any]) -> list[tuple[str, tuple[str, ...], bool]]:
    """The platform's unique constraints, then each job type's own (once each)."""
    wanted = list(UNIQUE_REQUIRED)
    for jt in job_types.values():
        for table, cols in getattr(getattr(jt, "upkeep", None), "unique", ()):
            if not any(w[0] == table and w[1] == cols for w in wanted):
                wanted.append((table, cols, False))
    return wanted


def check_unique_constraints(s: DiagnosisSetup) -> Finding:
    """Tables prone to duplicates must refuse them themselves (a unique key), and writes must
    run in transactions that serialise writers; a check in code alone races."""
    missing: list[str] = []
    present: list[str] = []
    with s.db.engine.connect() as conn:
        insp = inspect(conn)
        tables = set(insp.get_table_names())
        for table, cols, required in unique_required(s.job_types):
            if table not in tables:
                if required:
                    missing.append(f"{table} (table missing)")
                continue
            unique_sets = [tuple(insp.get_pk_constraint(table).get("constrained_columns") or ())]
            unique_sets += [tuple(u["column_names"]) for u in insp.get_unique_constraints(table)]
            unique_sets += [tuple(str(c) for c in i["column_names"])
                            for i in insp.get_indexes(table) if i.get("unique")]
            if any(set(u) == set(cols) for u in unique_sets):
                present.append(f"{table}({', '.join(cols)})")
            else:
                missing.append(f"{table}({', '.join(cols)})")
        boundary, wrong = s.db.sql_dialect.write_boundary(conn)
        missing += wrong
    evidence = {"unique": present, "missing": missing}
    if missing:
        return _finding(
            "unique_constraints", ERROR, False,
            f"no unique constraint on {', '.join(missing)}: two concurrent writers can both "
            "insert the same intent and only code checks stop them.",
            "Apply the schema with `sekali db upgrade` (sql/ declares these keys); add a "
            "UNIQUE constraint or index on the listed columns, after removing existing "
            "duplicates, and write the effect and its record in one transaction.",
            **evidence,
        )
    return _finding(
        "unique_constraints", ERROR, True,
        f"unique keys in place on {', '.join(present)}; {boundary}.",
        "Nothing to change.", **evidence,
    )


# -- 10 -----------------------------------------------------------------------------------------


def check_correlation(s: DiagnosisSetup) -> Finding:
    """One correlation id must link the request, its attempts and the external effect, so an
    incident can be followed from the producer to the downstream."""
    since = s.since()
    tables = s.tables()
    requests: dict[int, str | None] = {}
    if "job_requests" in tables:
        requests = RequestStore(s.db).correlation_ids_since(since)
    attempts = [a for a in s.attempts() if a["outcome"] == "completed"]
    no_request_cid = sum(1 for c in requests.values() if not c)
    no_attempt_cid = sum(1 for a in attempts if not a["correlation_id"])
    mismatched = sum(
        1 for a in attempts
        if a["request_id"] is not None and int(a["request_id"]) in requests
        and requests[int(a["request_id"])] and a["correlation_id"]
        != requests[int(a["request_id"])]
    )
    known = {c for c in requests.values() if c} | {a["correlation_id"] for a in attempts
                                                  if a["correlation_id"]}
    effect_missing = 0
    effect_unlinked = 0
    effects = 0
    for ledger in s.effect_ledgers:
        if ledger.correlation_column is None:
            continue
        for _intent, cid in ledger.rows(since):
            effects += 1
            if not cid:
                effect_missing += 1
            elif cid not in known:
                effect_unlinked += 1
    evidence = {
        "requests": len(requests), "requests_without_id": no_request_cid,
        "attempts": len(attempts), "attempts_without_id": no_attempt_cid,
        "attempts_mismatched": mismatched, "effects": effects,
        "effects_without_id": effect_missing, "effects_unlinked": effect_unlinked,
    }
    gaps = []
    if no_request_cid:
        gaps.append(f"{no_request_cid}/{len(requests)} requests have no correlation id")
    if no_attempt_cid:
        gaps.append(f"{no_attempt_cid}/{len(attempts)} completed attempts have none")
    if mismatched:
        gaps.append(f"{mismatched} attempts carry another id than their request")
    if effect_missing:
        gaps.append(f"{effect_missing}/{effects} downstream effects arrived without one")
    if effect_unlinked:
        gaps.append(f"{effect_unlinked} downstream effects carry an id no request or attempt has")
    if gaps:
        return _finding(
            "correlation", WARN, False,
            "; ".join(gaps) + ": a request, its job and its external effect cannot be linked.",
            "Pass correlation_id to enqueue (or let it generate one), keep it in the run tag "
            "sekali/correlation_id and the op config, pass it to execute_request, and send it "
            "downstream as X-Correlation-Id; log with resources.telemetry.logs.",
            **evidence,
        )
    return _finding(
        "correlation", WARN, True,
        f"{len(requests)} requests, {len(attempts)} completed attempts and {effects} downstream "
        "effects all carry linked correlation ids.",
        "Nothing to change.", **evidence,
    )


# -- 11 -----------------------------------------------------------------------------------------


def check_retention_backlog(s: DiagnosisSetup) -> Finding:
    """Every table that grows against its retention: rows past retention (plus a slack of
    several reconciliation runs) that nothing unresolved references are rows the purge should
    have deleted, so it is not running or cannot keep up; and an open DLQ record whose key
    completed should have resolved itself in the same run."""
    late = s.retention.extended(s.retention_slack_seconds)
    ledger, dlq = IdempotencyStore(s.db, clock=s.clock), DlqStore(s.db, clock=s.clock)
    expired = retention_expiries(
        s.db, late, ledger=ledger, dlq=dlq, clock=s.clock,
        watched_seconds=s.reconciliation_watch_seconds,
    )
    tables = {t.table: asdict(t) for t in backlog(s.db, expired, late)}
    for row in tables.values():
        row["retention_seconds"] -= s.retention_slack_seconds
    behind = {t: row["expired"] for t, row in tables.items() if row["expired"]}
    unresolved = [r for r in dlq.list_records(status=list(UNRESOLVED)) if r.idempotency_key]
    done = ledger.records([r.idempotency_key or "" for r in unresolved], status=Status.COMPLETED)
    stale = s.clock() - s.retention_slack_seconds
    settled = sorted(
        r.id for r in unresolved
        if r.idempotency_key in done and done[r.idempotency_key].updated_at <= stale
    )
    evidence = {"tables": tables, "open_records_with_completed_key": settled}
    sizes = ", ".join(
        f"{t} {row['rows']} rows ({row['retention_seconds'] / 86400:g}d)"
        for t, row in tables.items()
    )
    if behind or settled:
        parts = [f"{n} rows of {t}" for t, n in behind.items()]
        if settled:
            parts.append(f"{len(settled)} open DLQ records whose key completed long ago "
                         f"(e.g. {settled[:5]})")
        return _finding(
            "retention_backlog", WARN, False,
            f"{'; '.join(parts)} are older than their retention by more than "
            f"{s.retention_slack_seconds / 3600:g}h and referenced by nothing unresolved: the "
            f"purge is not running or not keeping up. Sizes: {sizes}.",
            "Check that reconciliation_schedule runs and its reconciliation asset succeeds "
            "(its metadata counts purged_* per table); raise SEKALI_RETENTION_MAX_BATCHES if "
            "each run purges its full budget and the backlog still grows.",
            **evidence,
        )
    return _finding(
        "retention_backlog", WARN, True,
        f"no table holds rows past its retention that nothing references: {sizes}.",
        "Nothing to change.", **evidence,
    )


# -- 14 -----------------------------------------------------------------------------------------


def check_tenant_starvation(s: DiagnosisSetup) -> Finding:
    """A tenant is starved when its oldest waiting request has waited longer than
    ``tenant_starved_seconds`` while requests of other tenants enqueued after it were claimed:
    the intake passes it over (a weight far below the others', a maximum share held near zero).
    A backlog that nobody is claiming (the intake stopped) is not starvation: no one overtook."""
    now = s.clock()
    starved = {}
    requests = RequestStore(s.db)
    waiting = requests.oldest_waiting_by_tenant()
    for tenant, (n, oldest) in sorted(waiting.items()):
        if now - oldest < s.tenant_starved_seconds:
            continue
        overtaken_by = requests.overtaking(tenant, oldest)
        if overtaken_by:
            starved[tenant] = {"waiting": n, "oldest_wait_seconds": round(now - oldest, 1),
                               "overtaken_by": overtaken_by}
    if starved:
        names = ", ".join(
            f"{t} ({v['waiting']} waiting, oldest {v['oldest_wait_seconds']:g}s, overtaken by "
            f"{v['overtaken_by']} newer requests of other tenants)" for t, v in starved.items()
        )
        return _finding(
            "tenant_starvation", WARN, False,
            f"starved tenants: {names}.",
            "Give the tenant a larger weight or a guaranteed minimum share, or lift its "
            "maximum: `sekali tenants set NAME --weight W --min M` (read at the next claim); "
            "`sekali tenants list` shows every tenant's settings and backlog.",
            starved=starved, waiting=len(waiting),
        )
    return _finding(
        "tenant_starvation", WARN, True,
        f"no tenant's oldest request waited over {s.tenant_starved_seconds:g}s while newer "
        f"requests of others were claimed ({len(waiting)} tenants waiting).",
        "Nothing to change.", waiting=len(waiting),
    )


# -- 15 -----------------------------------------------------------------------------------------


def check_outbox_dead_letters(s: DiagnosisSetup) -> Finding:
    """An outbox event whose consumer failed for good waits in the outbox dead letters for an
    operator, and later events of its aggregate wait behind it (the ordering rule): nothing
    retries them, so they are reported until someone replays or discards them."""
    dead, behind = held_by_dead_letters(s.db)
    evidence = {"dead_lettered": dead, "waiting_behind": behind}
    if dead:
        return _finding(
            "outbox_dead_letters", WARN, False,
            f"{dead} outbox events are dead-lettered and {behind} later events of their "
            "aggregates wait behind them.",
            "Look at each with `sekali outbox dead`, fix the consumer, then `sekali outbox "
            "replay ID` (it goes first, then the events behind it) or `sekali outbox discard ID "
            "--reason ...`.",
            **evidence,
        )
    return _finding(
        "outbox_dead_letters", WARN, True, "no outbox event waits for an operator.",
        "Nothing to change.", **evidence,
    )


# -- 12 -----------------------------------------------------------------------------------------


def check_retention_agreement(s: DiagnosisSetup) -> Finding:
    """The ledger must outlive every open DLQ record: a replay of a record whose completed key
    was purged runs the effect again. The purge keeps the key of every unresolved record; this
    checks that it held (an open record whose key completed before and is gone now) and that
    the retention floors hold."""
    dlq = DlqStore(s.db, clock=s.clock)
    unresolved = [r for r in dlq.list_records(status=list(UNRESOLVED)) if r.idempotency_key]
    keys = sorted({r.idempotency_key or "" for r in unresolved})
    present = IdempotencyStore(s.db, clock=s.clock).records(keys)
    attempts = AttemptRecorder(s.db)
    forgotten = sorted(
        k for k in keys
        if k not in present and any(a["outcome"] == "completed" for a in attempts.for_key(k))
    )
    days = {name: round(v / 86400, 2) for name, v in s.retention.tables().items()}
    short = [n for n in ("idempotency", "dlq") if s.retention.tables()[n] < MIN_RETENTION_SECONDS]
    evidence = {"unresolved_records_with_key": len(unresolved), "forgotten_keys": forgotten,
                "retention_days": days}
    if forgotten or short:
        parts = []
        if forgotten:
            parts.append(f"{len(forgotten)} keys of open DLQ records completed once and are gone "
                         f"from the ledger (e.g. {forgotten[:3]}): a replay repeats the effect")
        if short:
            parts.append(f"retention of {', '.join(short)} is under the "
                         f"{MIN_RETENTION_SECONDS / 3600:g}h floor")
        return _finding(
            "retention_agreement", ERROR, False, "; ".join(parts) + ".",
            "Do not replay those records: discard them, or check the effect downstream first. "
            "Purge the ledger only through the reconciliation run (it keeps the key of every "
            "unresolved DLQ record and unfinished request), and keep SEKALI_RETENTION_"
            "IDEMPOTENCY_DAYS and the DLQ's retention_days at 3 days or more.",
            **evidence,
        )
    horizon = (
        "the ledger outlives the DLQ's retention"
        if s.retention.idempotency >= s.retention.dlq
        else "the purge keeps each key while its record is unresolved, past the ledger's "
        "own retention"
    )
    return _finding(
        "retention_agreement", ERROR, True,
        f"ledger retention {days['idempotency']:g}d, DLQ {days['dlq']:g}d: {horizon}; every "
        f"key named by the {len(unresolved)} unresolved DLQ records is still in the ledger or "
        "never completed.",
        "Nothing to change.", **evidence,
    )


def check_redis_eviction(s: DiagnosisSetup) -> Finding:
    """Locks, fences, concurrency slots, rate buckets and the retry budget live in Redis: a
    Redis that may evict keys (any ``maxmemory-policy`` but ``noeviction``) can drop a held
    lock's key under memory pressure and let a second holder in. Each client refuses such a
    Redis at its first use; this catches a policy changed afterwards (docs/locks.md)."""
    if s.redis is None:
        return _finding("redis_eviction", ERROR, True, "no Redis configured for this check.",
                        "Nothing to change.")
    nodes = memory_policies(s.redis)
    evicting = [n for n in nodes if n.evicts]
    evidence = {"nodes": {n.node: {"maxmemory_policy": n.policy, "maxmemory": n.maxmemory}
                          for n in nodes}}
    if evicting:
        named = ", ".join(f"{n.node} ({n.policy}, maxmemory {n.maxmemory})" for n in evicting)
        return _finding(
            "redis_eviction", ERROR, False,
            f"Redis may evict sekali's lock, slot and bucket keys under memory pressure: {named}.",
            "Set maxmemory-policy noeviction on every node (CONFIG SET maxmemory-policy "
            "noeviction, and in redis.conf), or give sekali a Redis of its own that never "
            "evicts; a full noeviction Redis refuses writes (StoreFull, retried) instead of "
            "dropping a held lock. Then restart the workers.",
            **evidence,
        )
    return _finding(
        "redis_eviction", ERROR, True,
        f"every node ({len(nodes)}) has maxmemory-policy noeviction: no key of a lock, slot or "
        "bucket can be evicted.",
        "Nothing to change.", **evidence,
    )


def check_replication(s: DiagnosisSetup) -> Finding:
    """A key completes in the business transaction; its effect (a charge, a mail) is outside.
    A failover to a standby that had not received the commit rolls the completion back while
    the effect stays, and the request runs again: the primary's replication mode decides
    whether that can happen (:mod:`resources.storage.replication`)."""
    if not s.db.sql_dialect.has_replicas:
        return _finding("replication", ERROR, True, "SQLite: no replica, nothing to fail over.",
                        "Nothing to change.")
    with s.db.statement() as conn:
        found = read_replication(conn)
    careless = sorted(name for name, jt in s.job_types.items()
                      if getattr(jt, "side_effect", False)
                      and getattr(getattr(jt, "calls", None), "clients", ())
                      and not jt.looks_up_first())
    evidence = {"mode": found.mode, "synchronous_commit": found.synchronous_commit,
                "synchronous_standby_names": found.synchronous_standby_names,
                "standbys": found.standbys, "managed": found.managed,
                "first_send_without_lookup": careless}
    if not found.rolls_back and found.mode != "standby":
        return _finding("replication", ERROR, True,
                        f"A completed key cannot be rolled back by a failover: {found.describe()}.",
                        "Nothing to change." if found.mode == "durable" else
                        "If your platform fails over to a replica, make sure it is a "
                        "synchronous one (or set synchronous_standby_names here).", **evidence)
    guard = (f" Job types whose first send does not look its effect up first: "
             f"{', '.join(careless)}: each would repeat its effect after such a rollback."
             if careless else " Every job type with a side effect looks it up before its "
             "first send, so a rolled-back key finds its effect instead of repeating it.")
    fix = ("Make a standby synchronous: synchronous_standby_names = 'FIRST 1 (standby)' and "
           "synchronous_commit = on (a commit then waits for it: measure the latency); or keep "
           "SEKALI_ACCEPT_ASYNC_REPLICATION=1 and turn lookup-first on for the job types named "
           "(Calls.lookup_first, SEKALI_LOOKUP_FIRST); see docs/chaos.md, pg-failover.")
    if found.mode == "standby":
        fix = "Point DATABASE_URL at the primary."
    severity = (WARN if (accepted() or not found.refused) and found.mode != "standby"
                else ERROR)
    return _finding("replication", severity, False,
                    f"A completed key CAN be rolled back: {found.describe()}.{guard}"
                    + (f" Accepted by {ACCEPT_ENV}=1." if found.refused and accepted() else ""),
                    fix, **evidence)


# -- 17 -----------------------------------------------------------------------------------------


def check_adaptive_timing(s: DiagnosisSetup) -> Finding:
    """The numbers sekali chose from the observed durations, with why (:mod:`engine.durations`):
    per job type p50/p99/p99.9 over the window and their sample size, the lease in force and
    its heartbeat. Fails (WARN) when a job type's p99.9 outlasts the adaptive lease (its
    ceiling clamps it below the work): a pause of a heartbeat's length then costs a takeover.
    A declared lease below the work is check 2's (``lease_vs_duration``) to report."""
    leases = s.leases()
    short = {jt: row for jt, row in leases.items() if row.get("lease_observed")
             and not math.isnan(float(row["p999"]))
             and float(row["p999"]) > float(row["lease_seconds"])}
    lines = [
        f"{jt}: n={row['samples']} p50={_fmt(float(row['p50']))} p99={_fmt(float(row['p99']))} "
        f"p99.9={_fmt(float(row['p999']))}, lease "
        + (f"{float(row['lease_seconds']):g}s ({row['lease_why']})" if "lease_seconds" in row
           else "n/a (not a registered job type)")
        for jt, row in leases.items()
    ]
    found = "; ".join(lines) or "no job type"
    if short:
        return _finding(
            "adaptive_timing", WARN, False,
            f"p99.9 outlasts the lease in force for {', '.join(sorted(short))}. {found}.",
            "Raise the job type's LeaseBounds.ceiling above its p99.9, or make the work "
            "shorter.",
            job_types=leases, window_seconds=s.adaptive.window_seconds,
        )
    return _finding(
        "adaptive_timing", WARN, True, found + ".",
        "Nothing to change; the leases follow the durations (SEKALI_ADAPTIVE=0 turns that off).",
        job_types=leases, window_seconds=s.adaptive.window_seconds,
    )


# -- 18 -----------------------------------------------------------------------------------------


def check_worker_capacity(s: DiagnosisSetup) -> Finding:
    """How many resident workers the observed load needs per queue (Little's law,
    :mod:`engine.capacity`), against the bounds ``SEKALI_WORKERS`` gives, and whether the
    backlog drains. Fails (WARN) when even the ceiling's workers finish fewer requests than
    arrive: the backlog grows whatever the supervisor does."""
    delivery, targets = DeliveryPolicy.from_env(), WorkerTargets.from_env()
    queues = {q: delivery.resident(q) for q in delivery.queues()}
    model = DurationModel(AttemptRecorder(s.db), s.adaptive, clock=s.clock)
    bounds = {q: targets.bounds(q) for q in queues}
    loads = measure(RequestStore(s.db), model, queues, bounds, s.capacity, s.clock())
    evidence = {q: load.as_dict(load.needed) for q, load in loads.items()}
    short = [q for q, load in loads.items() if not load.draining(load.ceiling)]
    found = "; ".join(load.describe(load.needed) for load in loads.values()) or (
        "no queue served by resident workers")
    if short:
        return _finding(
            "worker_capacity", WARN, False,
            f"{', '.join(short)}: more arrives than the ceiling's workers can finish, the "
            f"backlog grows. {found}.",
            "Raise the ceiling in SEKALI_WORKERS (QUEUE=FLOOR..CEILING), or make the work "
            "shorter; a fixed count (QUEUE=N) is never sized from the load.",
            queues=evidence,
        )
    return _finding("worker_capacity", WARN, True, found + ".",
                    "Nothing to change.", queues=evidence)


TITLES = {
    "real_duplicates": "1. Real duplicate effect or only a duplicate log line",
    "lease_vs_duration": "2. Lease against p99 duration per job type",
    "idempotency_coverage": "3. Idempotency coverage of side-effecting job types",
    "lock_ttl": "4. Lock TTL against p99 critical section, renewal",
    "retry_synchronisation": "5. Retry synchronisation (jitter)",
    "cache_expiry_clusters": "6. Hot cache keys expiring together",
    "ack_timing": "7. Ack timing: result stored before the step succeeds",
    "dlq": "8. DLQ dominant class and growth",
    "unique_constraints": "9. Unique constraints and transaction boundaries",
    "correlation": "10. Correlation: request, job and effect linked",
    "retention_backlog": "11. Table sizes against their retention",
    "retention_agreement": "12. Ledger retention outlives open DLQ records",
    "redis_eviction": "13. Redis never evicts locks, slots and buckets",
    "replication": "16. A database failover cannot roll a completed key back",
    "tenant_starvation": "14. No tenant starved by the fair share",
    "outbox_dead_letters": "15. No outbox event waiting for an operator",
    "adaptive_timing": "17. Leases from the observed durations, per job type",
    "worker_capacity": "18. Workers the observed load needs, and whether the backlog drains",
}

CHECKS: tuple[Check, ...] = tuple(
    Check(name, TITLES[name], fn)
    for name, fn in (
        ("real_duplicates", check_real_duplicates),
        ("lease_vs_duration", check_lease_vs_duration),
        ("idempotency_coverage", check_idempotency_coverage),
        ("lock_ttl", check_lock_ttl),
        ("retry_synchronisation", check_retry_synchronisation),
        ("cache_expiry_clusters", check_cache_expiry_clusters),
        ("ack_timing", check_ack_timing),
        ("dlq", check_dlq),
        ("unique_constraints", check_unique_constraints),
        ("correlation", check_correlation),
        ("retention_backlog", check_retention_backlog),
        ("retention_agreement", check_retention_agreement),
        ("redis_eviction", check_redis_eviction),
        ("tenant_starvation", check_tenant_starvation),
        ("outbox_dead_letters", check_outbox_dead_letters),
        ("replication", check_replication),
        ("adaptive_timing", check_adaptive_timing),
        ("worker_capacity", check_worker_capacity),
    )
)
"""The checklist in order. Severity on failure: ERROR for broken invariants, WARN otherwise."""

DEFAULT_SEVERITY = {
    "real_duplicates": ERROR, "lease_vs_duration": ERROR, "idempotency_coverage": ERROR,
    "lock_ttl": ERROR, "retry_synchronisation": WARN, "cache_expiry_clusters": WARN,
    "ack_timing": ERROR, "dlq": WARN, "unique_constraints": ERROR, "correlation": WARN,
    "retention_backlog": WARN, "retention_agreement": ERROR, "redis_eviction": ERROR,
    "tenant_starvation": WARN, "outbox_dead_letters": WARN, "replication": ERROR,
    "adaptive_timing": WARN, "worker_capacity": WARN,
}


def run_check(check: Check, setup: DiagnosisSetup) -> Finding:
    """Run one check; a check that cannot read its evidence fails and says why."""
    try:
        return check.run(setup)
    except Exception as exc:  # noqa: BLE001 - a broken probe must show, not pass
        log.warning("check %s could not run", check.name, exc_info=True)
        return Finding(
            check.name, check.title, DEFAULT_SEVERITY[check.name], False,
            f"could not read the evidence: {type(exc).__name__}: {exc}",
            "Make the database and Redis reachable and the schema migrated "
            "(`sekali db upgrade`), then run the check again.",
        )


def diagnose(setup: DiagnosisSetup, only: Iterable[str] | None = None) -> list[Finding]:
    """Every check of the checklist (or ``only`` those named), in order."""
    wanted = set(only) if only is not None else None
    setup.forget()
    try:
        return [run_check(c, setup) for c in CHECKS if wanted is None or c.name in wanted]
    finally:
        setup.forget()


def has_errors(findings: Iterable[Finding]) -> bool:
    return any(not f.passed and f.severity == ERROR for f in findings)
