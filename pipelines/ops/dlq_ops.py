"""``dlq_operations``: list, replay and discard dead letters from the Dagster UI (launchpad).

The config is validated twice: by Dagster (the action, the error class, the job type and the
statuses are enums, ids are integers) and by the op (a replay or discard needs ids or a filter;
a discard needs a reason; ages parse), which fails permanently with the field named.
``dry_run`` defaults to true, so a launch with the defaults only says what would happen: the
output's ``records`` table has a ``decision`` per record (``would replay``, ``would discard``,
or why not). A replay requested here is launched by ``dlq_replay_sensor`` at its rate bound,
exactly as one requested from ``sekali dlq replay``; ``limit`` and ``pace`` bound a replay by
filter, and a skipped record gets an audit line. ``patch`` (with one id) is the amended replay of
:mod:`engine.replay`. The output's ``versions`` table shows the versions made from the
selected records (and a dry run's plan), ``audit`` their audit trail. ``canary: N`` (with
``canary_timeout``, 600 s) replays N records first and waits in the op for their end
(:mod:`engine.canary`): the rest are requested only when every canary resolved; otherwise they
stay open and the run fails, its failure metadata holding each record's outcome.
"""

import enum
import json
import time
from typing import Any

import dagster as dg
import pydantic

from engine import canary as canaries
from engine import tags as tag
from engine.registry import JOB_TYPES
from engine.replay import (
    Amendment,
    AmendRefused,
    BulkReplay,
    Selection,
    Versions,
    amend,
    bulk_replay,
    load_patch,
    lookup_client,
    parse_pace,
)
from pipelines.ops.batch import BATCH_JOBS
from pipelines.ops.failures import refused_input
from resources.dagster_resources import DlqResource, PlainDocs
from resources.dlq import DlqRecord, DlqRecordNotFound, DlqStatus, DlqStore, parse_age
from resources.errors import ValidationError
from resources.telemetry.redact import redact_data


class DlqAction(enum.Enum):
    """Dagster config shows enum member names, so they are the lower-case words users type."""

    list = "list"  # noqa: A003
    replay = "replay"
    discard = "discard"


class DlqClassChoice(enum.Enum):
    permanent = "permanent"
    transient = "transient"
    data_bug = "data_bug"
    unknown = "unknown"


DlqJobTypeChoice = enum.Enum(  # type: ignore[misc]
    "DlqJobTypeChoice", {name: name for name in [*JOB_TYPES, *(j.name for j in BATCH_JOBS)]}
)
"""The job types a record can name: every per-request job and the two intake batch jobs."""

DlqStatusChoice = enum.Enum(  # type: ignore[misc]
    "DlqStatusChoice", {str(s): str(s) for s in DlqStatus}
)


UNRESOLVED: Any = ["open", "replay_requested", "replaying"]  # Dagster wants the enum names


