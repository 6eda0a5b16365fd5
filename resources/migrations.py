"""The schema migrations: :func:`upgrade` and friends, from :mod:`resources.storage.migrations`."""

from resources.storage.migrations import MigrationDrift, applied, load_migrations, upgrade

__all__ = ["MigrationDrift", "applied", "load_migrations", "upgrade"]
