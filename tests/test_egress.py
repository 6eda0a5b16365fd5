"""Where outbound calls may go (:mod:`resources.egress`), proven without a packet leaving this
machine: every test here that names a private, link-local, metadata or public address runs
under a **socket guard** (``socket.socket.connect`` replaced: every connect to an address
outside loopback is refused before the kernel sees it), an **HTTP guard** (urllib3's
``create_connection`` replaced: an HTTP client's connect is recorded and, where the test says
so, refused, so not even a loopback service is reached) and a **resolver the test controls**
(``socket.getaddrinfo`` replaced: the names below answer what the test says; anything else is
parsed as a numeric address only, never looked up). So even a broken client under test reaches
nothing but this test's own loopback server.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import urllib3.util.connection

from engine.runtime import execute_request
from pipelines.jobs.webhook import WebhookClient
from resources.egress import EgressPolicy, EgressRefused, allow_list, refused_by
from resources.http import BoundedHttp, HttpUnreachable
from resources.retry import ErrorClass, classify
from resources.storage.db import Database
from tests.test_webhook import endpoint_keys, services_for

PUBLIC = "1.1.1.1"  # named as a resolver's answer only: the guard refuses every connect to it
_REAL_GETADDRINFO = socket.getaddrinfo
_REAL_CONNECT = socket.socket.connect
_REAL_CREATE = urllib3.util.connection.create_connection


class Guard:
    """The socket guard and the resolver of one test (see the module)."""

    def __init__(self) -> None:
        self.names: dict[str, Callable[[], list[str]]] = {}
        self.connects: list[tuple[str, int]] = []
        self.http_connects: list[tuple[str, int]] = []
        self.lookups: list[str] = []
        self.http_blocked = True

    def getaddrinfo(self, host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else str(host)
        if name in self.names:
            self.lookups.append(name)
            return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                     (a, int(port or 0))) for a in self.names[name]()]
        flags = kwargs.pop("flags", 0) | socket.AI_NUMERICHOST  # never a DNS query
        return _REAL_GETADDRINFO(host, port, *args, flags=flags, **kwargs)

    def connect(self, sock: socket.socket, address: Any) -> None:
        if isinstance(address, tuple):
            where = (str(address[0]), int(address[1]))
            self.connects.append(where)
            if where[0] not in ("127.0.0.1", "::1"):
                raise ConnectionRefusedError(f"socket guard: no connect to {where}")
        _REAL_CONNECT(sock, address)

    def create_connection(self, address: Any, *args: Any, **kwargs: Any) -> socket.socket:
        self.http_connects.append((str(address[0]), int(address[1])))
        if self.http_blocked:
            raise ConnectionRefusedError(f"HTTP guard: no connect to {address}")
        return _REAL_CREATE(address, *args, **kwargs)


@pytest.fixture
def guard(monkeypatch: pytest.MonkeyPatch) -> Iterator[Guard]:
    g = Guard()
    monkeypatch.setattr(socket, "getaddrinfo", g.getaddrinfo)
    monkeypatch.setattr(socket.socket, "connect",
                        lambda sock, address: g.connect(sock, address))
    monkeypatch.setattr(urllib3.util.connection, "create_connection", g.create_connection)
    monkeypatch.delenv("SEKALI_EGRESS_ALLOW", raising=False)
    monkeypatch.delenv("SEKALI_EGRESS_PROXY", raising=False)
    yield g


class _Counting(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hits: list[str]

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _answer(self) -> None:
        self.hits.append(self.path)
        data = b'{"secret": "internal answer"}'
        self.send_response(403)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer  # noqa: N815


@pytest.fixture
def internal() -> Iterator[tuple[ThreadingHTTPServer, list[str]]]:
    """A loopback HTTP server standing for an internal service; ``hits`` counts what reached it."""
    hits: list[str] = []
    handler = type("Handler", (_Counting,), {"hits": hits})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, hits
    server.shutdown()
    server.server_close()


SSRF = [
    ("http://127.0.0.1:6379/", "loopback"),
    ("http://[::1]:5432/", "loopback"),
    ("http://169.254.169.254/latest/meta-data/iam/security-credentials/", "link-local"),
    ("http://localhost:3000/graphql", "loopback"),
    ("http://0/", "unspecified"),
    ("http://0.0.0.0:8080/", "unspecified"),
    ("http://2130706433:8766/", "loopback"),
    ("http://0177.0.0.1/", "loopback"),
    ("http://10.1.2.3/", "private"),
    ("http://172.16.0.9/", "private"),
    ("http://192.168.1.1/", "private"),
    ("http://100.64.0.1/", "cgnat"),
    ("http://[fd12:3456::1]/", "ula"),
    ("http://[fe80::1]/", "link-local"),
    ("http://[::ffff:127.0.0.1]/", "ipv4-mapped"),
    ("http://[64:ff9b::a9fe:a9fe]/", "ipv4-embedded"),
    ("http://224.0.0.1/", "multicast"),
    ("http://internal.test/", "private"),
    ("http://loopback.test:8766/hooks/x?token=abc", "loopback"),
    ("http://mixed.test/", "loopback"),
    ("http://public.test:6379/", "port"),
]


def _names(guard: Guard) -> None:
    guard.names.update({
        "localhost": lambda: ["127.0.0.1"],
        "internal.test": lambda: ["10.20.30.40"],
        "loopback.test": lambda: ["127.0.0.1"],
        "mixed.test": lambda: [PUBLIC, "127.0.0.1"],  # a public and a loopback answer
        "public.test": lambda: [PUBLIC],
    })


@pytest.mark.parametrize(("url", "rule"), SSRF, ids=[u for u, _ in SSRF])
def test_every_internal_destination_is_refused_before_any_connection(
    guard: Guard, db: Database, db_url: str, redis_url: str, namespace: str,
    redis_client: Any, url: str, rule: str,
) -> None:
    """Regression caught: a payload's ``url`` naming Redis, Postgres, the metadata service, the
    Dagster UI, a private address, or a name resolving to one was called. Each is refused by
    the delivery before any connect (the guard saw none), permanent, naming the rule; the
    error keeps no query string."""
    _names(guard)
    services = services_for(db_url, redis_url, namespace,
                            webhooks=WebhookClient(BoundedHttp(timeout=1.0, deadline=2.0),
                                                   endpoint_keys))
    payload = {"endpoint_id": "ep-1", "url": url, "event_id": "evt-ssrf",
               "event_type": "order.paid", "data": {}}
    with pytest.raises(EgressRefused) as refused:
        execute_request("deliver_webhook", payload, services=services)
    assert guard.http_connects == []
    assert refused.value.rule == rule and f"({rule})" in str(refused.value)
    assert classify(refused.value) is ErrorClass.PERMANENT
    assert "token=abc" not in str(refused.value)


def test_a_name_that_rebinds_between_calls_never_reaches_the_internal_address(
    guard: Guard, internal: tuple[ThreadingHTTPServer, list[str]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DNS rebinding: ``rebind.test`` answers a public address the first time and loopback (an
    internal service) from then on. Regression caught: the client resolved again for each
    call (or between check and connect) and its second call reached the internal service.
    The client resolves once per call and connects to the address it checked: the first call
    goes to the public address (refused by the guard: nothing leaves), the second is refused
    as loopback before a connect; the internal service sees nothing."""
    server, hits = internal
    port = server.server_address[1]
    answers = iter([[PUBLIC]])
    guard.names["rebind.test"] = lambda: next(answers, ["127.0.0.1"])
    guard.http_blocked = False
    monkeypatch.setenv("SEKALI_EGRESS_ALLOW", PUBLIC)  # the "public" address, on any port
    http = BoundedHttp(timeout=1.0, deadline=2.0)
    url = f"http://rebind.test:{port}/hooks/ep-1"
    for _ in range(2):
        with pytest.raises((HttpUnreachable, EgressRefused)):
            http.request("POST", url, body=b"{}")
    assert hits == []
    assert (PUBLIC, port) in guard.connects and ("127.0.0.1", port) not in guard.connects
    with pytest.raises(EgressRefused, match="loopback"):
        http.request("GET", url)


