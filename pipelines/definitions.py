"""The code location: assembles what the other modules export. Nothing is configured here."""

from __future__ import annotations

import dagster as dg

from pipelines.profile import resource_defs

defs = dg.Definitions(
    jobs=[],
    sensors=[],
    schedules=[],
    assets=[],
    asset_checks=[],
    resources=resource_defs(),
)
