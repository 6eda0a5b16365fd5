"""Security of what sekali starts and writes: the throwaway servers, secrets, file modes, bodies.

Each test names the hole it closes. They run against the real thing: a private redis-server, a
private Redis Cluster, a private PostgreSQL cluster, files on disk and ``/proc``.
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import io
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
import urllib3
from sqlalchemy import create_engine, text

from benchmarks.cluster import redis_capacity
from cli.commands.output import emit
from cli.commands.preflight import InstanceLock
from pipelines.domain.payments import GatewayUnavailable, HttpPaymentGateway
from resources.storage.db import Database
from resources.storage.files import write_private
from resources.storage.migrations import upgrade
from resources.telemetry.redact import hide_url_password
from sandbox.gateway import GatewayServer
from sandbox.hosts.cluster import (
    Cluster,
    ClusterError,
    _without_secrets,
    ensure_service_user,
    plan_reveal,
)
from sandbox.http_server import READ_TIMEOUT_S
from sandbox.mailsink import MailSink
from sandbox.postgres_server import PostgresServer, PostgresUnavailable
from sandbox.redis_cluster import LocalRedisCluster
from sandbox.redis_server import CONFIG_FILE, RedisServer, free_port
from sandbox.webhooks import WebhookReceiver
from tests.conftest import need_server


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


# -- the private redis-server ------------------------------------------------------------------


def test_private_redis_requires_a_generated_password(tmp_path: Path) -> None:
    """Catches: the sandbox redis-server open to every local user on its loopback port (no
    password), with the password (when there is one) visible in ``/proc/<pid>/cmdline``."""
    server = RedisServer(tmp_path / "r", port=free_port()).start()
    try:
        anonymous = redis.Redis(port=int(server.port or 0), socket_timeout=5,
                                socket_connect_timeout=2)
        with pytest.raises(redis.AuthenticationError):
            anonymous.set("k", "v")
        anonymous.close()
        assert server.password and len(server.password) >= 32
        assert server.client().ping()
        assert server.process is not None
        assert server.password not in _cmdline(server.process.pid)
        assert _mode(server.directory) == 0o700
        assert _mode(server.directory / CONFIG_FILE) == 0o600
    finally:
        server.stop()


def test_private_redis_has_config_module_and_debug_renamed_away(tmp_path: Path) -> None:
    """Catches: a client of the sandbox Redis writing files where it likes (``CONFIG SET
    dir``/``dbfilename``) or loading code (``MODULE LOAD``); only the starter, who knows the
    secret names, can still change the configuration."""
    server = RedisServer(tmp_path / "r", port=free_port()).start()
    try:
        client = server.plain()
        for command in (("CONFIG", "SET", "dir", "/tmp"), ("CONFIG", "GET", "dir"),
                        ("MODULE", "LIST"), ("DEBUG", "SLEEP", "0")):
            with pytest.raises(redis.ResponseError, match="unknown command"):
                client.execute_command(*command)
        client.close()
        server.config_set("maxmemory-policy", "noeviction")
        assert server.config_get("maxmemory-policy") == "noeviction"
    finally:
        server.stop()


_DEV_REDIS = textwrap.dedent("""
    import sys
    from cli.commands.dev import _start_redis
    from cli.commands.supervisor import Supervisor
    supervisor = Supervisor(watchdog=False)
    _start_redis(supervisor, "unix://" + sys.argv[1], verbose=False)
    print(supervisor.children[0].process.pid, flush=True)
    sys.stdin.read()
    supervisor.stop()
