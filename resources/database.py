"""The app database as a Dagster resource: one shared ``Database`` per URL per process."""

from __future__ import annotations

from typing import Any

from dagster import ConfigurableResource
from pydantic import PrivateAttr

from resources.db import Database, shared_database
from resources.migrations import upgrade


class DatabaseResource(ConfigurableResource):
    """The app database on ``database_url`` (``DATABASE_URL`` / the embedded SQLite if unset).

    Opens nothing at import or construction; the pool is created on first use. With
    ``apply_migrations`` the ``sql/`` files are applied at setup (idempotent).
    """

    database_url: str | None = None
    apply_migrations: bool = False

    _db: Database | None = PrivateAttr(default=None)

    def setup_for_execution(self, context: Any) -> None:
        self._db = self._build()

    def _build(self) -> Database:
        from resources.settings import Settings  # noqa: PLC0415 - read env only at setup

        db = shared_database(self.database_url or Settings.from_env().database_url)
        if self.apply_migrations:
            upgrade(db)
        return db

    def get_database(self) -> Database:
        if self._db is None:
            self._db = self._build()
        return self._db
