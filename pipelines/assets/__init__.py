"""The Dagster assets, asset checks and schedules of sekali."""
