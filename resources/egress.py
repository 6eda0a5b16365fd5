"""Where an outbound HTTP call may go: the destination rules every client that
:mod:`resources.http` builds applies before it opens a connection.

A URL a payload names (a customer's webhook endpoint) is chosen by someone outside; without
rules, a worker would call whatever it names: Redis on loopback, the cloud's metadata service,
the Dagster UI, a database on the private network. So, for every call:

1. **Static checks** on the URL: ``http`` or ``https`` with a host, no credentials; the port
   must be 80 or 443 unless an allow-list entry names it.
2. **Resolve first, within the call's deadline**: the host (a name, a dotted quad, or the
   shorthands ``0``, ``2130706433``, ``0177.0.0.1`` that ``getaddrinfo`` also reads) is resolved
   once, on a small pool of threads, waiting at most what is left of the deadline (a resolver
   that hangs costs the call its deadline, never more).
3. **Every address it resolves to is checked**; one forbidden address refuses the call (a name
   that answers a public and a loopback address is refused, not tried in turn). Refused, by
   rule: ``unspecified`` (0.0.0.0, ::), ``loopback``, ``link-local`` (169.254.0.0/16 with the
   metadata service, fe80::/10), ``multicast``, ``cgnat`` (100.64.0.0/10), ``ula``
   (fc00::/7), ``ipv4-mapped`` and ``ipv4-embedded`` (::ffff:0:0/96, 64:ff9b::/96, 2002::/16:
   an IPv4 address in IPv6 clothes), ``private`` (10/8, 172.16/12, 192.168/16 and the other
   non-public ranges), ``reserved`` and, last, ``not-global`` for anything else that is not a
   public address.
4. **The connection goes to the address that was checked** (:mod:`resources.http` pins it), so
   a name cannot answer a public address to the check and a private one to the connect (DNS
   rebinding). TLS still verifies the certificate against the host name.

An allow-list (``SEKALI_EGRESS_ALLOW``, comma- or space-separated) lets the operator name
destinations the rules would refuse: ``127.0.0.1:8766`` (one address and port), ``10.0.0.0/8``
(a network, any port), ``[::1]:8765``, ``relay.internal:8443`` (a host name as the URL writes
it: whatever it resolves to). An entry without a port allows every port. ``sekali dev`` allows
its sandbox stand-ins this way, ``sekali cluster`` its provider host, the tests loopback. An
allowed destination may also be plain ``http`` where a client requires ``https``
(:attr:`Destination.allowed`).

With ``SEKALI_EGRESS_PROXY`` set (an egress proxy such as smokescreen, ``http://proxy:4750``),
calls go through it (CONNECT for https) and the proxy resolves and filters names by its own
rules; sekali still applies the static checks and refuses an address literal the rules forbid.

A refusal is :class:`EgressRefused`: permanent (the destination will not become allowed by
retrying), naming the rule and the URL without its query.
"""

from __future__ import annotations

import concurrent.futures
import ipaddress
import os
import socket
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from resources.errors import PermanentJobError, TransientJobError

ALLOW_ENV = "SEKALI_EGRESS_ALLOW"
PROXY_ENV = "SEKALI_EGRESS_PROXY"
STANDARD_PORTS = frozenset({80, 443})

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], list[str]]
"""``resolve(host, port)`` -> the addresses (text) ``host`` has; raises ``OSError`` when none."""

_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_ULA = ipaddress.ip_network("fc00::/7")
_EMBEDDED = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"),
             ipaddress.ip_network("2002::/16"))


class EgressRefused(PermanentJobError):
    """The destination is one this process may not call (``rule`` says which rule refused it).
    Permanent: kept in the DLQ, never retried. If the destination is right (an internal service
    you mean to call), name it in ``SEKALI_EGRESS_ALLOW``; otherwise fix the URL and replay."""

    def __init__(self, url: str, rule: str, detail: str) -> None:
        super().__init__(f"egress refused ({rule}): {url}: {detail}")
        self.rule = rule
        self.url = url