def test_no_answer_body_reaches_an_error(
    guard: Guard, internal: tuple[ThreadingHTTPServer, list[str]], db: Database, db_url: str,
    redis_url: str, namespace: str, redis_client: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression caught: a non-2xx answer's first 300 bytes went into ``WebhookRejected``, and
    from there into the DLQ, the attempts and the run log: an internal service's answer could
    be read back. The error holds its status, size and hash only."""
    server, hits = internal
    port = server.server_address[1]
    guard.http_blocked = False
    monkeypatch.setenv("SEKALI_EGRESS_ALLOW", f"127.0.0.1:{port}")
    services = services_for(db_url, redis_url, namespace,
                            webhooks=WebhookClient(BoundedHttp(timeout=1.0, deadline=2.0),
                                                   endpoint_keys))
    payload = {"endpoint_id": "ep-1", "url": f"http://127.0.0.1:{port}/x", "event_id": "e",
               "event_type": "order.paid", "data": {}}
    with pytest.raises(Exception) as rejected:
        execute_request("deliver_webhook", payload, services=services)
    assert hits == ["/x"]
    assert "internal answer" not in str(rejected.value) and "403" in str(rejected.value)
    assert "sha256" in str(rejected.value)


def test_plain_http_is_refused_unless_the_endpoint_or_the_allow_list_allows_it(
    guard: Guard, db: Database,
) -> None:
    """https is required: a plain-http destination is refused (rule ``https``) unless the
    allow-list names it; the rule is checked before any connect."""
    guard.names["customer.test"] = lambda: [PUBLIC]
    policy = EgressPolicy()
    with pytest.raises(EgressRefused) as plain:
        policy.check("http://customer.test/hook", 1.0, require_tls=True)
    assert plain.value.rule == "https"
    assert policy.check("https://customer.test/hook", 1.0, require_tls=True).address == PUBLIC
    allowed = EgressPolicy.from_env({"SEKALI_EGRESS_ALLOW": "customer.test:80"})
    assert allowed.check("http://customer.test/hook", 1.0, require_tls=True).allowed
    assert guard.http_connects == []


def test_a_hung_resolver_costs_the_call_its_deadline_not_more(guard: Guard) -> None:
    """DNS inside the deadline: a resolver that never answers fails the call (transient, nothing
    sent) once the client's bound has passed."""
    release = threading.Event()

    def hang() -> list[str]:
        release.wait(10)
        return [PUBLIC]

    guard.names["slow.test"] = hang
    http = BoundedHttp(timeout=0.3, deadline=0.5)
    try:
        with pytest.raises(HttpUnreachable, match="did not resolve within"):
            http.request("GET", "https://slow.test/")
    finally:
        release.set()
    assert guard.http_connects == []


def test_the_allow_list_and_the_rules_read_as_documented() -> None:
    """Entries: an address and port, a network, an IPv6 address and port, a host name; a bad
    port names the variable. Every forbidden range names its rule; a public address passes."""
    import ipaddress

    entries = EgressPolicy.from_env(
        {"SEKALI_EGRESS_ALLOW": "127.0.0.1:8766, 10.0.0.0/8 [::1]:8765 Relay.Internal:8443"}
    ).allow
    assert [(str(e.network) if e.network else e.name, e.port) for e in entries] == [
        ("127.0.0.1/32", 8766), ("10.0.0.0/8", None), ("::1/128", 8765),
        ("relay.internal", 8443)]
    with pytest.raises(ValueError, match="SEKALI_EGRESS_ALLOW"):
        EgressPolicy.from_env({"SEKALI_EGRESS_ALLOW": "127.0.0.1:99999"})
    assert refused_by(ipaddress.ip_address(PUBLIC)) is None
    assert refused_by(ipaddress.ip_address("2606:4700::1111")) is None
    assert allow_list(["http://127.0.0.1:8765", "http://[::1]:8766/x"], {}) == (
        "127.0.0.1:8765,[::1]:8766")


def test_a_lookup_for_a_customer_url_is_refused_from_the_operators_cli(
    guard: Guard, db: Database,
) -> None:
    """``sekali dlq replay --dry-run`` ran the signed lookup GET against each record's URL from
    wherever the operator's CLI ran. The CLI's lookup clients refuse a downstream whose
    destinations come from payloads: the verdict is ``unknown`` and nothing is connected."""
    from engine.replay import lookup_client
    from pipelines.jobs.webhook import lookup

    guard.names["customer.test"] = lambda: [PUBLIC]
    client = lookup_client(on_worker=False)
    with pytest.raises(LookupError, match="workers"):
        lookup(client, "webhook:ep-1:e", {"endpoint_id": "ep-1",
                                          "url": "https://customer.test/h"})
    assert guard.http_connects == []
