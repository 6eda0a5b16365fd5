"""``sekali ui-proxy``: nothing reaches the writable Dagster UI without a login (a loopback
stand-in for the webserver records what reaches it)."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from cli.commands.ui_proxy import AuthProxy, load_users
from resources.storage.files import SecretFileUnsafe, write_private


class _Upstream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[dict[str, Any]]

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        self.seen.append({"method": self.command, "path": self.path, "body": body,
                          "headers": dict(self.headers.items())})
        data = b'{"data": "runs"}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer  # noqa: N815


def _serve(server: ThreadingHTTPServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def proxied(tmp_path: Path) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    seen: list[dict[str, Any]] = []
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), type("U", (_Upstream,), {"seen": seen}))
    _serve(upstream)
    users = write_private(tmp_path / "users", "ops:correct horse\n")
    proxy = AuthProxy(("127.0.0.1", 0), f"http://127.0.0.1:{upstream.server_address[1]}",
                      load_users(users))
    _serve(proxy)
    yield f"http://127.0.0.1:{proxy.server_address[1]}", seen
    for server in (proxy, upstream):
        server.shutdown()
        server.server_close()


def _call(url: str, *, auth: str | None = None, body: bytes | None = None) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if auth is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:  # nosec B310: loopback test
            return int(answer.status), answer.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()


def test_nothing_reaches_the_writable_ui_without_a_login(
    proxied: tuple[str, list[dict[str, Any]]],
) -> None:
    """Regression caught: the Dagster UI had no login: anyone who reached it could read payloads
    and launch runs. Without credentials, or with a wrong password, the proxy answers 401 and
    the webserver sees nothing; with them, the GraphQL POST passes with its body and without
    the password; health probes (``/server_info``) pass without one."""
    url, seen = proxied
    launch = b'{"query": "mutation { launchRun }"}'
    assert _call(f"{url}/graphql", body=launch)[0] == 401
    assert _call(f"{url}/graphql", auth="ops:wrong", body=launch)[0] == 401
    assert _call(f"{url}/graphql", auth="nobody:correct horse", body=launch)[0] == 401
    assert seen == []
    status, data = _call(f"{url}/graphql", auth="ops:correct horse", body=launch)
    assert status == 200 and data == b'{"data": "runs"}'
    [forwarded] = seen
    assert forwarded["body"] == launch and forwarded["method"] == "POST"
    assert "Authorization" not in forwarded["headers"]
    assert forwarded["headers"]["X-Forwarded-User"] == "ops"
    assert _call(f"{url}/server_info")[0] == 200


def test_a_users_file_others_can_read_is_refused(tmp_path: Path) -> None:
    """The users file holds passwords: refused unless it is this user's and 0600, by the
    command too (exit 2, one line, nothing served)."""
    users = write_private(tmp_path / "users", "ops:pw\n")
    os.chmod(users, 0o644)
    with pytest.raises(SecretFileUnsafe, match="mode 644"):
        load_users(users)
    done = subprocess.run(
        [sys.executable, "-m", "cli.main", "ui-proxy", "--listen", "127.0.0.1:0",
         "--users-file", str(users)], capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2 and "mode 644" in done.stderr