class EgressUnresolved(TransientJobError):
    """The destination's name did not resolve within the call's deadline (no answer, or no
    address): nothing was sent. Retried with backoff; check the name if it lasts."""


def shown_url(url: str) -> str:
    """A URL as errors name it: scheme, host and path; the query (tokens) and fragment left out,
    at most 200 characters."""
    return url.split("?", 1)[0].split("#", 1)[0][:200]


def refused_by(address: Address) -> str | None:
    """The rule that forbids ``address`` as a destination, or None for a public address."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return "ipv4-mapped"
        if any(address in net for net in _EMBEDDED):
            return "ipv4-embedded"
    checks: tuple[tuple[str, bool], ...] = (
        ("unspecified", address.is_unspecified),
        ("loopback", address.is_loopback),
        ("link-local", address.is_link_local),
        ("multicast", address.is_multicast),
        ("cgnat", address in _CGNAT),
        ("ula", address in _ULA),
        ("private", address.is_private),
        ("reserved", address.is_reserved),
        ("not-global", not address.is_global),
    )
    return next((rule for rule, hit in checks if hit), None)


@dataclass(frozen=True)
class AllowEntry:
    """One allow-list entry: a network or a host name, with a port or any port."""

    network: ipaddress.IPv4Network | ipaddress.IPv6Network | None
    name: str | None
    port: int | None

    @classmethod
    def parse(cls, text: str) -> AllowEntry:
        raw = text.strip()
        host, port = raw, None
        if raw.startswith("["):
            inner, _, rest = raw[1:].partition("]")
            host = inner
            if rest.startswith(":"):
                port = _port(rest[1:], raw)
        elif raw.count(":") == 1:
            host, _, given = raw.partition(":")
            port = _port(given, raw)
        if not host:
            raise ValueError(f"{ALLOW_ENV}: {raw!r} names no host")
        try:
            return cls(ipaddress.ip_network(host, strict=False), None, port)
        except ValueError:
            return cls(None, host.lower().rstrip("."), port)

    def matches(self, host: str, port: int, address: Address | None) -> bool:
        if self.port is not None and self.port != port:
            return False
        if self.name is not None:
            return self.name == host.lower().rstrip(".")
        return address is not None and self.network is not None and address in self.network


def _port(text: str, entry: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"{ALLOW_ENV}: {entry!r}: the port must be 1-65535")
    return int(text)


@dataclass(frozen=True)
class Destination:
    """Where a checked call goes: ``address`` is what the connection is pinned to (None through
    a proxy, which resolves); ``allowed`` when an allow-list entry named it."""

    scheme: str
    host: str
    port: int
    address: str | None
    allowed: bool


_POOL_LOCK = threading.Lock()
_POOL: concurrent.futures.ThreadPoolExecutor | None = None


def _resolver_pool() -> concurrent.futures.ThreadPoolExecutor:
    """A few threads for ``getaddrinfo`` (which takes no timeout): a hung lookup holds one of
    them, never the caller past its deadline."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="sekali-dns")
        return _POOL


def system_resolver(host: str, port: int) -> list[str]:
    """The system's answer for ``host`` (``getaddrinfo``, TCP), in its order."""
    found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]).split("%", 1)[0] for info in found))