""")


def test_dev_redis_has_config_module_and_debug_renamed_away(tmp_path: Path) -> None:
    """Catches: ``sekali dev``'s embedded redis-server keeping ``CONFIG``, ``DEBUG`` and
    ``MODULE`` for any client of its socket (``CONFIG SET dir`` writes files where it likes,
    ``MODULE LOAD`` loads code), where the private servers elsewhere rename them; and the
    secret names on its command line."""
    sock = tmp_path / "redis" / "redis.sock"
    dev = subprocess.Popen([sys.executable, "-c", _DEV_REDIS, str(sock)], cwd=Path.cwd(),
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert dev.stdin is not None and dev.stdout is not None
    try:
        pid = int(dev.stdout.readline())
        client = redis.Redis(unix_socket_path=str(sock), socket_timeout=5,
                             socket_connect_timeout=2)
        assert client.ping()
        for command in (("CONFIG", "SET", "dir", "/tmp"), ("CONFIG", "GET", "dir"),
                        ("MODULE", "LIST"), ("DEBUG", "SLEEP", "0")):
            with pytest.raises(redis.ResponseError, match="unknown command"):
                client.execute_command(*command)
        client.close()
        assert "rename" not in _cmdline(pid) and "CONFIG" not in _cmdline(pid)
        assert _mode(sock.parent / CONFIG_FILE) == 0o600
    finally:
        dev.stdin.close()
        assert dev.wait(30) == 0


def test_private_replica_authenticates_to_its_primary(tmp_path: Path) -> None:
    """Catches: a replica of a password-protected primary that never syncs (no
    ``masterauth``), which would leave the chaos harness's failover without data."""
    primary = RedisServer(tmp_path / "p", port=free_port()).start()
    replica = RedisServer(tmp_path / "q", port=free_port(), replica_of=primary.port,
                          password=primary.password).start()
    try:
        primary.client().set("k", "v")
        client = replica.client()
        for _ in range(200):
            if client.info("replication").get("master_link_status") == "up":
                break
            time.sleep(0.05)
        assert client.info("replication").get("master_link_status") == "up"
    finally:
        replica.stop()
        primary.stop()


def test_private_redis_cluster_requires_its_password(redis_cluster: LocalRedisCluster) -> None:
    """Catches: the private Redis Cluster's nodes open to every local user."""
    anonymous = redis.Redis(port=redis_cluster.ports[0], socket_timeout=5,
                            socket_connect_timeout=2)
    with pytest.raises(redis.AuthenticationError):
        anonymous.get("k")
    anonymous.close()
    node = redis_cluster.node(0)
    assert node.cluster("INFO")["cluster_state"] == "ok"
    node.close()
    assert redis_cluster.password in redis_cluster.url
    assert redis_cluster.password not in hide_url_password(redis_cluster.url)


# -- the private PostgreSQL cluster -------------------------------------------------------------


@pytest.fixture(scope="module")
def private_pg() -> PostgresServer:
    try:
        server = PostgresServer(prefix="sekali-sec-pg-").start()
    except PostgresUnavailable as exc:
        need_server("a private PostgreSQL cluster (initdb, pg_ctl)", exc)
        raise
    yield server  # type: ignore[misc]
    server.stop()


def test_private_postgres_requires_a_generated_password(private_pg: PostgresServer) -> None:
    """Catches: the private PostgreSQL with ``trust`` authentication on loopback, which gives
    every local user a superuser (and ``COPY ... TO PROGRAM``: a shell as ``postgres``)."""
    with pytest.raises(psycopg.OperationalError, match="password"):
        psycopg.connect(host="127.0.0.1", port=private_pg.port, user="postgres",
                        dbname="postgres", connect_timeout=5).close()
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(host="127.0.0.1", port=private_pg.port, user="postgres",
                        password="guess", dbname="postgres", connect_timeout=5).close()
    with pytest.raises(psycopg.OperationalError):  # the Unix socket asks for it too
        psycopg.connect(host=str(private_pg.socket_dir), port=private_pg.port,
                        user="postgres", dbname="postgres", connect_timeout=5).close()
    engine = create_engine(private_pg.url())
    with engine.connect() as conn:
        assert conn.execute(text("SELECT current_setting('password_encryption')")).scalar() \
            == "scram-sha-256"
    engine.dispose()
    hba = (private_pg.data_dir / "pg_hba.conf").read_text()
    assert "trust" not in [line.split()[-1] for line in hba.splitlines()
                           if line.strip() and not line.startswith("#")]
    assert not (private_pg.root / "pwfile").exists()
    assert _mode(private_pg.root) == 0o700