class DlqOperationConfig(PlainDocs, dg.Config):
    """What to do with which records. Filters combine with AND; ``ids`` select records directly."""

    action: DlqAction = pydantic.Field(
        default=DlqAction.list, description="list, replay or discard the selected records."
    )
    ids: list[int] = pydantic.Field(default=[], description="Record ids (sekali dlq list).")
    job_type: DlqJobTypeChoice | None = pydantic.Field(
        default=None, description="Only records of this job type."
    )
    error_class: DlqClassChoice | None = pydantic.Field(
        default=None, description="Only records of this failure class."
    )
    fingerprint: str | None = pydantic.Field(
        default=None, description="Only records with this fingerprint (one cause)."
    )
    older_than: str | None = pydantic.Field(
        default=None, description="Only records whose last failure is older, e.g. 90s, 15m, 2h."
    )
    newer_than: str | None = pydantic.Field(
        default=None, description="Only records whose last failure is newer, e.g. 1d."
    )
    status: list[DlqStatusChoice] = pydantic.Field(
        default=UNRESOLVED,
        description="Only records in these statuses (a replay by filter takes open ones).",
    )
    dry_run: bool = pydantic.Field(
        default=True, description="Only say what would happen (the default). Set false to act."
    )
    reason: str = pydantic.Field(
        default="", description="Why (kept in the audit); a discard needs one."
    )
    actor: str = pydantic.Field(default="dagster-ui", description="Who acts (kept in the audit).")
    patch: str | None = pydantic.Field(
        default=None,
        description="Amended replay of one record (ids=[ID]): a JSON merge patch of its payload,"
        ' e.g. {"amount_cents": 1300}. Makes a new version (key#vN), closes the record as'
        " superseded; refused when the key's effect may have happened.",
    )
    limit: int | None = pydantic.Field(
        default=None, description="Replay at most this many records (oldest first)."
    )
    pace: str | None = pydantic.Field(
        default=None, description="Replay requests at most at this rate, e.g. 10/s or 600/min."
    )
    allow_repeat: list[int] = pydantic.Field(
        default=[],
        description="Replay these records even though their effect was found at the downstream"
        " or cannot be ruled out (verdict effect_found / unknown); others with such a verdict"
        " are refused.",
    )
    canary: int | None = pydantic.Field(
        default=None,
        description="Replay this many records first and wait for their end; the rest are"
        " replayed only if every canary resolved (else they stay open and the run fails).",
    )
    canary_timeout: float = pydantic.Field(
        default=canaries.DEFAULT_TIMEOUT,
        description="With canary: seconds the canaries may take to end; one that has not ended"
        " by then stops the rest too.",
    )

    def check(self) -> None:
        """Raise :class:`ValidationError` naming the field when the request cannot be right."""
        for name in ("older_than", "newer_than"):
            try:
                parse_age(getattr(self, name))
            except ValueError as exc:
                raise ValidationError(name, str(exc), getattr(self, name)) from exc
        has_filter = any(
            (self.job_type, self.error_class, self.fingerprint, self.older_than, self.newer_than)
        )
        if self.action is not DlqAction.list and not (self.ids or has_filter):
            raise ValidationError("ids", f"{self.action.value} needs record ids or a filter")
        if self.action is DlqAction.discard and not self.reason.strip():
            raise ValidationError("reason", "a discard needs a reason")
        if self.patch is not None:
            if self.action is not DlqAction.replay or len(self.ids) != 1:
                raise ValidationError("patch", "an amended replay takes action replay and one id")
            load_patch(self.patch)
        if self.limit is not None and self.limit < 1:
            raise ValidationError("limit", "at least 1", self.limit)
        parse_pace(self.pace)
        if self.canary is not None:
            if self.action is not DlqAction.replay or self.patch is not None:
                raise ValidationError("canary", "a canary takes action replay and no patch")
            canaries.check(self.canary, self.canary_timeout)


_TABLE = dg.TableSchema(
    columns=[
        dg.TableColumn(name, kind, description=about)
        for name, kind, about in (
            ("id", "int", None), ("status", "string", None), ("job_type", "string", None),
            ("class", "string", None), ("fingerprint", "string", "one cause"),
            ("failures", "int", None), ("last_failed", "string", "ISO-8601, UTC"),
            ("key", "string", None), ("error", "string", None),
            ("decision", "string", "what this launch did or would do"),
        )
    ]
)


def records_table(records: list[DlqRecord], decision: dict[int, str]) -> dg.MetadataValue:
    """The selected records (at most 200) with what happens to each."""
    rows = [
        dg.TableRecord(
            {
                "id": r.id,
                "status": str(r.status),
                "job_type": r.job_type,
                "class": r.error_class,
                "fingerprint": r.fingerprint,
                "failures": r.failure_count,
                "last_failed": _iso(r.last_failed_at),
                "key": r.idempotency_key or "",
                "error": " ".join((r.last_error or "").split())[:120],
                "decision": decision.get(r.id, "listed"),
            }
        )
        for r in records[:200]
    ]
    return dg.MetadataValue.table(rows, _TABLE)


