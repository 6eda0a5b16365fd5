"""Ground truth for ``sekali chaos --job-type``: effects counted where they happen.

A verdict is only as good as its counting, so the checker does not take the job type's word
for it:

- **The stand-in's own record.** A downstream's sandbox may say how to read what it received
  (``Sandbox.record``). When every downstream of a job type declares one, the checker counts
  the effects of each intent there, never through the job type's lookup hook; otherwise it
  counts through the lookup, and the verdict says plainly that those counts are unverified.
- **The lookup, calibrated before the fault run** (:func:`calibrate`). The handler runs
  ``runs`` times for each of a few keys of its own, with its ledger bypassed (a fresh database
  per run, so every run is a first claim) and its reads of the downstream answered empty (the
  client methods the lookup hook reads with), so each run sends again: duplicates made on
  purpose. The lookup must then report, for each key, exactly the effects the stand-in's
  record holds. One that reports fewer (under-reports), none at all (never finds) or more
  (over-reports) fails the run, naming the lookup: a run counting or recovering through it
  would blame the wrong thing ("lost") or miss duplicates.
- **The send bound, an invariant of its own** (:func:`judge_send_bounds`). Every effect must
  arrive at the stand-in inside a lease confirmation a holder of its key made right before
  sending: the attempt rows carry each confirmation's ``(asked, bound)``
  (``job_attempts.send_bounds``, written by ``JobContext.confirm_lease``), the record carries
  the arrival. A handler that sends without confirming, or a client that ignores the bound,
  fails on every effect, not only when a stop happens to fall between its check and its send.

Everything here reads evidence (records, stores) after or before the workers ran; nothing
depends on how deliveries reach the workers.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import text

from engine.attempts import AttemptRecorder
from engine.contract import Effect, JobType
from engine.registry import get_job_type
from engine.runtime import execute_request
from engine.services import Services
from proof.chaos_typed import Sandboxes, environment, varied
from proof.chaos_worker import lookup_reads
from resources.errors import SekaliError, ValidationError
from resources.idempotency import IdempotencyStore
from resources.locks import DbLock
from resources.storage.db import Database
from resources.storage.migrations import upgrade

logger = logging.getLogger(__name__)

RECORD = "record"
LOOKUP = "lookup"


class GroundTruth:
    """The effects of an intent as the stand-ins' own records hold them (:meth:`effects`), for
    the job types all of whose downstreams declare a record; ``None`` for the others."""

    def __init__(self, sandboxes: Sandboxes) -> None:
        self.sandboxes = sandboxes

    def counted_by(self, jt: JobType) -> str:
        """``record`` when every downstream of ``jt`` declares one, else ``lookup``."""
        boxes = [d.sandbox for d in jt.calls.clients]
        ok = bool(boxes) and all(b is not None and b.record is not None for b in boxes)
        return RECORD if ok else LOOKUP

    def effects(self, job_type: str, payload: Mapping[str, Any]) -> list[Effect] | None:
        """Every effect the records hold for ``payload``'s intent, in arrival order; ``[]``
        for a payload the job type refuses; ``None`` when it is not counted by record."""
        jt = get_job_type(job_type)
        if self.counted_by(jt) != RECORD:
            return None
        try:
            clean = jt.validate(dict(payload))
        except ValidationError:
            return []
        key = jt.keying.key_for(clean)
        out: list[Effect] = []
        for d in jt.calls.clients:
            assert d.sandbox is not None and d.sandbox.record is not None
            out += d.sandbox.record(self.sandboxes.stand_ins[d.name], key, clean)
        return sorted(out, key=lambda e: (e.at is None, e.at or 0.0))


def unverified_note(jt: JobType) -> str:
    missing = [d.name for d in jt.calls.clients if d.sandbox is None or d.sandbox.record is None]
    return (f"{jt.name}: effects counted through its own lookup hook, unverified: the sandbox "
            f"of {', '.join(missing)} declares no record of its own (Sandbox.record), so "
            "nothing checks the lookup's counts, nor the send bound")


# -- calibration -------------------------------------------------------------------------------


class EmptyReads:
    """A client whose ``reads`` answer empty: the read is made, its answer replaced by an empty
    one of the same type (a list, a dict, None), so a handler looking first finds nothing and
    sends again. Other attributes pass through."""

    def __init__(self, inner: Any, reads: frozenset[str]) -> None:
        self.inner = inner
        self.reads = reads

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        if name not in self.reads or not callable(value):
            return value

        def read(*args: Any, **kwargs: Any) -> Any:
            answer = value(*args, **kwargs)
            if answer is None:
                return None
            if isinstance(answer, list | tuple | dict | set | frozenset):
                return type(answer)()
            raise CalibrationError(f"{name} answered a {type(answer).__name__}: the "
                                   "calibration cannot answer it as empty")

        return read


class CalibrationError(SekaliError):
    """The lookup could not be calibrated (the handler's read answers something that cannot be
    made empty): the run says so instead of counting through an unchecked lookup."""

    permanent = True


@dataclass
class KeyCalibration:
    key: str
    runs: int
    made: int | None  # the record's count (None: the stand-in declares no record)
    reported: int | None  # the lookup's count (None: the lookup raised)
    errors: list[str] = field(default_factory=list)


@dataclass
class Calibration:
    """One job type's lookup against duplicates made on purpose."""

    job_type: str
    counted_by: str
    keys: list[KeyCalibration]
    problem: str | None = None  # a violation: the lookup cannot be trusted
    note: str | None = None  # what the calibration could not show

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def calibrate(jt: JobType, sandboxes: Sandboxes, state: Path, *, runs: int, keys: int,
              offset: int, lease: float, settle: float) -> Calibration:
    """Make ``runs`` sends for each of ``keys`` intents of ``jt`` of its own (payloads
    ``varied(jt, offset + i)``, apart from the workload's) and judge its lookup against the
    stand-in's record (see the module)."""
    truth = GroundTruth(sandboxes)
    counted_by = truth.counted_by(jt)
    plain = sandboxes.clients()
    with environment(sandboxes.env):
        reads = lookup_reads(jt.name, plain)
    blanked = {d.name: EmptyReads(plain[d.name], reads) for d in jt.calls.clients}
    folder = state / "calibration"
    folder.mkdir(parents=True, exist_ok=True)
    results = []
    for i in range(keys):
        payload = varied(jt, offset + i)
        clean = jt.validate(dict(payload))
        key = jt.keying.key_for(clean)
        errors = []
        for r in range(runs):
            db = Database.from_url(f"sqlite:///{folder / f'{jt.name}-{i}-{r}.db'}")
            try:
                upgrade(db)
                services = Services(db=db, store=IdempotencyStore(db, lease_seconds=lease),
                                    attempts=AttemptRecorder(db), clients=dict(blanked),
                                    locks=functools.partial(DbLock, db, ttl=lease),
                                    settle_seconds=settle)
                with environment(sandboxes.env):
                    execute_request(jt.name, payload, services=services,
                                    run_id=f"calibration-{i}-{r}",
                                    correlation_id=f"calibration-{jt.name}-{i}")
            except Exception as exc:  # noqa: BLE001 - reported: a run that sent nothing counts 0
                errors.append(f"run {r + 1}: {type(exc).__name__}: {exc}"[:300])
            finally:
                db.dispose()
        made = truth.effects(jt.name, payload)
        try:
            with environment(sandboxes.env):
                reported: int | None = len(jt.effects(plain.__getitem__, key, clean))
        except Exception as exc:  # noqa: BLE001 - a lookup that cannot answer is a finding
            reported = None
            errors.append(f"lookup: {type(exc).__name__}: {exc}"[:300])
        results.append(KeyCalibration(key, runs, None if made is None else len(made), reported,
                                      errors))
    out = Calibration(jt.name, counted_by, results)
    out.problem, out.note = _judge_calibration(jt.name, results, runs)
    return out


