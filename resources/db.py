"""The app database: :class:`Database` and friends, from :mod:`resources.storage.db`."""

from resources.storage.db import Database, make_engine, metadata, normalize_url, shared_database

__all__ = ["Database", "make_engine", "metadata", "normalize_url", "shared_database"]