_VERSIONS = dg.TableSchema(
    columns=[
        dg.TableColumn(name, "string" if name not in ("version", "request", "record") else "int",
                       description=about)
        for name, about in (
            ("record", "the DLQ record the version was made from"),
            ("previous_key", "the key it supersedes"), ("key", None), ("version", None),
            ("request", "the new version's job request"), ("actor", None),
            ("diff", "what changed in the payload"), ("at", "ISO-8601, UTC"),
        )
    ]
)
_AUDIT = dg.TableSchema(
    columns=[
        dg.TableColumn(name, "int" if name == "record" else "string")
        for name in ("record", "at", "actor", "action", "from", "to", "detail")
    ]
)


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _history(
    store: DlqStore, ids: list[int], amended: Amendment | None
) -> dict[str, dg.MetadataValue]:
    """The versions made from the selected records (or the one planned) and their audit trail
    (the last 20 lines each, at most 200)."""
    versions = Versions(store.db).of_records(ids)
    rows = [
        dg.TableRecord(
            {
                "record": v.previous_record_id or 0, "previous_key": v.previous_key,
                "key": v.key, "version": v.version, "request": v.request_id or 0,
                "actor": v.actor, "diff": json.dumps(v.diff, default=str)[:300],
                "at": _iso(v.created_at),
            }
        )
        for v in versions
    ]
    if amended is not None and amended.dry_run:
        rows.append(
            dg.TableRecord(
                {
                    "record": amended.record_id, "previous_key": amended.previous_key,
                    "key": f"{amended.key} (dry run)", "version": amended.version, "request": 0,
                    "actor": "", "diff": json.dumps(amended.diff, default=str)[:300], "at": "",
                }
            )
        )
    audit = [
        dg.TableRecord(
            {
                "record": record_id, "at": _iso(a["at"]), "actor": a["actor"],
                "action": a["action"], "from": a["from_status"] or "",
                "to": a["to_status"] or "", "detail": " ".join((a["detail"] or "").split())[:200],
            }
        )
        for record_id in ids[:50]
        for a in redact_data(store.audit(record_id))[-20:]
    ][:200]
    return {
        "versions": dg.MetadataValue.table(rows, _VERSIONS),
        "audit": dg.MetadataValue.table(audit, _AUDIT),
    }


@dg.op(required_resource_keys={"dlq"}, tags={tag.QUEUE: "light"})
def dlq_operation(context: dg.OpExecutionContext, config: DlqOperationConfig) -> dict[str, Any]:
    try:
        config.check()
    except ValidationError as exc:
        raise refused_input(exc) from exc
    dlq: DlqResource = context.resources.dlq
    store = dlq.get_store()
    action = config.action.value
    selection = Selection(
        job_type=config.job_type.value if config.job_type else None,
        error_class=config.error_class.value if config.error_class else None,
        fingerprint=config.fingerprint,
        older_than=parse_age(config.older_than),
        newer_than=parse_age(config.newer_than),
        ids=config.ids or None,
        limit=config.limit if action == "replay" else None,
    )
    records = selection.records(
        store,
        ["open"] if action == "replay" and not config.ids
        else [DlqStatusChoice(s).value for s in config.status],
    )
    ids = [r.id for r in records]
    changed: list[int] = []
    decision: dict[int, str] = {}
    amended: Amendment | None = None
    refused: list[int] = []
    if action == "replay" and config.patch is not None:
        try:
            amended = amend(
                store, ids[0] if ids else config.ids[0], config.patch, actor=config.actor,
                reason=config.reason, dry_run=config.dry_run,
            )
        except (ValidationError, AmendRefused, DlqRecordNotFound) as exc:
            raise dg.Failure(
                description=str(exc),
                allow_retries=False,
                metadata={"field": getattr(exc, "field", "ids")},
            ) from exc
        changed = [amended.record_id]
        decision = {
            amended.record_id: f"{'would make' if config.dry_run else 'superseded by'}"
            f" {amended.key}"
        }
    elif action == "replay" and config.canary is not None:
        return _canary_replay(context, config, store, records)
    elif action == "replay":
        try:
            replayed = bulk_replay(store, Selection(ids=ids or [-1]), **_replay_options(config))
        except ValidationError as exc:
            raise refused_input(exc) from exc
        decisions = replayed.decisions
        refused = replayed.refused
        changed = [d.record.id for d in decisions if d.replay]
        decision = {
            d.record.id: (
                ("would replay" if config.dry_run else "replay requested") if d.replay
                else f"not replayed: {d.reason}"
            ) + _verdict(replayed, d.record.id)
            for d in decisions
        }
    elif action == "discard" and not config.dry_run:
        discarded = store.discard(ids, actor=config.actor, reason=config.reason)
        changed = [d.record.id for d in discarded if d.replay]
        decision = {
            d.record.id: "discarded" if d.replay else f"not discarded: {d.reason}"
            for d in discarded
        }
    elif action == "discard":
        changed = [r.id for r in records if r.status in ("open", "replay_requested")]
        decision = {
            r.id: "would discard" if r.id in changed else f"not discarded: status is {r.status}"
            for r in records
        }
    verb = {"list": "listed", "replay": "replay requested", "discard": "discarded"}[action]
    if config.dry_run and action != "list":
        verb = "would be discarded" if action == "discard" else "would replay"
    context.add_output_metadata(
        {
            "selected": len(records),
            "changed": 0 if config.dry_run else len(changed),
            "action": f"{action}{' (dry run)' if config.dry_run else ''}",
            "records": records_table(records, decision),
            **_history(store, ids, amended),
        }
    )
    if refused:
        context.log.warning(replayed.refused_line(f"run again with allow_repeat: {refused}"))
    if action == "list":  # a listing changes nothing: say what it showed
        context.log.info(f"listed {len(records)} selected records")
    else:
        context.log.info(f"{len(changed)} of {len(records)} selected records: {verb}")
    return {"selected": ids, "changed": changed, "dry_run": config.dry_run, "refused": refused}


