"""``cancel_requests``: cancel job requests from the Dagster UI (launchpad), as ``sekali
requests cancel`` does from the terminal and :func:`engine.requests.cancel_requests` from Python.

The config is typed (Dagster refuses a missing ``requests`` list or a wrong type before the
launch); the op refuses an empty list or a blank reason, naming the field, without retrying.
The output's ``decisions`` table says, per request, what happened: ``cancelled`` (it never
runs), ``requested`` (running: it stops at its next cancel point) or ``refused`` with the
reason (completed, superseded, coalesced). The run is tagged ``sekali/cancel`` with the count.
"""

from typing import Any

import dagster as dg
import pydantic

from engine import tags as tag
from engine.requests import cancel_requests, cancel_view
from pipelines.ops.failures import refused_input
from resources.errors import CancelUnavailable, ValidationError


class CancelConfig(dg.Config):
    """Which requests to cancel, who asks and why (kept on each request)."""

    requests: list[str] = pydantic.Field(
        description="Request ids or idempotency keys (sekali requests list), e.g. ['12',"
        " 'payment:o-1']."
    )
    reason: str = pydantic.Field(description="Why (kept on each request with who and when).")
    actor: str = pydantic.Field(default="dagster-ui", description="Who cancels.")

    def check(self) -> None:
        if not self.requests:
            raise ValidationError("requests", "name at least one request id or key")
        if not self.reason.strip():
            raise ValidationError("reason", "a cancel needs a reason")


_TABLE = dg.TableSchema(
    columns=[
        dg.TableColumn("request", "string", description="the id or key given"),
        dg.TableColumn("id", "int"),
        dg.TableColumn("key", "string"),
        dg.TableColumn("status", "string", description="the request's status now"),
        dg.TableColumn("cancel", "string", description="cancelled, requested or refused"),
        dg.TableColumn("detail", "string"),
    ]
)


@dg.op(required_resource_keys={"requests"}, tags={tag.QUEUE: "light"})
def cancel_request(context: dg.OpExecutionContext, config: CancelConfig) -> dict[str, Any]:
    try:
        config.check()
    except ValidationError as exc:
        raise refused_input(exc) from exc
    store = context.resources.requests.get_store()
    try:
        decided = cancel_requests(store, config.requests, by=config.actor, reason=config.reason)
    except CancelUnavailable as exc:
        raise dg.Failure(description=str(exc), allow_retries=False) from exc
    rows = []
    counts = {"cancelled": 0, "requested": 0, "refused": 0, "unknown": 0}
    for ref, d in zip(config.requests, decided, strict=True):
        view = cancel_view(ref, d)
        counts[view["cancel"]] += 1
        rows.append(dg.TableRecord({
            "request": ref, "id": view["id"] or 0, "key": view["key"] or "",
            "status": view["status"] or "", "cancel": view["cancel"], "detail": view["detail"],
        }))
    summary = ", ".join(f"{n} {state}" for state, n in counts.items() if n)
    context.instance.add_run_tags(context.run_id, {tag.CANCEL: summary})
    context.add_output_metadata(
        {"decisions": dg.MetadataValue.table(rows, _TABLE), **counts}
    )
    context.log.info(f"cancel of {len(config.requests)} requests: {summary}")
    return counts


@dg.job(
    name="cancel_requests",
    description="Cancel job requests by id or key: queued ones never run, running ones stop at"
    " their next cancel point, completed ones are refused.",
    executor_def=dg.in_process_executor,
    tags={tag.QUEUE: "light"},
)
def cancel_requests_job() -> None:
    cancel_request()


jobs = [cancel_requests_job]
