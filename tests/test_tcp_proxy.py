"""The chaos harness's failover proxy (sandbox/tcp_proxy.py): bytes pass both ways, a retarget
resets open connections, and a connection idle past the proxy's deadline is closed at both ends
instead of holding a thread and two sockets forever."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import pytest

from sandbox.tcp_proxy import TcpProxy


@pytest.fixture
def silent_server() -> Iterator[tuple[int, list[socket.socket]]]:
    """A server that accepts and never answers (a frozen target)."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            accepted.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    yield int(listener.getsockname()[1]), accepted
    listener.close()
    for conn in accepted:
        conn.close()


def test_an_idle_connection_is_closed_by_the_proxy_deadline(
    silent_server: tuple[int, list[socket.socket]],
) -> None:
    port, _ = silent_server
    proxy = TcpProxy(port, idle_timeout=0.2).start()
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=5) as client:
            client.settimeout(60)  # a generous guard: the proxy must close first
            client.sendall(b"PING\r\n")
            assert client.recv(16) == b""  # EOF: the proxy ended the idle pipe
    finally:
        proxy.stop()


def test_bytes_pass_and_a_retarget_resets_open_connections() -> None:
    echo = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = echo.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(1024):
                    conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    proxy = TcpProxy(int(echo.getsockname()[1])).start()
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as client:
            client.sendall(b"hello")
            assert client.recv(16) == b"hello"
            proxy.retarget(int(echo.getsockname()[1]))
            with contextlib.suppress(ConnectionResetError):  # a reset or EOF: both end it
                assert client.recv(16) == b""
        assert proxy.retargets == 1
    finally:
        proxy.stop()
        echo.close()
