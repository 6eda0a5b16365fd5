"""Every Redis and database error class that can reach ``classify``, provoked on a real server:
each is classified (transient when the store is not ready now, permanent when the request's own
keys are wrong), and where it crosses sekali's boundary (a defence's Lua script, ``Database``,
the driver statements of the ledger) it becomes sekali's error that says what to do.

Redis: a full server (``maxmemory`` under ``noeviction``), a replica (READONLY), a replica that
lost its primary (MASTERDOWN), a server loading its dataset (LOADING), one busy in a script
(BUSY), a cluster node serving no slot (CLUSTERDOWN), a key on another node (MOVED), a slot
being migrated (ASK, TRYAGAIN), keys of two slots (CROSSSLOT). Databases: SQLite past a file
size limit ("disk I/O error"), on a full tmpfs ("database or disk is full"), read-only; Postgres
in a read-only session (``ReadOnlySqlTransaction``) and with its tablespace on a full tmpfs
(``disk_full``). Private servers only: the shared ones are never reconfigured.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pwd
import resource
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.cluster import key_slot
from redis.retry import Retry
from sqlalchemy import create_engine, text

from resources.cache import StampedeCache
from resources.errors import StoreFull, StoreReadOnly, StoreUnavailable
from resources.flow import ConcurrencyLimiter, RateLimiter
from resources.idempotency import IdempotencyStore
from resources.locks import MemoryLockStats, RedisLock
from resources.retry import ErrorClass, RetryBudget, classify
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from resources.storage.redis import redis_client
from sandbox.postgres_server import PostgresServer
from sandbox.redis_cluster import LocalRedisCluster, free_cluster_port
from sandbox.redis_server import RedisServer, free_port
from tests.conftest import IN_CI, drop_postgres_schema, need_server, postgres_schema_url

T, P = ErrorClass.TRANSIENT, ErrorClass.PERMANENT
NO_RETRY = Retry(NoBackoff(), 0)


def _raised(call: Callable[[], Any]) -> BaseException:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the error is what the test looks at
        return exc
    raise AssertionError("expected an error")


def _plain(server: RedisServer, *, socket_timeout: float = 5) -> redis.Redis:
    return server.plain(socket_timeout=socket_timeout)


def _defences(client: Any, name: str) -> dict[str, Callable[[], Any]]:
    """One write through each Redis-backed defence (its Lua script)."""
    def lock() -> None:
        with RedisLock(client, f"{name}:lock", ttl=5, blocking_timeout=0,
                       observer=MemoryLockStats()):
            pass

    def slot() -> None:
        with ConcurrencyLimiter(client, name, limit=1).hold("k", blocking_timeout=0):
            pass

    return {
        "lock": lock,
        "slot": slot,
        "rate": lambda: RateLimiter(client, name, rate=10, burst=5).try_acquire(),
        "budget": lambda: RetryBudget(client, namespace=name).try_spend("gateway"),
        "cache": lambda: StampedeCache(client, namespace=name, wait_timeout=1).get_or_load(
            "k", lambda: "v"),
    }


# -- Redis: one server ------------------------------------------------------------------------


def test_a_full_redis_is_transient_and_every_defence_says_it_is_full(tmp_path: Path) -> None:
    """Catches: the lock and the cache raising redis's out-of-memory ``ResponseError``
    classified ``unknown`` on a full Redis (``noeviction`` at ``maxmemory``)."""
    server = RedisServer(tmp_path / "full", port=free_port()).start()
    try:
        admin = _plain(server)
        used = int(admin.info("memory")["used_memory"])
        server.config_set("maxmemory-policy", "noeviction")
        server.config_set("maxmemory", str(used + 256 * 1024))
        with contextlib.suppress(redis.exceptions.OutOfMemoryError):
            for i in range(10_000):
                admin.set(f"filler:{i}", "x" * 4096)
        raw = _raised(lambda: admin.set("one-more", "x" * 4096))
        assert isinstance(raw, redis.exceptions.OutOfMemoryError)
        assert classify(raw) is T
        # Redis 7 refuses a whole script once over maxmemory; Redis 6 checks only a script's
        # first write, so a script that first removes (the slot's purge, the bucket's HDEL)
        # may still write past the limit there: it then simply succeeds.
        seven = int(str(admin.info("server")["redis_version"]).split(".")[0]) >= 7
        client = redis_client(server.url)
        refused = set()
        for name, call in _defences(client, "full").items():
            try:
                call()
            except StoreFull as error:
                assert classify(error) is T, name
                assert "maxmemory" in str(error) and "nothing was written" in str(error), name
                refused.add(name)
        expected = {"lock", "slot", "rate", "budget", "cache"} if seven else {
            "lock", "budget", "cache"}
        assert refused >= expected, refused
    finally:
        server.stop()


def test_a_replica_is_read_only_and_transient(tmp_path: Path) -> None:
    """Catches: READONLY (a failover to a replica, REDIS_URL naming a replica) classified
    ``unknown``."""
    primary = RedisServer(tmp_path / "primary", port=free_port()).start()
    replica = RedisServer(tmp_path / "replica", port=free_port(),
                          replica_of=primary.port, password=primary.password).start()
    try:
        raw = _raised(lambda: _plain(replica).set("k", "v"))
        assert isinstance(raw, redis.exceptions.ReadOnlyError) and classify(raw) is T
        client = redis_client(replica.url)
        for name, call in _defences(client, "ro").items():
            error = _raised(call)
            assert isinstance(error, StoreReadOnly), (name, repr(error))
            assert classify(error) is T and "replica" in str(error), name
    finally:
        replica.stop()
        primary.stop()


def test_a_replica_without_its_primary_answers_masterdown_transient(tmp_path: Path) -> None:
    """Catches: MASTERDOWN (a replica that serves no stale data while its primary is away)
    classified ``unknown``."""
    replica = RedisServer(tmp_path / "replica", port=free_port(), replica_of=free_port(),
                          options=["--replica-serve-stale-data", "no"]).start()
    try:
        raw = _raised(lambda: _plain(replica).get("k"))
        assert isinstance(raw, redis.exceptions.MasterDownError) and classify(raw) is T
        error = _raised(_defences(redis_client(replica.url), "md")["lock"])
        assert isinstance(error, StoreUnavailable) and "MASTERDOWN" in str(error)
        assert classify(error) is T
    finally:
        replica.stop()


def test_a_server_loading_its_dataset_answers_loading_transient(tmp_path: Path) -> None:
    """Catches: LOADING (a restart with a large dataset) given up on. Needs a Redis 7 server
    (its loader answers clients between keys); the one of the Debian package CI installs."""
    binary = shutil.which("redis-server")
    version = subprocess.run([binary, "--version"], capture_output=True, text=True,
                             check=False).stdout if binary else ""
    if not binary or " v=6." in version:
        need_server("a Redis 7 redis-server on PATH", RuntimeError(version or "none"))
    assert binary is not None
    seed = RedisServer(tmp_path, port=free_port(), binary=binary,
                       options=["--enable-debug-command", "yes"]).start()
    try:
        seed.debug("POPULATE", "20000", "k", "100")
        _plain(seed).save()
    finally:
        seed.stop()
    loading = RedisServer(tmp_path, port=seed.port, binary=binary, password=seed.password,
                          options=["--key-load-delay", "100",
                                   "--loading-process-events-interval-bytes", "1024"]).launch()
    try:
        deadline = time.monotonic() + 20
        raw: BaseException | None = None
        while raw is None and time.monotonic() < deadline:
            try:
                _plain(loading, socket_timeout=1).get("k:1")
            except redis.BusyLoadingError as exc:
                raw = exc
            except redis.ConnectionError:
                time.sleep(0.02)
        assert raw is not None, "the server never answered LOADING"
        assert classify(raw) is T
    finally:
        loading.stop()


def test_a_server_busy_in_a_script_answers_busy_transient(tmp_path: Path) -> None:
    """Catches: BUSY (another client's long script) classified ``unknown``."""
    server = RedisServer(tmp_path / "busy", port=free_port(),
                         options=["--lua-time-limit", "50"]).start()
    looping = threading.Thread(
        target=lambda: _raised(lambda: _plain(server, socket_timeout=60).eval(
            "local i = 0 while true do i = i + 1 end", 0)),
        daemon=True,
    )
    try:
        looping.start()
        time.sleep(0.3)
        raw = _raised(lambda: _plain(server).get("k"))
        assert "BUSY" in str(raw) and classify(raw) is T
        error = _raised(_defences(redis_client(server.url), "busy")["slot"])
        assert isinstance(error, StoreUnavailable) and "BUSY" in str(error)
    finally:
        with contextlib.suppress(redis.RedisError):
            _plain(server).script_kill()
        looping.join(10)
        server.stop()


# -- Redis: a cluster -------------------------------------------------------------------------


@pytest.fixture
def cluster(redis_cluster: LocalRedisCluster) -> LocalRedisCluster:
    """The session's private cluster; a slot moved below is made stable again."""
    return redis_cluster


def _id(cluster: LocalRedisCluster, index: int) -> str:
    node = cluster.node(index)
    try:
        raw = node.execute_command("CLUSTER", "MYID")
        return raw.decode() if isinstance(raw, bytes) else str(raw)
    finally:
        node.close()


def _index_serving(cluster: LocalRedisCluster, slot: int) -> int:
    node = cluster.node(0)
    try:
        for start, end, master, *_ in node.execute_command("CLUSTER", "SLOTS"):
            if int(start) <= slot <= int(end):
                return cluster.ports.index(int(master[1]))
    finally:
        node.close()
    raise AssertionError(f"no node serves slot {slot}")


def test_a_plain_client_on_a_cluster_node_is_redirected_transient(
    cluster: LocalRedisCluster,
) -> None:
    """Catches: MOVED (REDIS_URL naming one node of a cluster) classified ``unknown``; the
    defences say to write the URL as ``redis+cluster://``."""
    key = "moved-key"
    owner = _index_serving(cluster, key_slot(key.encode()))
    other = (owner + 1) % len(cluster.ports)
    raw = _raised(lambda: cluster.node(other).get(key))
    assert isinstance(raw, redis.exceptions.MovedError) and classify(raw) is T
    plain = redis_client(f"redis://:{cluster.password}@127.0.0.1:{cluster.ports[other]}/0")
    errors = []
    for name, call in _defences(plain, "moved").items():
        error = _raised(call)
        if isinstance(error, StoreUnavailable):
            errors.append(name)
            assert "redis+cluster://" in str(error), name
        assert classify(error) is T, (name, repr(error))
    assert errors, "no defence's key landed on another node"


@contextlib.contextmanager
def _migrating(cluster: LocalRedisCluster, slot: int) -> Iterator[tuple[int, int]]:
    """``slot`` half-way from its owner to the next node (MIGRATING / IMPORTING); stable
    again afterwards."""
    source = _index_serving(cluster, slot)
    target = (source + 1) % len(cluster.ports)
    src, dst = cluster.node(source), cluster.node(target)
    try:
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", _id(cluster, source))
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", _id(cluster, target))
        yield source, target
    finally:
        for node in (src, dst):
            node.execute_command("CLUSTER", "SETSLOT", slot, "STABLE")
            node.close()


def test_a_slot_in_migration_answers_ask_and_tryagain_transient(
    cluster: LocalRedisCluster,
) -> None:
    """Catches: ASK and TRYAGAIN (a slot being resharded) classified ``unknown``."""
    present, absent = "{mig}present", "{mig}absent"
    slot = key_slot(present.encode())
    source = _index_serving(cluster, slot)
    cluster.node(source).set(present, "1")
    with _migrating(cluster, slot) as (source, target):
        ask = _raised(lambda: cluster.node(source).get(absent))
        assert isinstance(ask, redis.exceptions.AskError) and classify(ask) is T
        pipe = cluster.node(target).pipeline(transaction=False)  # one connection: ASKING, MGET
        pipe.execute_command("ASKING")
        pipe.mget(present, absent)
        _asking, again = pipe.execute(raise_on_error=False)
        assert isinstance(again, redis.exceptions.TryAgainError) and classify(again) is T
    cluster.node(source).delete(present)


def test_keys_of_two_slots_in_one_command_are_permanent(cluster: LocalRedisCluster) -> None:
    """Catches: CROSSSLOT (keys that can never share a node) retried as if it could pass."""
    a, b = "cross-a", "cross-b"
    assert key_slot(a.encode()) != key_slot(b.encode())
    raw = _raised(lambda: cluster.node(0).mget(a, b))
    assert isinstance(raw, redis.exceptions.ClusterCrossSlotError) and classify(raw) is P


def test_a_cluster_node_serving_no_slot_answers_clusterdown_transient(tmp_path: Path) -> None:
    """Catches: CLUSTERDOWN (a cluster that lost coverage of a slot) classified ``unknown``."""
    lone = RedisServer(tmp_path / "lone", port=free_cluster_port(), options=[
        "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]).start()
    try:
        raw = _raised(lambda: _plain(lone).get("k"))
        assert isinstance(raw, redis.exceptions.ClusterDownError) and classify(raw) is T
        error = _raised(_defences(redis_client(lone.url), "down")["rate"])
        assert isinstance(error, StoreUnavailable) and "CLUSTERDOWN" in str(error)
    finally:
        lone.stop()


# -- databases ---------------------------------------------------------------------------------


def _write_until_it_fails(url: str, conn: Any) -> None:
    """In a child process: fill the store through both ways sekali writes (the ledger's driver
    statements, SQLAlchemy through ``Database``) and send what each raised."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails, not the process
    limit = os.environ.get("FSIZE_LIMIT")
    if limit:
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), int(limit)))
    db = Database.from_url(url)
    store = IdempotencyStore(db)
    out = {}
    for way, write in (
        ("driver", lambda i: store.begin(f"fill-{i}-" + "k" * 400, payload={"b": "x" * 4000})),
        ("sqlalchemy", lambda i: _insert(db, i)),
    ):
        for i in range(100_000):
            try:
                write(i)
            except Exception as exc:  # noqa: BLE001 - reported to the test
                cause = exc.__cause__
                out[way] = (type(exc).__name__, str(exc)[:400], str(classify(exc)),
                            None if cause is None else str(classify(cause)))
                break
    conn.send(out)


def _insert(db: Database, i: int) -> None:
    with db.transaction() as conn:
        conn.execute(
            text("INSERT INTO job_rejections (job_type, payload, field, error, created_at)"
                 " VALUES ('t', :p, 'f', 'e', :i)"),
            {"p": "y" * 8000, "i": i},
        )


def _in_child(url: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    before = dict(os.environ)
    os.environ.update(env or {})
    try:
        process = ctx.Process(target=_write_until_it_fails, args=(url, child))
        process.start()
    finally:
        os.environ.clear()
        os.environ.update(before)
    assert parent.poll(120), "the child reported nothing"
    result: dict[str, Any] = parent.recv()
    process.join(30)
    return result


def _assert_store_error(result: dict[str, Any], error: str, words: str) -> None:
    for way in ("driver", "sqlalchemy"):
        assert way in result, f"{way}: no error at all: {result}"
        name, message, kind, cause_kind = result[way]
        assert name == error and words in message, (way, result[way])
        assert kind == "transient" and cause_kind == "transient", (way, result[way])


def test_sqlite_past_a_file_size_limit_is_an_io_error_transient(tmp_path: Path) -> None:
    """Catches: SQLite "disk I/O error" coming out of the ledger's driver statements raw
    (``sqlite3.OperationalError``, classified ``unknown``)."""
    url = f"sqlite:///{tmp_path / 'app.db'}"
    db = Database.from_url(url)
    upgrade(db)
    db.dispose()
    size = sum(p.stat().st_size for p in tmp_path.iterdir())
    result = _in_child(url, {"FSIZE_LIMIT": str(size + 64 * 1024)})
    _assert_store_error(result, "StoreUnavailable", "disk I/O error")


@contextlib.contextmanager
def _tmpfs(path: Path, size: str, owner: str | None = None) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` (root only), unmounted afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size},mode=0700"
    if owner:
        user = pwd.getpwnam(owner)
        options += f",uid={user.pw_uid},gid={user.pw_gid}"
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        need_server("a tmpfs mount (run as root)", RuntimeError(mounted.stderr.strip()))
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
        with contextlib.suppress(OSError):
            path.rmdir()


def test_sqlite_on_a_full_disk_is_store_full_transient(tmp_path: Path) -> None:
    """Catches: SQLite "database or disk is full" coming out raw and ``unknown``."""
    with _tmpfs(tmp_path / "disk", "4m") as disk:
        url = f"sqlite:///{disk / 'app.db'}"
        db = Database.from_url(url)
        upgrade(db)
        db.dispose()
        result = _in_child(url)
    _assert_store_error(result, "StoreFull", "database or disk is full")


def test_sqlite_that_may_not_write_is_read_only_transient(tmp_path: Path) -> None:
    """Catches: SQLite's "attempt to write a readonly database" classified ``unknown``."""
    url = f"sqlite:///{tmp_path / 'app.db'}"
    db = Database.from_url(url)
    upgrade(db)
    db.dispose()
    readonly = Database(create_engine(f"sqlite:///file:{tmp_path / 'app.db'}?mode=ro&uri=true"))
    try:
        error = _raised(lambda: _insert(readonly, 1))
        assert isinstance(error, StoreReadOnly) and classify(error) is T
        assert classify(error.__cause__ or error) is T
    finally:
        readonly.dispose()


@pytest.mark.postgres
def test_postgres_in_a_read_only_session_is_read_only_transient() -> None:
    """Catches: ``ReadOnlySqlTransaction`` (a hot standby, ``default_transaction_read_only``)
    classified ``unknown`` on both ways in."""
    url, schema = postgres_schema_url()
    try:
        db = Database.from_url(url)
        upgrade(db)
        db.dispose()
        readonly_url = url.replace("options=", "options=-cdefault_transaction_read_only%3Don%20")
        ro = Database.from_url(readonly_url)
        try:
            for way, call in (
                ("driver", lambda: IdempotencyStore(ro).begin("ro-key", payload={"a": 1})),
                ("sqlalchemy", lambda: _insert(ro, 1)),
            ):
                error = _raised(call)
                assert isinstance(error, StoreReadOnly), (way, repr(error))
                assert "read_only_sql_transaction" in str(error), way
                assert classify(error) is T and classify(error.__cause__ or error) is T, way
        finally:
            ro.dispose()
    finally:
        drop_postgres_schema(schema)


@pytest.mark.postgres
def test_postgres_with_a_full_disk_is_store_full_transient(tmp_path: Path) -> None:
    """Catches: Postgres ``disk_full`` (53100) coming out of the ledger's driver statements
    raw. A private cluster whose tables live in a tablespace on a 512 KiB tmpfs."""
    if os.geteuid() != 0 and not IN_CI:
        pytest.skip("mounting a tmpfs needs root")
    server = PostgresServer().start()
    try:
        # a mount point the postgres user can reach (pytest's folders are root's alone)
        with _tmpfs(Path(tempfile.mkdtemp(prefix="sekali-tiny-")), "512k", "postgres") as disk:
            db = Database.from_url(server.url())
            upgrade(db)
            db.dispose()
            admin = create_engine(server.url(), isolation_level="AUTOCOMMIT")
            with admin.connect() as conn:  # the tables the child fills live on the tiny disk
                conn.execute(text(f"CREATE TABLESPACE tiny LOCATION '{disk}'"))
                for table in ("idempotency_records", "job_rejections"):
                    conn.execute(text(f"ALTER TABLE {table} SET TABLESPACE tiny"))
            admin.dispose()
            result = _in_child(server.url())
    finally:
        server.stop()
    _assert_store_error(result, "StoreFull", "disk_full")


def _wait_for(probe: Callable[[], Any], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            probe()
            return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)

