"""A loopback TCP proxy whose target can be switched: the address clients keep while a server
behind it is replaced (a failover).

Clients connect to ``proxy.port``; each connection is piped to the current target. ``retarget``
points new connections at another port and closes every connection that is open, so a client
sees its connection reset and reconnects, now to the new target: what a client of a Redis
failover behind a virtual IP or a Sentinel-aware proxy sees.

Every socket has a deadline: ``CONNECT_TIMEOUT`` to reach the target, and ``idle_timeout`` on
each read and write afterwards. A connection that carries nothing in one direction for that long
(a peer gone without a FIN, a target frozen past any client's own deadline) is closed at both
ends, as a production proxy's client/server timeouts do, so no thread or socket is held forever.
The default is longer than any blocking call the chaos run makes through it.
"""

from __future__ import annotations

import contextlib
import socket
import threading

CONNECT_TIMEOUT = 2.0
IDLE_TIMEOUT = 600.0


class TcpProxy:
    """Thread-per-connection proxy on 127.0.0.1; ``start``, ``retarget``, ``stop``."""

    def __init__(self, target_port: int, *, idle_timeout: float = IDLE_TIMEOUT) -> None:
        self.target_port = target_port
        self.idle_timeout = idle_timeout
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._closed = False
        self.retargets = 0

    def start(self) -> TcpProxy:
        self._listener.listen(128)
        threading.Thread(target=self._accept, name="tcp-proxy", daemon=True).start()
        return self

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                port = self.target_port
            try:
                upstream = socket.create_connection(("127.0.0.1", port), timeout=CONNECT_TIMEOUT)
                upstream.settimeout(self.idle_timeout)
                client.settimeout(self.idle_timeout)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._closed:
                    client.close()
                    upstream.close()
                    return
                self._open.update((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            self._close(s)

    def _close(self, s: socket.socket) -> None:
        with self._lock:
            self._open.discard(s)
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            s.close()

    def retarget(self, port: int) -> None:
        """New connections go to ``port``; every open one is closed (the clients reconnect)."""
        with self._lock:
            self.target_port = port
            self.retargets += 1
            live = list(self._open)
        for s in live:
            self._close(s)

    def stop(self) -> None:
        with self._lock:
            self._closed = True
            live = list(self._open)
        with contextlib.suppress(OSError):
            self._listener.close()
        for s in live:
            self._close(s)