@dataclass(frozen=True)
class EgressPolicy:
    """The rules of the module, with an allow-list, an optional proxy and a resolver (the
    system's unless a test gives its own)."""

    allow: tuple[AllowEntry, ...] = ()
    proxy: str | None = None
    resolver: Resolver = field(default=system_resolver, compare=False)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> EgressPolicy:
        """``SEKALI_EGRESS_ALLOW`` and ``SEKALI_EGRESS_PROXY`` as set now (read when a client is
        built, never at import); a bad entry raises ``ValueError`` naming the variable."""
        env = os.environ if environ is None else environ
        return cls(allow=parse_allow(env.get(ALLOW_ENV, "")),
                   proxy=env.get(PROXY_ENV, "").strip() or None)

    def check(self, url: str, timeout: float, *, require_tls: bool = False) -> Destination:
        """The destination of ``url`` once every rule passed, resolved within ``timeout``
        seconds; :class:`EgressRefused` naming the rule, or :class:`EgressUnresolved`.
        ``require_tls``: plain ``http`` is refused (rule ``https``) unless the allow-list names
        the destination."""
        shown = shown_url(url)
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError:
            raise EgressRefused(shown, "url", "not a URL with a valid port") from None
        scheme, host = parts.scheme.lower(), (parts.hostname or "")
        if scheme not in ("http", "https") or not host:
            raise EgressRefused(shown, "scheme", "only http:// and https:// URLs with a host")
        if parts.username is not None or parts.password is not None:
            raise EgressRefused(shown, "credentials", "a URL may not carry credentials")
        port = port or (443 if scheme == "https" else 80)
        literal = _literal(host)
        named = any(e.name is not None and e.matches(host, port, None) for e in self.allow)
        if self.proxy is not None and literal is None:
            if not named and port not in STANDARD_PORTS:
                raise EgressRefused(shown, "port", f"port {port}: only 80 and 443")
            _tls(shown, scheme, require_tls and not named)
            return Destination(scheme, host, port, None, named)
        addresses = [literal] if literal is not None else self._resolve(host, port, timeout,
                                                                        shown)
        allowed = named
        for address in addresses:
            if named or any(e.matches(host, port, address) for e in self.allow):
                allowed = True
                continue
            rule = refused_by(address)
            if rule is not None:
                raise EgressRefused(shown, rule, f"{host} is {address}, a {rule} address")
        if not allowed and port not in STANDARD_PORTS:
            raise EgressRefused(shown, "port", f"port {port}: only 80 and 443 (or an entry "
                                               f"of {ALLOW_ENV})")
        _tls(shown, scheme, require_tls and not allowed)
        return Destination(scheme, host, port, str(addresses[0]), allowed)

    def _resolve(self, host: str, port: int, timeout: float, shown: str) -> list[Address]:
        future = _resolver_pool().submit(self.resolver, host, port)
        try:
            answers = future.result(timeout=max(0.0, timeout))
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise EgressUnresolved(
                f"{shown}: {host} did not resolve within {timeout:.3g}s") from None
        except OSError as exc:
            raise EgressUnresolved(f"{shown}: {host} does not resolve: "
                                   f"{type(exc).__name__}") from None
        out: list[Address] = []
        for answer in answers:
            try:
                out.append(ipaddress.ip_address(answer))
            except ValueError:
                raise EgressRefused(shown, "resolver", f"{host} resolved to "
                                                       f"{answer[:60]!r}") from None
        if not out:
            raise EgressUnresolved(f"{shown}: {host} has no address")
        return out


def _tls(shown: str, scheme: str, required: bool) -> None:
    if required and scheme != "https":
        raise EgressRefused(shown, "https", "plain http to this destination is not allowed; "
                                            "use https")


def _literal(host: str) -> Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def parse_allow(text: str) -> tuple[AllowEntry, ...]:
    """The entries of an allow-list as ``SEKALI_EGRESS_ALLOW`` writes them."""
    return tuple(AllowEntry.parse(part) for part in text.replace(",", " ").split())


def allow_list(urls: Iterable[str], environ: Mapping[str, str] | None = None) -> str:
    """``SEKALI_EGRESS_ALLOW``'s value with the address of each of ``urls`` (``host:port``)
    added to what ``environ`` (the process's by default) already allows: how ``sekali dev``, the
    chaos harness and the cluster name their stand-ins."""
    env = os.environ if environ is None else environ
    entries = env.get(ALLOW_ENV, "").replace(",", " ").split()
    for url in urls:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
        entry = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if host and entry not in entries:
            entries.append(entry)
    return ",".join(entries)


__all__ = [
    "ALLOW_ENV",
    "PROXY_ENV",
    "AllowEntry",
    "Destination",
    "EgressPolicy",
    "EgressRefused",
    "EgressUnresolved",
    "allow_list",
    "parse_allow",
    "refused_by",
    "shown_url",
    "system_resolver",
]