def _judge_calibration(name: str, keys: list[KeyCalibration], runs: int
                       ) -> tuple[str | None, str | None]:
    """``(problem, note)`` of a calibration (see :func:`calibrate`)."""
    how = (f"made on purpose: the handler run {runs} times per key with its ledger bypassed "
           "and its reads answered empty")
    if any(k.reported is None for k in keys):
        first = next(e for k in keys for e in k.errors if e.startswith("lookup"))
        return f"lookup failed: {name}'s lookup hook could not be asked ({first})", None
    reported = [int(k.reported or 0) for k in keys]
    if all(k.made is not None for k in keys):
        made = [int(k.made or 0) for k in keys]
        if not any(made):
            errors = "; ".join(e for k in keys for e in k.errors[:1])
            return (f"calibration made no effect: {name}'s handler sent nothing the stand-in "
                    f"recorded in {runs * len(keys)} runs ({errors or 'no error'})"), None
        if not any(reported):
            return (f"lookup never finds: {name}'s lookup hook reported 0 effects for "
                    f"{len(keys)} keys whose stand-in record holds {made} ({how})"), None
        if any(r < m for r, m in zip(reported, made, strict=True)):
            return (f"lookup under-reports: {name}'s lookup hook reported {reported} effects "
                    f"for {len(keys)} keys whose stand-in record holds {made} ({how})"), None
        if any(r > m for r, m in zip(reported, made, strict=True)):
            return (f"lookup over-reports: {name}'s lookup hook reported {reported} effects "
                    f"for {len(keys)} keys whose stand-in record holds {made}"), None
        if max(made) < 2:
            return None, (f"{name}: the stand-in kept one effect per key in {runs} sends (it "
                          "dedupes them), so the calibration shows the lookup finds an effect, "
                          "not that it counts duplicates")
        return None, None
    if not any(reported):
        return (f"lookup never finds: {name}'s lookup hook reported 0 effects for {len(keys)} "
                f"keys after {runs} sends each ({how})"), None
    if any(r < runs for r in reported):
        return None, (f"{name}: its lookup reported {reported} effects for {len(keys)} keys "
                      f"after {runs} sends each; with no record of the stand-in's own "
                      "(Sandbox.record) an under-reporting lookup cannot be told from a "
                      "downstream that dedupes")
    return None, None


