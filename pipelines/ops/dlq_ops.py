"""``dlq_operations``: list, replay and discard dead letters from the Dagster UI (launchpad).

The config is validated twice: by Dagster (the action and the error class are enums, ids are
integers) and by the op (a replay or discard needs ids or a filter; a discard needs a reason;
ages parse), which fails permanently with the field named. ``dry_run`` defaults to true, so a
launch with the defaults only says what would happen. A replay requested here is launched by
``dlq_replay_sensor`` at its rate bound, exactly as one requested from ``sekali dlq replay``.
"""

import enum
from typing import Any

import dagster as dg

from pipelines import tags as tag
from resources.dagster_resources import DlqResource
from resources.dlq import parse_age
from resources.errors import ValidationError
from resources.idempotency import IdempotencyStore


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


class DlqOperationConfig(dg.Config):
    """What to do with which records. Filters combine with AND; ``ids`` select records directly."""

    action: DlqAction = DlqAction.list
    ids: list[int] = []
    job_type: str | None = None
    error_class: DlqClassChoice | None = None
    fingerprint: str | None = None
    older_than: str | None = None
    newer_than: str | None = None
    status: list[str] = ["open", "replay_requested", "replaying"]
    dry_run: bool = True
    reason: str = ""
    actor: str = "dagster-ui"

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


@dg.op(required_resource_keys={"dlq"}, tags={tag.QUEUE: "light"})
def dlq_operation(context: dg.OpExecutionContext, config: DlqOperationConfig) -> dict[str, Any]:
    try:
        config.check()
    except ValidationError as exc:
        raise dg.Failure(
            description=str(exc), allow_retries=False, metadata={"field": exc.field}
        ) from exc
    dlq: DlqResource = context.resources.dlq
    store = dlq.get_store()
    action = config.action.value
    records = store.list_records(
        status=["open"] if action == "replay" and not config.ids else config.status,
        ids=config.ids or None,
        job_type=config.job_type,
        error_class=config.error_class.value if config.error_class else None,
        fingerprint=config.fingerprint,
        older_than=parse_age(config.older_than),
        newer_than=parse_age(config.newer_than),
    )
    ids = [r.id for r in records]
    changed: list[int] = []
    if action == "replay":
        decisions = store.request_replay(
            ids,
            actor=config.actor,
            reason=config.reason,
            idempotency=IdempotencyStore(store.db),
            dry_run=config.dry_run,
        )
        changed = [d.record.id for d in decisions if d.replay]
    elif action == "discard" and not config.dry_run:
        changed = [
            d.record.id
            for d in store.discard(ids, actor=config.actor, reason=config.reason)
            if d.replay
        ]
    elif action == "discard":
        changed = [r.id for r in records if r.status in ("open", "replay_requested")]
    rows = "\n".join(
        f"| {r.id} | {r.status} | {r.job_type} | {r.error_class} | {r.fingerprint} | "
        f"{r.failure_count} | {(r.last_error or '')[:60]} |"
        for r in records[:200]
    )
    verb = {"list": "listed", "replay": "replay requested", "discard": "discarded"}[action]
    if config.dry_run and action != "list":
        verb = "would be discarded" if action == "discard" else "would replay"
    context.add_output_metadata(
        {
            "selected": len(records),
            "changed": 0 if config.dry_run else len(changed),
            "action": f"{action}{' (dry run)' if config.dry_run else ''}",
            "records": dg.MetadataValue.md(
                "| id | status | job | class | fingerprint | fails | error |\n"
                "|---|---|---|---|---|---|---|\n" + rows
            ),
        }
    )
    context.log.info(f"{len(changed)} of {len(records)} selected records: {verb}")
    return {"selected": ids, "changed": changed, "dry_run": config.dry_run}


@dg.job(
    name="dlq_operations",
    description="List, replay (through dlq_replay_sensor) or discard DLQ records.",
    executor_def=dg.in_process_executor,
    tags={tag.QUEUE: "light"},
)
def dlq_operations() -> None:
    dlq_operation()


jobs = [dlq_operations]
