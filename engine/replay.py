"""Amended and bulk replay of dead letters: the logic behind ``sekali dlq replay --patch`` /
``--limit --pace`` and the ``dlq_operations`` job. Owner of ``request_versions``.

**Amended replay** (:func:`amend`). A replay runs the stored request again under its own key, so
it cannot fix a wrong payload. An amendment makes a *new version of the intent* instead: the
payload with a JSON merge patch applied (RFC 7396: ``null`` deletes a field), under a derived key
``<base key>#v<n>`` (``points:a1#v2``), enqueued as a new job request. Guarantees:

- The patched request passes the validation boundary (:func:`engine.validation.admit`, way in
  ``dlq_patch``) before anything changes: a refusal names the field, keeps one rejection row and
  changes nothing else. The version's key must fit the key limits too: a key within a few
  characters of ``key_length`` (or bytes of ``KEY_BYTES``) cannot be versioned (refused naming
  the limit; enqueue the corrected request under a new key).
- The original key's effect is never repeated: an amendment is refused while any key of the
  chain (the base key and every version) completed, holds a live claim, or reached a recovery
  point (a checkpoint: part of its effect may have gone out). The original key stays ``failed``
  in the ledger, its DLQ record is closed (``discarded``, audit action ``superseded``) and its
  request is marked superseded (never requeued), so nothing replays it.
- One new version per record, however many processes amend it at once: the link row is unique
  on the key it supersedes (and on ``base key, version``), and it, the new request, the record's
  close and the request's close commit in one transaction, each conditional (the record still
  ``open``, the request still ``failed``). A loser changes nothing and is told who won.
- The new key's fences continue above every fence the chain's keys had
  (:meth:`IdempotencyStore.continue_fences`): business rows fenced by the earlier keys (the
  fence column a job type keeps on its business row) accept the new version's writes.
- The link keeps who (``actor``: the OS user or ``--actor``), what (a JSON diff of the payload,
  ``[{"path", "from", "to"}]``), why (``reason``) and when.

A second amendment is made from the new version's own DLQ record, so ``#v3`` exists only after
``#v2`` failed for good; the superseded record refuses, naming its successor.

**Bulk replay** (:func:`bulk_replay`): the open records matching the filters (job type, class,
fingerprint, age), at most ``limit``, oldest id first; a dry run lists the decision per record
and changes nothing; otherwise each record is requested through
:meth:`resources.dlq.DlqStore.request_replay` (audited ``replay_requested``), a record skipped
gets an audit line ``replay_skipped`` with why, and ``pace`` (``10/s``, ``600/min``) spaces the
requests: the n-th is made no earlier than ``start + n / rate``. ``stop_after`` ends it once that
many were requested, leaving the rest undecided (the canary replay, :mod:`engine.canary`).

**Guarded replay.** Each selected record gets a :class:`Verdict` with its evidence
(:func:`assess`): ``completed`` (its key completed in the ledger: a replay returns the stored
result and repeats nothing), ``effect_found`` (the job type's declared lookup finds the effect at
the downstream), ``unknown`` (no lookup, no client, or the downstream cannot answer) or ``safe``
(no effect anywhere), or ``fails_again`` instead of ``safe`` when the replay is certain to fail
the same way (its last failure was permanent and a replay runs the same payload: a flag, not a
guard; the other verdicts carry the same flag). A real replay refuses ``effect_found`` and
``unknown`` records not named in ``allow_repeat`` (audited ``replay_skipped``); the others
still replay. ``sekali dlq replay`` always guards; a caller passing no ``allow_repeat`` gets the
verdicts without the guard. A record whose job type this process has not registered (its
module not named in ``SEKALI_JOB_MODULES`` here) is never replayed or offered from here, dry
run or not: nothing here can judge or run it (``BulkReplay.unregistered``; no audit line, as
nothing about the record was decided).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from sqlalchemy import BigInteger, Column, Float, Integer, Table, Text, bindparam, text

from engine.contract import Effect, crash_point
from engine.downstreams import ClientOptions
from engine.registry import JOB_TYPES, MODULES_ENV, downstreams
from engine.requests import RequestStatus, RequestStore
from engine.validation import admit
from resources.dlq import DlqRecord, DlqStatus, DlqStore, ReplayDecision
from resources.errors import IdempotencyConflict, SekaliError, ValidationError, shown
from resources.flow.limits import RateSetting
from resources.idempotency import IdempotencyStore
from resources.storage.db import metadata
from resources.storage.json_text import canonical, storable
from resources.storage.queries import load_queries
from resources.storage.settings import Settings

VERSION_MARK = "#v"
SOURCE = "dlq_patch"
"""The way in a refused patched payload is recorded under (``job_rejections.source``)."""

request_versions = Table(
    "request_versions",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("base_key", Text, nullable=False),
    Column("version", Integer, nullable=False),
    Column("key", Text, nullable=False, unique=True),
    Column("job_type", Text, nullable=False),
    Column("request_id", BigInteger),
    Column("previous_key", Text, nullable=False, unique=True),
    Column("previous_request_id", BigInteger),
    Column("previous_record_id", BigInteger),
    Column("actor", Text, nullable=False),
    Column("reason", Text),
    Column("diff", Text, nullable=False),
    Column("created_at", Float, nullable=False),
)

_Q = load_queries(Path(__file__).with_suffix(".sql"))


class AmendRefused(SekaliError):
    """The record cannot be amended now (its key completed or may have had its effect, it is
    not open, a newer version exists); the message says why and what to do."""

    permanent = True


# -- the patch ---------------------------------------------------------------------------------


def load_patch(value: str | dict[str, Any]) -> dict[str, Any]:
    """A patch from its JSON text, ``@file`` (that file's text) or a dict; it must be a JSON
    object. Bad text raises :class:`ValidationError` naming ``patch``."""
    if isinstance(value, dict):
        return value
    if value.startswith("@"):
        try:
            value = Path(value[1:]).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValidationError("patch", f"cannot read {value[1:]!r}: {exc.strerror}") from None
    try:
        patch = json.loads(value)
    except ValueError as exc:
        raise ValidationError("patch", f"not JSON: {exc}", value[:200]) from None
    if not isinstance(patch, dict) or not patch:
        raise ValidationError("patch", "a non-empty JSON object, e.g. {\"amount_cents\": 1300}")
    return patch


def merge_patch(payload: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """RFC 7396: objects merge key by key, ``null`` deletes, anything else replaces."""
    out = dict(payload)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_patch(out[key], value)
        else:
            out[key] = value
    return out


def payload_diff(before: Any, after: Any, path: str = "") -> list[dict[str, Any]]:
    """What changed, field by field (dotted paths; a field added or removed has ``None`` on its
    missing side)."""
    if isinstance(before, dict) and isinstance(after, dict):
        out: list[dict[str, Any]] = []
        for key in sorted(set(before) | set(after), key=str):
            sub = f"{path}.{key}" if path else str(key)
            out += payload_diff(before.get(key), after.get(key), sub)
        return out
    if canonical(before) == canonical(after):
        return []
    return [{"path": path, "from": before, "to": after}]


# -- versions ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Version:
    """One link of a chain: ``key`` (version ``version`` of ``base_key``) superseded
    ``previous_key``."""

    base_key: str
    version: int
    key: str
    job_type: str
    request_id: int | None
    previous_key: str
    previous_request_id: int | None
    previous_record_id: int | None
    actor: str
    reason: str | None
    diff: list[dict[str, Any]]
    created_at: float

    @classmethod
    def from_row(cls, row: Any) -> Version:
        m = row._mapping
        return cls(
            base_key=m["base_key"],
            version=int(m["version"]),
            key=m["key"],
            job_type=m["job_type"],
            request_id=None if m["request_id"] is None else int(m["request_id"]),
            previous_key=m["previous_key"],
            previous_request_id=(
                None if m["previous_request_id"] is None else int(m["previous_request_id"])
            ),
            previous_record_id=(
                None if m["previous_record_id"] is None else int(m["previous_record_id"])
            ),
            actor=m["actor"],
            reason=m["reason"],
            diff=json.loads(m["diff"]),
            created_at=float(m["created_at"]),
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "base_key": self.base_key,
            "version": self.version,
            "key": self.key,
            "request_id": self.request_id,
            "previous_key": self.previous_key,
            "previous_request_id": self.previous_request_id,
            "previous_record_id": self.previous_record_id,
            "actor": self.actor,
            "reason": self.reason,
            "diff": self.diff,
            "created_at": self.created_at,
        }


class Versions:
    """Reads of ``request_versions`` (the writes are :func:`amend`'s)."""

    def __init__(self, db: Any) -> None:
        self.db = db

    def of_key(self, key: str) -> Version | None:
        """The link that made ``key`` (None for a base key)."""
        return self._one("version_of_key", key)

    def successor(self, key: str) -> Version | None:
        """The link that superseded ``key``, if any."""
        return self._one("version_after_key", key)

    def chain(self, key: str) -> list[Version]:
        """Every version of the intent ``key`` belongs to, oldest first."""
        made = self.of_key(key)
        base = made.base_key if made else key
        with self.db.statement() as conn:
            rows = conn.execute(text(_Q["chain"]), {"b": base}).all()
        return [Version.from_row(r) for r in rows]

    def of_records(self, record_ids: Sequence[int]) -> list[Version]:
        """The versions made from these DLQ records."""
        if not record_ids:
            return []
        with self.db.statement() as conn:
            rows = conn.execute(
                text(_Q["versions_of_records"]).bindparams(bindparam("ids", expanding=True)),
                {"ids": [int(i) for i in record_ids]},
            ).all()
        return [Version.from_row(r) for r in rows]

    def _one(self, query: str, key: str) -> Version | None:
        with self.db.statement() as conn:
            row = conn.execute(text(_Q[query]), {"k": key}).first()
        return None if row is None else Version.from_row(row)


# -- amending ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Amendment:
    """What :func:`amend` did (or, in a dry run, would do)."""

    record_id: int
    job_type: str
    previous_key: str
    key: str
    version: int
    payload: dict[str, Any]
    diff: list[dict[str, Any]]
    request_id: int | None = None
    dry_run: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "record_id": self.record_id,
            "job_type": self.job_type,
            "previous_key": self.previous_key,
            "key": self.key,
            "version": self.version,
            "request_id": self.request_id,
            "diff": self.diff,
            "dry_run": self.dry_run,
        }


def amended_outcomes(db: Any, records: Sequence[DlqRecord]) -> dict[int, str]:
    """For each record an amendment closed (status ``discarded``, a version made from it):
    ``superseded by KEY: STATE``, where KEY is the newest version of its intent and STATE what
    happened to that version's request (:meth:`engine.requests.RequestStore.states`), so a
    record whose amended version completed does not read as merely discarded."""
    closed = [r.id for r in records if r.status is DlqStatus.DISCARDED]
    versions = Versions(db)
    made = versions.of_records(closed)
    if not made:
        return {}
    rows_of = RequestStore(db)
    newest = {v.previous_record_id: versions.chain(v.key)[-1] for v in made}
    rows = {r.id: r for r in rows_of.get_many(
        sorted({n.request_id for n in newest.values() if n.request_id is not None}))}
    states = rows_of.states(list(rows.values()))
    out: dict[int, str] = {}
    for record_id, version in newest.items():
        if record_id is None:
            continue
        row = rows.get(version.request_id) if version.request_id is not None else None
        state = states.get(row.id, "unknown") if row is not None else "no request"
        out[record_id] = f"superseded by {version.key}: {state}"
    return out


def _stored_payload(record: DlqRecord, requests: RequestStore) -> dict[str, Any]:
    """The payload the record's request ran with: the request row's, else the run config's,
    else the record's own."""
    if record.request_id is not None:
        request = requests.get(record.request_id)  # nosec B113: the request store, not HTTP
        if request is not None:
            return dict(request.payload)
    for op_config in (record.run_config.get("ops") or {}).values():
        payload = ((op_config or {}).get("config") or {}).get("payload")
        if isinstance(payload, str):
            try:
                payload = json.loads(payload)
            except ValueError:
                payload = None
        if isinstance(payload, dict):
            return payload
    if isinstance(record.payload, dict):
        return dict(record.payload)
    raise AmendRefused(
        f"DLQ record {record.id} holds no payload to amend; enqueue the request again instead"
    )


def _check_chain(record: DlqRecord, key: str, versions: Versions, ledger: IdempotencyStore,
                 now: float) -> list[str]:
    """Refuse while any key of the intent completed, runs, or may have had its effect;
    returns the chain's keys."""
    chain = versions.chain(key)
    keys = [chain[0].previous_key] if chain else [key]
    keys += [v.key for v in chain]
    for name, found in ledger.records(keys).items():
        if found.status == "completed":
            raise AmendRefused(
                f"DLQ record {record.id}: key {name} completed; its effect happened, and a new"
                " version would repeat it. Nothing to amend (discard the record if it is stale)"
            )
        if found.status == "in_progress" and (found.lease_expires_at or 0) > now:
            raise AmendRefused(
                f"DLQ record {record.id}: key {name} is running now; amend after it ends"
            )
        if found.recovery_point:
            raise AmendRefused(
                f"DLQ record {record.id}: key {name} reached {found.recovery_point!r}, so part"
                " of its effect may have happened; a new version could repeat it. Resolve it"
                " under its own key (sekali dlq replay ID) or discard it"
            )
    return keys


def amend(
    store: DlqStore,
    record_id: int,
    patch: str | dict[str, Any],
    *,
    actor: str,
    reason: str = "",
    dry_run: bool = False,
) -> Amendment:
    """Make the next version of ``record_id``'s request with ``patch`` applied (module
    docstring). Raises :class:`ValidationError` (bad patch or patched payload: nothing changed
    but the rejection row) or :class:`AmendRefused` (the state forbids it; nothing changed)."""
    patch_obj = load_patch(patch)
    db = store.db
    requests = RequestStore(db, clock=store.clock)
    versions = Versions(db)
    record = store.get(record_id)
    if record.status is not DlqStatus.OPEN:
        after = versions.successor(record.idempotency_key or "")
        raise AmendRefused(
            f"DLQ record {record_id} is {record.status}"
            + (
                f": superseded by {after.key} (version {after.version}); amend that version's"
                " own record once it fails"
                if after
                else "; only an open record can be amended"
            )
        )
    if record.job_type not in JOB_TYPES:
        raise AmendRefused(f"DLQ record {record_id}: {unregistered(record)}")
    request = requests.get(record.request_id) if record.request_id is not None else None  # nosec B113: the request store, not HTTP
    key = record.idempotency_key or (request.key if request else None)
    if not key:
        raise AmendRefused(f"DLQ record {record_id} names no idempotency key to version")
    if request is not None and request.status is not RequestStatus.FAILED:
        raise AmendRefused(
            f"DLQ record {record_id}: its request {request.id} is {request.status}, not failed;"
            " amend once it has failed"
        )
    before = _stored_payload(record, requests)
    after_payload = merge_patch(before, patch_obj)
    diff = payload_diff(before, after_payload)
    if not diff:
        raise ValidationError("patch", "changes nothing in the stored payload", patch_obj)
    made = versions.of_key(key)
    base, version = (made.base_key, made.version + 1) if made else (key, 2)
    new_key = f"{base}{VERSION_MARK}{version}"
    # A record kept before records named their run's chain: the run id is the id its op used.
    correlation_id = (
        (request.correlation_id if request else None) or record.correlation_id or record.run_id
    )
    ledger = IdempotencyStore(db)
    chain_keys = _check_chain(record, key, versions, ledger, store.clock())  # the why first
    admitted = admit(
        requests,
        record.job_type,
        after_payload,
        new_key,
        source=SOURCE,
        correlation_id=correlation_id,
    )
    crash_point("amend_checked")  # test hook: every check passed, nothing written yet
    plan = Amendment(
        record_id=record_id,
        job_type=record.job_type,
        previous_key=key,
        key=admitted.key,
        version=version,
        payload=admitted.payload,
        diff=diff,
        dry_run=dry_run,
    )
    if dry_run:
        return plan
    now = store.clock()
    with db.transaction() as conn:
        linked = conn.execute(
            text(_Q["link_version"]),
            {
                "base": base,
                "version": version,
                "key": admitted.key,
                "jt": record.job_type,
                "prev": key,
                "preq": record.request_id,
                "prec": record_id,
                "actor": storable(actor, 256),
                "reason": storable(reason, 2000) if reason else None,
                "diff": json.dumps(diff, ensure_ascii=True, default=str),
                "now": now,
            },
        ).rowcount
        if not linked:
            raise AmendRefused(_lost_race(record_id, key, versions_in=conn))
        try:
            enqueued = requests.enqueue(
                record.job_type,
                admitted.key,
                admitted.payload,
                queue=admitted.job_type.queue,
                correlation_id=correlation_id,
                conn=conn,
                amends=key,
                tenant=admitted.tenant,
            )
        except IdempotencyConflict as exc:
            raise AmendRefused(
                f"DLQ record {record_id}: a request under {admitted.key} exists already with"
                " another payload (enqueued by hand?); discard one of them first"
            ) from exc
        # the version writes the rows the earlier keys fenced: its fences continue above theirs
        ledger.continue_fences(
            admitted.key,
            admitted.job_type.validate(dict(admitted.payload)),
            chain_keys,
            conn=conn,
        )
        conn.execute(
            text(_Q["set_version_request"]),
            {"rid": enqueued.id, "key": admitted.key},
        )
        changes = "; ".join(
            f"{d['path']}: {json.dumps(d['from'], default=str)} -> "
            f"{json.dumps(d['to'], default=str)}"
            for d in diff
        )
        detail = f"by {admitted.key} (request {enqueued.id}, version {version}): {changes}"
        if reason:
            detail += f"; {reason}"
        if not store.supersede(record_id, actor=actor, detail=detail, conn=conn):
            raise AmendRefused(f"DLQ record {record_id} changed meanwhile; look again")
        if request is not None and not requests.supersede(request.id, admitted.key, conn=conn):
            raise AmendRefused(
                f"DLQ record {record_id}: its request {request.id} changed meanwhile; look again"
            )
    return Amendment(**{**plan.__dict__, "request_id": enqueued.id})


def _lost_race(record_id: int, key: str, *, versions_in: Any) -> str:
    row = versions_in.execute(
        text(_Q["superseding_version"]), {"k": key}
    ).first()
    if row is not None:
        return (
            f"DLQ record {record_id} was already amended: {key} is superseded by {row.key}"
            f" (version {row.version})"
        )
    return f"DLQ record {record_id}: that version already exists; look again"


# -- bulk replay -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Selection:
    """Which records a bulk replay takes (every filter given must match)."""

    job_type: str | None = None
    error_class: str | None = None
    fingerprint: str | None = None
    older_than: float | None = None
    newer_than: float | None = None
    ids: Sequence[int] | None = None
    limit: int | None = None

    def any_filter(self) -> bool:
        return bool(self.ids) or any(
            v is not None
            for v in (
                self.job_type, self.error_class, self.fingerprint, self.older_than,
                self.newer_than,
            )
        )

    def records(self, store: DlqStore, status: Sequence[str] | None) -> list[DlqRecord]:
        """The records in ``status`` (None: any) that every filter given matches, at most
        ``limit``: the one reading of a selection for ``sekali dlq``, the bulk replay and the
        ``dlq_operations`` job."""
        return store.list_records(
            status=status,
            job_type=self.job_type,
            error_class=self.error_class,
            fingerprint=self.fingerprint,
            older_than=self.older_than,
            newer_than=self.newer_than,
            ids=self.ids or None,
            limit=self.limit,
        )


class Verdict(StrEnum):
    """Whether replaying a record would repeat its side effect (module docstring)."""

    COMPLETED = "completed"
    EFFECT_FOUND = "effect_found"
    UNKNOWN = "unknown"
    SAFE = "safe"
    FAILS_AGAIN = "fails_again"
    """No effect to repeat, and certain to fail again the same way: its last failure was
    permanent and a replay runs the same payload (fix the cause, or amend the payload)."""


GUARDED = frozenset({Verdict.EFFECT_FOUND, Verdict.UNKNOWN})
"""Verdicts a real replay refuses unless the record is named in ``allow_repeat``."""


@dataclass(frozen=True)
class Assessment:
    """A record's :class:`Verdict` and the evidence it rests on."""

    record_id: int
    verdict: Verdict
    evidence: str
    effects: tuple[Effect, ...] = ()
    fails_again: bool = False
    """The replay would fail again the same way (:func:`fails_again`), whatever the verdict
    on its effect says."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "verdict": str(self.verdict),
            "evidence": self.evidence,
            "effects": [e.reference for e in self.effects],
            "fails_again": self.fails_again,
        }


def lookup_client(settings: Settings | None = None, *, on_worker: bool = True
                  ) -> Callable[[str], Any]:
    """``client(name)`` for the declared downstreams, each built on first use from
    ``settings`` (``Settings.from_env()`` by default) with its declared timeouts. Lookups only
    read, so they take no token of the downstream's send rate. ``on_worker`` False (the
    operator's CLI): a downstream whose destinations come from payloads is refused
    (``LookupError``, so the verdict is ``unknown``): its lookups run on workers only."""
    built: dict[str, Any] = {}

    def client(name: str) -> Any:
        if name not in built:
            known = downstreams()
            if name not in known:
                raise LookupError(f"no downstream {name!r} is declared")
            if not on_worker and known[name].destinations_from_payloads:
                raise LookupError(
                    f"{name} calls addresses that payloads name: its lookups run on workers "
                    "only (the dlq_operations job), never from this command")
            built[name] = known[name].build(settings or Settings.from_env(), ClientOptions())
        return built[name]

    return client


def fails_again(record: DlqRecord) -> str | None:
    """Why replaying ``record`` as it stands is certain to fail the same way, or None: its
    last failure was permanent (a refusal no retry can change: bad input, a business rule)
    and a replay runs the very payload that failed. An amended replay (a new payload) or a
    fix of the cause is what helps."""
    if record.error_class != "permanent":
        return None
    error = " ".join((record.last_error or "").split())
    if record.error_type and not error.startswith(record.error_type):
        error = f"{record.error_type}: {error}" if error else record.error_type
    error = error if len(error) <= 160 else error[:157] + "..."
    return (f"it fails again: its last failure was permanent ({error}) and a replay runs the"
            " same payload; fix the cause first, or amend the payload (--patch)")


def assess(
    record: DlqRecord,
    *,
    ledger: IdempotencyStore,
    requests: RequestStore,
    client: Callable[[str], Any] | None,
) -> Assessment:
    """The verdict for replaying ``record``: the ledger first (a completed key repeats
    nothing), then the job type's declared lookup at its downstream. Whatever cannot be asked
    or does not answer is ``unknown``, never ``safe``; a replay certain to fail again
    (:func:`fails_again`) is never ``safe`` either (``fails_again``), and any other verdict
    says so too."""
    again = fails_again(record)

    def verdict(v: Verdict, evidence: str, effects: Sequence[Effect] = ()) -> Assessment:
        if again is None:
            return Assessment(record.id, v, evidence, tuple(effects))
        if v is Verdict.SAFE:
            return Assessment(record.id, Verdict.FAILS_AGAIN, f"{evidence}; but {again}",
                              tuple(effects), True)
        return Assessment(record.id, v, f"{evidence}; and {again}", tuple(effects), True)

    key = record.idempotency_key
    found = ledger.records([key]).get(key) if key else None
    if found is not None and found.status == "completed":
        return Assessment(
            record.id, Verdict.COMPLETED,
            f"key {key} completed in the ledger: a replay returns its stored result and"
            " repeats nothing",
        )
    jt = JOB_TYPES.get(record.job_type)
    if jt is None:
        return verdict(Verdict.UNKNOWN, unregistered(record))
    if not (jt.side_effect and jt.calls.clients):
        return verdict(
            Verdict.SAFE,
            f"{jt.name} has no downstream effect; its change commits with its key, which did"
            " not complete",
        )
    if jt.calls.lookup is None:
        return verdict(Verdict.UNKNOWN, f"{jt.name} declares no lookup at {jt.calls.budget}")
    if not key:
        return verdict(Verdict.UNKNOWN, "the record names no idempotency key to look up")
    if client is None:
        return verdict(Verdict.UNKNOWN, f"no {jt.calls.budget} client to ask")
    payload: Any
    try:
        payload = jt.validate(_stored_payload(record, requests))
    except (SekaliError, ValueError):
        payload = None  # still-bad input: the lookup asks by key
    try:
        effects = jt.effects(client, key, payload)
    except Exception as exc:  # noqa: BLE001 - any failure to answer concludes nothing
        return verdict(Verdict.UNKNOWN, f"{jt.calls.budget} cannot answer: {exc}")
    if effects:
        refs = ", ".join(e.reference for e in effects)
        return verdict(
            Verdict.EFFECT_FOUND, f"{jt.calls.budget} holds {len(effects)} effect(s) for {key}:"
            f" {refs}", effects,
        )
    return verdict(Verdict.SAFE, f"{jt.calls.budget} holds no effect for {key}")


def unregistered(record: DlqRecord) -> str:
    """Why this process cannot replay ``record``: its job type is not registered here."""
    return (f"job type {record.job_type!r} is not registered in this process: name its module"
            f" in {MODULES_ENV} here as the code location does (this process: "
            f"{os.environ.get(MODULES_ENV, '').strip() or 'not set'})")


@dataclass
class BulkReplay:
    """The decision and verdict per selected record, in order; ``refused``: the ids a guard
    kept from replaying (verdict not allowed)."""

    decisions: list[ReplayDecision] = field(default_factory=list)
    dry_run: bool = False
    assessments: dict[int, Assessment] = field(default_factory=dict)
    refused: list[int] = field(default_factory=list)
    unregistered: list[int] = field(default_factory=list)
    """The ids whose job type this process does not know: never replayed from here."""
    rest: list[DlqRecord] = field(default_factory=list)
    """The selected records left undecided once ``stop_after`` replays were requested."""

    @property
    def chosen(self) -> int:
        return sum(d.replay for d in self.decisions)

    @property
    def fails_again(self) -> list[int]:
        """The ids (replayed or not) whose replay would fail again the same way."""
        return [d.record.id for d in self.decisions
                if d.record.id in self.assessments and self.assessments[d.record.id].fails_again]

    def refused_line(self, then: str) -> str:
        """What a surface says of the refused records; ``then``: how to replay them anyway
        there (a flag, a config field)."""
        return (f"refused {self.refused}: replaying may repeat their effect; check the evidence,"
                f" then {then}")


def refuses(judged: Assessment, allow_repeat: Collection[int] | None) -> bool:
    """Whether the guard keeps an open record from replaying: its verdict is guarded and
    ``allow_repeat`` (None: no guard) does not name it."""
    return (allow_repeat is not None and judged.verdict in GUARDED
            and judged.record_id not in allow_repeat)


def parse_pace(value: str | None) -> float | None:
    """``10/s``, ``600/min``, ``5`` -> requests per second; bad text names ``pace``."""
    if value is None or value == "":
        return None
    try:
        if "," not in value:
            return RateSetting.parse(value, name="pace").rate
    except ValidationError:
        pass
    raise ValidationError("pace", f"expected a rate like 10/s, 600/min or 5, got {shown(value)}",
                          value)


def bulk_replay(
    store: DlqStore,
    selection: Selection,
    *,
    actor: str,
    reason: str = "",
    dry_run: bool = False,
    pace: float | None = None,
    client: Callable[[str], Any] | None = None,
    allow_repeat: Collection[int] | None = None,
    stop_after: int | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> BulkReplay:
    """Request replays of the selected records (module docstring). Named ids are taken
    whatever their status (the decision says why one is skipped); filters take open records
    only. ``pace``: requests per second at most. ``client(name)``: the downstream clients the
    job types' lookups ask (None: every record with a downstream effect is ``unknown``);
    ``allow_repeat``: guard the replay, letting only these ids (of the ``effect_found`` and
    ``unknown`` records) replay; None replays without the guard (the verdicts are still
    reported). ``stop_after``: return once that many replays were requested, the records not
    yet reached in ``rest`` (a dry run decides every record)."""
    if not selection.any_filter():
        raise ValidationError("ids", "name record ids or give a filter (job type, class, ...)")
    if selection.limit is not None and selection.limit < 1:
        raise ValidationError("limit", "at least 1", selection.limit)
    if pace is not None and pace <= 0:
        raise ValidationError("pace", "more than 0 a second", pace)
    records = selection.records(store, None if selection.ids else [str(DlqStatus.OPEN)])
    stray = sorted(set(allow_repeat or ()) - {r.id for r in records})
    if stray:
        raise ValidationError("allow_repeat", f"names records not selected: {stray}", stray)
    out = BulkReplay(dry_run=dry_run)
    ledger = IdempotencyStore(store.db)
    requests = RequestStore(store.db, clock=store.clock)
    start = clock()
    made = 0
    for n, record in enumerate(records):
        if not dry_run and stop_after is not None and out.chosen >= stop_after:
            out.rest = records[n:]
            break
        judged = assess(record, ledger=ledger, requests=requests, client=client)
        out.assessments[record.id] = judged
        if record.job_type not in JOB_TYPES:  # nothing here can run or judge it: not offered
            out.decisions.append(ReplayDecision(record, False, unregistered(record)))
            out.unregistered.append(record.id)
            continue
        if dry_run:
            out.decisions += store.request_replay([record.id], actor=actor, dry_run=True)
            continue
        if record.status is DlqStatus.OPEN and refuses(judged, allow_repeat):
            why = (f"{judged.verdict}: {judged.evidence}; replaying may repeat the effect"
                   " (name it in allow_repeat to replay anyway)")
            store.note(record.id, "replay_skipped", actor=actor, detail=why)
            out.decisions.append(ReplayDecision(record, False, why))
            out.refused.append(record.id)
            continue
        if pace is not None and record.status is DlqStatus.OPEN:
            wait = start + made / pace - clock()
            if wait > 0:
                sleep(wait)
            made += 1
        decision = store.request_replay(
            [record.id], actor=actor, reason=reason, idempotency=ledger
        )[0]
        if not decision.replay:
            store.note(record.id, "replay_skipped", actor=actor, detail=decision.reason)
        out.decisions.append(decision)
    return out