def test_hide_url_password_masks_every_url_shape() -> None:
    """Catches: a URL printed with its password (a report, a note on stderr)."""
    assert hide_url_password("redis://:s3cret@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert hide_url_password("postgresql+psycopg://app:pw@db:5432/app?x=1") == \
        "postgresql+psycopg://app:***@db:5432/app?x=1"
    assert hide_url_password("redis+cluster://:pw@h1:7000,h2:7001") == \
        "redis+cluster://:***@h1:7000,h2:7001"
    assert hide_url_password("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    assert hide_url_password("sqlite:////tmp/a@b:c.db") == "sqlite:////tmp/a@b:c.db"


# -- bounded HTTP bodies, the gateway's admin token -------------------------------------------


def _raw_http(port: int, request: bytes) -> bytes:
    """Send ``request`` as it is and read the answer's status line (the server may close)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(request)
        answer = b""
        while b"\r\n" not in answer:
            chunk = conn.recv(4096)
            if not chunk:
                break
            answer += chunk
    return answer.split(b"\r\n", 1)[0]


@pytest.mark.parametrize(("length", "status"), [
    ("-1", b"400"), ("12abc", b"400"), (str(10**12), b"413"), (str(64 * 1024 + 1), b"413"),
])
def test_gateway_refuses_a_bad_or_huge_content_length_before_reading(
    gateway: GatewayServer, length: str, status: bytes
) -> None:
    """Catches: the sandbox gateway reading whatever ``Content-Length`` says (a negative one
    reads to EOF, a huge one holds the thread and the memory) instead of refusing it."""
    request = (f"POST /charges HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"Content-Length: {length}\r\n\r\n").encode() + b'{"reference": "r"'
    line = _raw_http(gateway.port, request)
    assert line.split()[1] == status, line
    assert gateway.charges() == []


def test_gateway_admin_requires_its_token(gateway: GatewayServer) -> None:
    """Catches: ``/_admin`` open to any local user (read every charge, inject faults, wipe
    the ledger)."""
    pool = urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(connect=2, read=5))
    gateway.ledger.charge(reference="r1", amount_cents=1, currency="EUR", idempotency_key="k",
                          correlation_id=None, honour_key=True)
    for method, path in (("GET", "/_admin/charges"), ("POST", "/_admin/reset"),
                         ("POST", "/_admin/faults")):
        body = b'{"error_rate": 1.0}' if method == "POST" else None
        for headers in ({}, {"Authorization": "Bearer nope"}):
            answer = pool.request(method, gateway.url + path, body=body, headers=headers)
            assert answer.status == 401, (method, path, headers)
    assert len(gateway.charges()) == 1 and gateway.faults_snapshot().error_rate == 0.0
    good = pool.request("POST", gateway.url + "/_admin/faults", body=b'{"error_rate": 0.5}',
                        headers={"Authorization": f"Bearer {gateway.admin_token}"})
    assert good.status == 200 and gateway.faults_snapshot().error_rate == 0.5
    assert pool.request("GET", gateway.url + "/healthz").status == 200
    pool.clear()


_PARTIAL_REQUESTS = {
    "request line": b"POST /charg",
    "headers": b"POST /charges HTTP/1.1\r\nHost: x\r\nContent-Type: appl",
    "body": (b"POST /charges HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             b"Content-Length: 100\r\n\r\n{\"reference\": \"r\""),
}


def test_sandbox_http_stand_ins_disconnect_a_half_sent_request_within_the_read_bound(
    gateway: GatewayServer,
) -> None:
    """Catches: a sandbox HTTP stand-in (the gateway, the webhook receiver) with no read
    timeout, where a client that sends half a request (its request line, its headers or its
    body) holds a handler thread and a socket forever. Each is disconnected once the shared
    bound (:data:`sandbox.http_server.READ_TIMEOUT_S`) has passed, while other requests are
    answered meanwhile, and nothing half-sent is charged."""
    assert READ_TIMEOUT_S > 0
    with WebhookReceiver(b"k" * 32) as receiver:
        for server in (gateway, receiver):
            assert server.handler.timeout == READ_TIMEOUT_S
        pool = urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(connect=2, read=5))
        held = []
        try:
            for server in (gateway, receiver):
                for part in _PARTIAL_REQUESTS.values():
                    conn = socket.create_connection(("127.0.0.1", server.port), timeout=5)
                    conn.sendall(part)
                    held.append(conn)
            for server in (gateway, receiver):
                assert pool.request("GET", server.url + "/healthz").status == 200
            for conn in held:
                conn.settimeout(READ_TIMEOUT_S + 30)  # generous: the bound plus a busy machine
                assert conn.recv(4096) == b"", "a half-sent request got an answer"
        finally:
            for conn in held:
                conn.close()
            pool.clear()
    assert gateway.charges() == []


class _HugeAnswer(http.server.BaseHTTPRequestHandler):
    """Answers every request 200 with a valid JSON body of 8 MiB (a broken or hostile
    provider)."""

    protocol_version = "HTTP/1.1"

    def _answer(self) -> None:
        body = b'{"charges": [], "pad": "' + b"x" * (8 * 1024 * 1024) + b'"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if self.path.endswith("declared"):
            self.send_header("Content-Length", str(len(body)))
        else:
            self.close_connection = True  # the body ends when the connection does
        self.end_headers()
        with contextlib.suppress(OSError):
            self.wfile.write(body)

    do_GET = _answer  # noqa: N815 - http.server naming
    do_POST = _answer  # noqa: N815

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.mark.parametrize("declared", [True, False])
def test_payment_client_bounds_the_answers_size(declared: bool) -> None:
    """Catches: the payment client reading an answer of any size into memory (it bounded the
    time only): an 8 MiB answer, with or without ``Content-Length``, is refused."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HugeAnswer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    client = HttpPaymentGateway(f"http://127.0.0.1:{server.server_address[1]}",
                                timeout=5, deadline=30)
    try:
        reference = "declared" if declared else "streamed"
        with pytest.raises(GatewayUnavailable, match="over 1048576"):
            client.find_charges(reference)
        with pytest.raises(GatewayUnavailable, match="over 1048576") as charged:
            client.charge(reference=reference, amount_cents=1, currency="EUR",
                          idempotency_key="k")
        assert charged.value.maybe_charged
    finally:
        client.close()
        server.shutdown()
        server.server_close()


# -- sekali cluster: the state it trusts, what it prints and writes ----------------------------


def test_cluster_refuses_a_state_file_another_user_could_have_written(tmp_path: Path) -> None:
    """Catches: ``sekali cluster`` (root) trusting a ``state.json`` that another local user
    owns or may write, and then signalling the pids and deleting the links it names."""
    folder = tmp_path / "cluster"
    folder.mkdir(mode=0o700)
    state = folder / "state.json"
    write_private(state, json.dumps({"version": 1, "processes": [{"pid": 1}]}))
    assert Cluster(folder).exists  # owned by us, 0600: trusted
    state.chmod(0o666)
    with pytest.raises(ClusterError, match="written by others"):
        Cluster(folder)
    state.chmod(0o600)
    folder.chmod(0o777)
    with pytest.raises(ClusterError, match="written by others"):
        Cluster(folder)
    folder.chmod(0o700)
    if os.geteuid() == 0:
        os.chown(state, 65534, 65534)
        with pytest.raises(ClusterError, match="owned by uid 65534"):
            Cluster(folder)
        os.chown(state, 0, 0)
    state.unlink()
    state.symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(ClusterError, match="not a regular file"):
        Cluster(folder)


def test_cluster_service_user_reaches_its_interpreter_not_the_folder_above(
    tmp_path: Path,
) -> None:
    """Catches: the cluster's services, run as an unprivileged user, unable to start because
    their interpreter lives under a 0700 folder (pyenv under ``/root``), or that folder opened to
    every local user (chmod) to let them in: they reach the one name they need, in their own
    mount namespace, and can neither list the folder nor read what else is in it."""
    if os.geteuid() != 0:
        pytest.skip("creates the service user and mounts: needs root (CI runs as root)")
    user = ensure_service_user()
    top = Path(tempfile.mkdtemp(prefix="sekali-reveal-", dir="/tmp"))  # nosec B108: mkdtemp
    try:
        top.chmod(0o755)
        home = top / "home"
        (home / "tools").mkdir(parents=True)
        home.chmod(0o700)
        (home / "tools").chmod(0o755)
        (home / "secret").write_text("root's\n")
        (home / "secret").chmod(0o644)
        tool = home / "tools" / "hello"
        tool.write_text("#!/bin/sh\necho hello\n")
        tool.chmod(0o755)
        holder = top / "mnt"
        holder.mkdir(mode=0o700)
        reveal = plan_reveal([tool], user, holder)
        assert dict(reveal.folders) == {str(home): ["tools"]}
        probe = (f"{tool}; ls {home} >/dev/null 2>&1 && echo listed; "
                 f"cat {home / 'secret'} 2>/dev/null; true")
        done = subprocess.run(
            ["unshare", "--mount", "--propagation", "slave", "--",
             "sh", "-c", reveal.script() + 'exec "$@"', "sh",
             "setpriv", f"--reuid={user.pw_name}", f"--regid={user.pw_name}", "--init-groups",
             "--", "sh", "-c", probe],
            capture_output=True, text=True, timeout=30, check=False,
        )
        assert (done.returncode, done.stdout) == (0, "hello\n"), done.stderr
        assert _mode(home) == 0o700 and not list(holder.iterdir())  # the machine's copy
        (home / "tools").chmod(0o700)  # a second closed folder on the way: refused, named
        with pytest.raises(ClusterError, match=f"{home / 'tools'} is not searchable"):
            plan_reveal([tool], user, holder)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_cluster_output_never_holds_a_password() -> None:
    """Catches: ``cluster up/status --json`` printing the database and Redis passwords (the
    environment it reports carries every URL)."""
    env = {"DATABASE_URL": "postgresql+psycopg://sekali:pw1secret@10.0.0.10:5432/sekali",
           "REDIS_URL": "redis://:pw2secret@10.0.0.10:6379/0",
           "DAGSTER_PG_URL": "postgresql+psycopg2://dagster:pw3secret@10.0.0.10:5432/dagster",
           "SEKALI_API_TOKEN": "pw4secret", "SEKALI_SMTP_PORT": "8025"}
    shown = json.dumps(_without_secrets(env))
    assert "secret" not in shown
    assert _without_secrets(env)["SEKALI_SMTP_PORT"] == "8025"
    assert _without_secrets(env)["REDIS_URL"] == "redis://:***@10.0.0.10:6379/0"


def test_redis_benchmark_never_gets_the_servers_password_on_its_command_line(
    tmp_path: Path,
) -> None:
    """Catches: the cluster benchmark's capacity run giving redis-benchmark the store Redis's
    password as ``-a`` (``/proc/<pid>/cmdline`` is world-readable; redis-benchmark reads no
    ``REDISCLI_AUTH``). It authenticates as a user made for the run, allowed the benchmark's
    commands on its keys only, and gone when the run ends."""
    server = RedisServer(tmp_path / "r", port=free_port()).start()
    started: list[list[str]] = []

    def run(argv: list[str]) -> str:
        started.append(list(argv))
        return subprocess.run(argv, capture_output=True, text=True, timeout=300,
                              check=True).stdout

    admin = server.plain(socket_timeout=30)
    try:
        rates = redis_capacity(admin, run, host="127.0.0.1", port=int(server.port or 0),
                               requests=2000)
        assert server.password and len(started) == 2
        assert all(server.password not in " ".join(argv) for argv in started)
        for command in ("set", "get", "incr", "eval"):
            assert rates[f"redis_{command}_per_second"] > 0, rates
        assert admin.acl_users() == ["default"]
    finally:
        admin.close()
        server.stop()


def test_out_reports_are_written_0600(tmp_path: Path) -> None:
    """Catches: ``--out`` reports (cluster status with its hosts, DLQ listings with personal
    data) written 0644, readable by every local user, even over an existing 0644 file."""
    fresh, existing = tmp_path / "fresh.json", tmp_path / "existing.json"
    existing.write_text("{}")
    existing.chmod(0o644)
    for out in (fresh, existing):
        args = argparse.Namespace(out=out, json=True)
        with contextlib.redirect_stdout(io.StringIO()):
            assert emit(args, {"a": 1}, lambda: None) == 0
        assert _mode(out) == 0o600 and json.loads(out.read_text()) == {"a": 1}


# -- state and data files ------------------------------------------------------------------------


def test_sqlite_files_and_state_folders_are_private(tmp_path: Path, gateway: GatewayServer,
                                                    sink: MailSink) -> None:
    """Catches: SQLite files holding requests, dead letters, charges and mails created 0644
    (umask 022) in world-readable folders; the state folder and its lock readable by all."""
    database = Database.from_url(f"sqlite:///{tmp_path / 'state' / 'app.db'}")
    try:
        upgrade(database)
    finally:
        database.dispose()
    assert _mode(tmp_path / "state") == 0o700
    files = [tmp_path / "state" / name for name in ("app.db", "app.db-wal", "app.db-shm")]
    files += [tmp_path / "gateway.db", tmp_path / "mail.db"]
    found = {path.name: _mode(path) for path in files if path.exists()}
    assert {"app.db", "gateway.db", "mail.db"} <= set(found)
    assert set(found.values()) == {0o600}, found
    lock = InstanceLock([tmp_path / "dev-state"]).acquire()
    try:
        assert _mode(tmp_path / "dev-state") == 0o700
        assert _mode(tmp_path / "dev-state" / "dev.lock") == 0o600
    finally:
        lock.release()
