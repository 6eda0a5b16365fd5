"""Storage: the app database (SQLite or Postgres), the ``sql/`` migrations, and the settings.

``Database`` is the one handle every store takes (``Database.from_url(url)``); importing it opens
no connection."""

from resources.storage.db import Database

__all__ = ["Database"]
