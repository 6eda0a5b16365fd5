"""Dagster copies a resource three times each time it initializes it (per run, per sensor tick),
and each copy would infer the class's config schema again: 40% of an empty micro-batch run's
CPU. sekali's resources infer theirs once per class; these tests hold that and that the copies
still carry their own values, through a real run on a real instance."""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest

from pipelines.profile import DownstreamResource
from resources.dagster_resources import IdempotencyResource, LockResource

pytestmark = [pytest.mark.dagster]


def test_every_copy_of_a_resource_shares_its_classs_config_schema() -> None:
    """Catches the schema inferred again for every copy: a copy made as Dagster makes them at
    initialization (new values, or none) has the very schema object of the class."""
    first = IdempotencyResource(lease_seconds=5.0)
    copies = [first._with_updated_values({}),
              first._with_updated_values({"lease_seconds": 9.0}),
              IdempotencyResource(retention_hours=1.0)]
    assert all(copy._schema is first._schema for copy in copies)
    other = LockResource(backend="db")
    assert other._schema is not first._schema  # one per class, not one for all


def test_copies_keep_their_own_values_and_defaults(tmp_path: Path) -> None:
    """Catches a shared schema that shares values too: each resource's own values reach its
    op, the run config's override reaches it, and the Launchpad's defaults stay per instance."""
    seen: dict[str, object] = {}

    @dg.op(required_resource_keys={"idempotency", "smtp"})
    def look(context) -> None:  # type: ignore[no-untyped-def]  # Dagster reads the annotation
        seen["lease"] = context.resources.idempotency.lease_seconds
        seen["retention"] = context.resources.idempotency.retention_hours
        seen["address"] = context.resources.smtp.address

    @dg.job
    def probe() -> None:
        look()

    resources = {
        "idempotency": IdempotencyResource(database_url=f"sqlite:///{tmp_path}/a.db",
                                           lease_seconds=7.0),
        "smtp": DownstreamResource(downstream="smtp", address="127.0.0.1:2525"),
    }
    with dg.instance_for_test() as instance:
        plain = probe.execute_in_process(resources=resources, instance=instance)
        assert plain.success
        assert seen == {"lease": 7.0, "retention": 7 * 24.0, "address": "127.0.0.1:2525"}
        override = probe.execute_in_process(
            resources=resources, instance=instance,
            run_config={"resources": {"idempotency": {"config": {"lease_seconds": 3.0}}}},
        )
    assert override.success
    assert seen["lease"] == 3.0 and seen["address"] == "127.0.0.1:2525"
    fresh = IdempotencyResource()
    assert fresh.lease_seconds == 60.0
    defaults = fresh._config_schema.as_field().default_value
    assert defaults.get("lease_seconds", 60.0) == 60.0
    assert resources["idempotency"]._config_schema.as_field().default_value["lease_seconds"] == 7.0