def _verdict(replay: BulkReplay, record_id: int) -> str:
    """`` [verdict: evidence]`` of a record the replay judged, else nothing."""
    judged = replay.assessments.get(record_id)
    return f" [{judged.verdict}: {judged.evidence}]" if judged is not None else ""


def _replay_options(config: DlqOperationConfig) -> dict[str, Any]:
    """What a replay of the selection takes from the job's config, canaries or not (a bad
    ``pace`` raises :class:`ValidationError` naming it)."""
    return {"actor": config.actor, "reason": config.reason, "dry_run": config.dry_run,
            "pace": parse_pace(config.pace), "client": lookup_client(),
            "allow_repeat": config.allow_repeat}


def _canary_replay(
    context: dg.OpExecutionContext, config: DlqOperationConfig, store: DlqStore,
    records: list[DlqRecord],
) -> dict[str, Any]:
    """``canary``: the canaries first, waited for in this op, then the rest or a failed run."""
    ids = [r.id for r in records]
    try:
        result = canaries.canary_replay(
            store,
            Selection(ids=ids or [-1]),
            canary=config.canary or 1,
            canary_timeout=config.canary_timeout,
            **_replay_options(config),
            on_change=lambda now: context.log.info(now.line()),
        )
    except ValidationError as exc:
        raise refused_input(exc) from exc
    replay = result.replay
    decision = {
        d.record.id: result.outcomes[d.record.id] + _verdict(replay, d.record.id)
        for d in replay.decisions
    }
    changed = [d.record.id for d in replay.decisions if d.replay]
    metadata: dict[str, Any] = {
        "selected": len(records),
        "changed": 0 if config.dry_run else len(changed),
        "action": f"replay, canary {config.canary}{' (dry run)' if config.dry_run else ''}",
        "canaries": dg.MetadataValue.json(result.as_dict()),
        "records": records_table(records, decision),
        **_history(store, ids, None),
    }
    if replay.refused:
        context.log.warning(
            replay.refused_line(f"run again with allow_repeat: {replay.refused}"))
    if result.stopped:
        raise dg.Failure(
            description=f"stopped: {result.stopped}; not replayed: {result.held} (still open:"
            " fix the cause, then replay them)",
            allow_retries=False,
            metadata=metadata,
        )
    context.add_output_metadata(metadata)
    context.log.info(
        f"canaries {result.canaries}"
        f" {'would be replayed first' if config.dry_run else 'resolved'};"
        f" {len(changed)} of {len(records)} selected records"
        f" {'would replay' if config.dry_run else 'replay requested'}"
    )
    return {"selected": ids, "changed": changed, "dry_run": config.dry_run,
            "refused": replay.refused, "canaries": result.canaries, "held": result.held}


@dg.job(
    name="dlq_operations",
    description="List, replay (through dlq_replay_sensor) or discard DLQ records.",
    executor_def=dg.in_process_executor,
    tags={tag.QUEUE: "light"},
)
def dlq_operations() -> None:
    dlq_operation()


jobs = [dlq_operations]
