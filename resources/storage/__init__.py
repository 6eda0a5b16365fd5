"""Storage: the app database (SQLite or Postgres), the ``sql/`` migrations, and the settings."""