# -- the send bound ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SentUnder:
    """What the attempts of one key say about its senders: every ``(asked, bound)`` lease
    confirmation their rows carry, and whether a holder died before its row could carry its
    own (outcome still ``started``)."""

    bounds: tuple[tuple[float, float], ...]
    died: bool


def sent_under(attempts: Sequence[Any]) -> SentUnder:
    """From a key's ``job_attempts`` rows (``outcome``, ``send_bounds`` as stored)."""
    bounds: list[tuple[float, float]] = []
    for a in attempts:
        if a.send_bounds:
            bounds += [(float(x), float(y)) for x, y in json.loads(a.send_bounds)]
    return SentUnder(tuple(sorted(bounds)), any(a.outcome == "started" for a in attempts))


def judge_send_bounds(
    arrivals: Mapping[str, tuple[str, Sequence[Effect]]],
    senders: Mapping[str, SentUnder],
    *, lease: float, skew: float,
) -> tuple[list[str], Counter[str]]:
    """Every effect ``arrivals[key] = (tag, effects)`` must have arrived inside a confirmation
    a holder of ``key`` made: at or after ``asked`` and by ``bound + lease / 2`` (the client
    writes nothing after the bound, 0.4 lease after ``asked``; the half lease after it is for
    the bytes' travel and the stand-in's own recording, and still ends inside the lease the
    confirmation granted), each edge widened by ``skew`` (the workers' wall clocks may be
    that far off the stand-in's). An effect no confirmation covers is a violation, unless a
    holder of its key died with its confirmations unwritten: then it is counted unjudged.
    Returns ``(violations, stats)``."""
    slack = lease / 2
    stats: Counter[str] = Counter()
    violations = []
    for key, (tag, effects) in arrivals.items():
        under = senders.get(key, SentUnder((), False))
        for e in effects:
            if e.at is None:
                stats["send_bound_unjudged"] += 1
                continue
            stats["send_bound_checked"] += 1
            if any(asked - skew - 0.01 <= e.at <= bound + slack + skew
                   for asked, bound in under.bounds):
                continue
            if under.died:
                stats["send_bound_unjudged"] += 1
                continue
            stats["send_bound_violations"] += 1
            violations.append(f"send outside the send bound: {tag}: effect {e.reference} "
                              f"arrived at {_iso(e.at)}, {_why(e.at, under.bounds, slack)}")
    return violations, stats


def _why(at: float, bounds: Sequence[tuple[float, float]], slack: float) -> str:
    if not bounds:
        return ("and no holder of its key confirmed its lease before a downstream call "
                "(JobContext.confirm_lease): the handler sends without a send bound")
    before = [b for a, b in bounds if a <= at]
    if not before:
        return f"before any lease confirmation of its key (first asked at {_iso(bounds[0][0])})"
    late = at - max(before)
    return (f"{late:.2f}s after the bound of its holder's last confirmation (allowed "
            f"{slack:.2f}s): sent past the bound (a client that ignores send_by, or a stale "
            "holder)")


def _iso(at: float) -> str:
    return datetime.datetime.fromtimestamp(at).astimezone().isoformat(timespec="milliseconds")


def attempts_by_key(db: Any) -> dict[str, list[Any]]:
    """Every ``job_attempts`` row's key, outcome and send bounds, by key."""
    out: dict[str, list[Any]] = defaultdict(list)
    with db.statement() as conn:
        for row in conn.execute(text("SELECT idempotency_key, outcome, send_bounds"
                                     " FROM job_attempts WHERE idempotency_key IS NOT NULL")):
            out[str(row.idempotency_key)].append(row)
    return out


def check_send_bounds(requests: Sequence[Any], truth: GroundTruth, db: Any, *, lease: float,
                      skew: float) -> tuple[list[str], Counter[str]]:
    """:func:`judge_send_bounds` over every request (``.id``, ``.job_type``, ``.payload``) whose
    job type is counted by record, its arrivals read from the records and its senders from
    ``db``'s ``job_attempts``."""
    arrivals: dict[str, tuple[str, Sequence[Effect]]] = {}
    for req in requests:
        effects = truth.effects(req.job_type, req.payload)
        if not effects:
            continue
        jt = get_job_type(req.job_type)
        key = jt.keying.key_for(jt.validate(dict(req.payload)))
        arrivals[key] = (f"request {req.id} ({req.job_type}, key {key})", effects)
    rows = attempts_by_key(db)
    return judge_send_bounds(arrivals, {k: sent_under(rows.get(k, [])) for k in arrivals},
                             lease=lease, skew=skew)
