"""Dagster copies a resource three times each time it initializes it (per run, per sensor tick),
and each copy would work out its class's facts again (the config schema, its nested resources,
its field map, the schema defaulted to its values): most of an empty micro-batch run's CPU.
sekali's resources work them out once per class (and values); these tests hold that and that
the copies still carry their own values, through a real run on a real instance."""

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


def test_copies_with_the_same_values_share_the_defaulted_schema_and_others_keep_theirs() -> None:
    """Catches every copy validating its values into a schema again (the defaulted schema
    shared), and a share that leaks one copy's values into another's Launchpad defaults."""
    first = IdempotencyResource(lease_seconds=5.0)
    again = first._with_updated_values({})
    same = IdempotencyResource(lease_seconds=5.0)
    other = IdempotencyResource(lease_seconds=9.0)
    assert again._config_schema is first._config_schema
    assert same._config_schema is first._config_schema
    assert other._config_schema is not first._config_schema
    assert first._config_schema.as_field().default_value["lease_seconds"] == 5.0
    assert other._config_schema.as_field().default_value["lease_seconds"] == 9.0
    integral = IdempotencyResource(lease_seconds=5)  # 5 and 5.0 are told apart, as Dagster would
    assert integral._config_schema.as_field().default_value["lease_seconds"] == 5


def test_what_dagster_reads_from_a_class_is_wrapped_where_dagster_reads_it() -> None:
    """Catches a Dagster release that moves a function the once-per-class facts wrap: the
    wrapper would then sit where nothing calls it, and every copy would pay again."""
    import dagster_shared.dagster_model.pydantic_compat_layer as compat
    from dagster._config.pythonic_config import config, conversion_utils, resource

    assert resource.infer_schema_from_config_class is not config.infer_schema_from_config_class
    assert resource._curry_config_schema is not conversion_utils._curry_config_schema
    assert config.model_fields is not compat.model_fields
    fields = resource._get_resource_param_fields
    assert fields(IdempotencyResource) is fields(IdempotencyResource)  # worked out once
    assert config.model_fields(IdempotencyResource) is config.model_fields(IdempotencyResource)
    assert "lease_seconds" in config.model_fields(IdempotencyResource)
    assert config.model_fields(dg.Config) is not config.model_fields(dg.Config)  # not ours


def test_a_copy_reads_the_settings_once_and_a_new_copy_reads_them_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Catches each call reading the environment again (a dozen reads a run): a copy keeps the
    settings it read first, and the next run's copy sees a change."""
    monkeypatch.setenv("SEKALI_SMTP_PORT", "2525")
    copy = LockResource(backend="db")
    assert copy.settings().smtp_port == 2525
    monkeypatch.setenv("SEKALI_SMTP_PORT", "2626")
    assert copy.settings() is copy.settings()
    assert copy.settings().smtp_port == 2525
    assert copy._with_updated_values({}).settings().smtp_port == 2626
