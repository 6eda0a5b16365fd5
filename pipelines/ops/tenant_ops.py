"""``tenant_operations``: list tenants or set one's fair share from the Dagster UI (launchpad),
the same as ``sekali tenants list | set`` (docs/flow.md, "Fair share across tenants").

``action`` defaults to ``list``; ``set`` needs ``name`` and ``weight`` (``min_share`` and
``max_share`` optional, 0..1). A bad value fails the run permanently with the field named
(``dagster/failure_reason`` and the ``field`` metadata), never retried. The next intake claim
reads a change: no restart.
"""

import enum
from typing import Any

import dagster as dg
import pydantic

from engine import tags as tag
from engine.tenants import TenantStore
from pipelines.ops.failures import refused_input
from resources.errors import ValidationError
from sensors.intake import RequestsResource


class TenantAction(enum.Enum):
    list = "list"  # noqa: A003
    set = "set"  # noqa: A003


class TenantOperationConfig(dg.Config):
    action: TenantAction = pydantic.Field(default=TenantAction.list, description="list or set.")
    name: str | None = pydantic.Field(default=None, description="The tenant (for set).")
    weight: float = pydantic.Field(default=1.0, description="Relative weight, > 0 (for set).")
    min_share: float | None = pydantic.Field(
        default=None, description="Guaranteed share of each claim page while it has work, 0..1."
    )
    max_share: float | None = pydantic.Field(
        default=None, description="Most it may take of a claim page even when alone, 0..1."
    )


_TABLE = dg.TableSchema(columns=[
    dg.TableColumn("tenant", "string"), dg.TableColumn("weight", "float"),
    dg.TableColumn("min_share", "string"), dg.TableColumn("max_share", "string"),
    dg.TableColumn("claimed", "int"),
])


@dg.op(tags={tag.QUEUE: "light"})
def tenant_operation(
    context: dg.OpExecutionContext, config: TenantOperationConfig, requests: RequestsResource
) -> dict[str, Any]:
    tenants = TenantStore(requests.get_store().db)
    if config.action is TenantAction.set:
        try:
            if config.name is None:
                raise ValidationError("name", "required to set a tenant")
            tenants.set(config.name, weight=config.weight, min_share=config.min_share,
                        max_share=config.max_share)
        except ValidationError as exc:
            raise refused_input(exc) from exc
        context.log.info(f"tenant {config.name}: weight {config.weight:g} (next claim)")
    listed = tenants.list()
    rows = [
        dg.TableRecord({"tenant": t.name, "weight": t.weight,
                        "min_share": "" if t.min_share is None else f"{t.min_share:g}",
                        "max_share": "" if t.max_share is None else f"{t.max_share:g}",
                        "claimed": t.claimed})
        for t in listed
    ]
    context.add_output_metadata({"tenants": dg.MetadataValue.table(rows, _TABLE)})
    return {"tenants": [t.name for t in listed]}


@dg.job(
    name="tenant_operations",
    description="List tenants or set one's weight, minimum and maximum share of the intake.",
    executor_def=dg.in_process_executor,
    tags={tag.QUEUE: "light"},
)
def tenant_operations() -> None:
    tenant_operation()


jobs = [tenant_operations]
