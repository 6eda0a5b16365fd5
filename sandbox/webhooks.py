"""A local webhook receiver over real HTTP, a stand-in for customers' endpoints, that verifies
every signature and counts every delivery.

Any path is an endpoint (``/hooks/ep-1``); its records are kept in memory, per path and
``webhook-id``, for as long as the receiver runs.

- ``POST <path>``: a Standard Webhooks message (:mod:`resources.signatures`). A missing, stale
  or wrong signature is refused with 401 and counted as ``rejected``, never as a delivery. A
  good one is a delivery; with ``dedupe`` on (the default) only the first delivery of a
  ``webhook-id`` is processed (an *effect*), a repeat is answered 200 and only counted; with
  ``dedupe`` off (a receiver that ignores keys) every delivery is an effect.
- ``GET /healthz``: 200 when serving.
- ``GET <path>?webhook_id=ID``, signed as a lookup (:func:`resources.signatures.verify_lookup`:
  its own key, over ``<path>?<query>``, so a lookup's headers replayed as a POST are refused
  with 401): the lookup the sender asks before resending ``{"webhook_id", "deliveries": n,
  "effects": [{"reference", "at"}]}``.

Secrets: one key for every endpoint (``bytes``), or ``keys(endpoint_id)`` giving each
endpoint's active secrets (``sekali dev`` passes the store's,
:meth:`resources.webhook_secrets.WebhookSecrets.signing_keys`): the endpoint id is the path's
last segment, percent-decoded (``/hooks/ep-1`` is ``ep-1``).
- ``GET /_admin/deliveries``, ``GET|POST /_admin/faults``, ``POST /_admin/reset``, each with
  ``Authorization: Bearer <admin_token>`` (generated unless given; 401 without it).

A body whose ``Content-Length`` is not a byte count (400) or is over 1 MiB (413) is refused
before a byte of it is read.

Faults (changeable while running): ``status`` (answer this status to every delivery, nothing
processed) for the first ``fail_times`` deliveries of each id (0: always), with ``Retry-After``
``retry_after_s``; ``latency_ms`` (slow to process: the effect is recorded only after it,
whether or not the sender still waits); ``answer_delay_ms`` (processed at once, the answer sent
only after it: a sender that timed out does not know it was delivered); ``dedupe``.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from resources.errors import SekaliError
from resources.signatures import SignatureInvalid, verify, verify_lookup
from sandbox.http_server import FaultSet, JsonHandler, RequestRefused, ServedOnThread

log = logging.getLogger(__name__)

MAX_BODY = 1024 * 1024


@dataclass
class ReceiverFaults(FaultSet):
    """The receiver's misbehaviour, all off by default."""

    status: int | None = None
    fail_times: int = 0
    retry_after_s: float | None = None
    latency_ms: float = 0.0
    answer_delay_ms: float = 0.0
    dedupe: bool = True


@dataclass
class _Message:
    deliveries: int = 0
    failed: int = 0
    effects: list[dict[str, Any]] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)


class WebhookReceiver(ServedOnThread):
    """The receiver in-process: ``start()`` serves on a background thread, ``stop()`` ends it.
    ``key`` is the signing secret's bytes (:func:`resources.signatures.secret_bytes`), the same
    for every endpoint, or ``keys(endpoint_id)`` (see the module)."""

    thread_name = "sandbox-webhooks"

    def __init__(self, key: bytes | Callable[[str], Sequence[bytes]], *,
                 host: str = "127.0.0.1", port: int = 0,
                 tolerance: float = 300.0, admin_token: str | None = None,
                 **faults: Any) -> None:
        self.key = key
        self.admin_token = admin_token or secrets.token_hex(16)
        self.host = host
        self.port = port
        self.tolerance = tolerance
        self.faults = ReceiverFaults()
        self.faults.update(faults)
        self.rejected = 0
        self._messages: dict[tuple[str, str], _Message] = {}
        self._lock = threading.Lock()

    def endpoint(self, name: str) -> str:
        """The URL of the endpoint ``name`` on this receiver."""
        return f"{self.url}/hooks/{name}"

    def set_faults(self, **changes: Any) -> ReceiverFaults:
        with self._lock:
            self.faults.update(changes)
            return ReceiverFaults(**asdict(self.faults))

    def faults_snapshot(self) -> ReceiverFaults:
        with self._lock:
            return ReceiverFaults(**asdict(self.faults))

    def deliveries(self, webhook_id: str, path: str | None = None) -> int:
        """How many good deliveries of ``webhook_id`` arrived (every endpoint, or ``path``)."""
        with self._lock:
            return sum(m.deliveries for (p, i), m in self._messages.items()
                       if i == webhook_id and path in (None, p))

    def effects(self, webhook_id: str, path: str | None = None) -> list[dict[str, Any]]:
        """The deliveries of ``webhook_id`` the receiver acted on."""
        with self._lock:
            return [dict(e) for (p, i), m in self._messages.items()
                    if i == webhook_id and path in (None, p) for e in m.effects]

    def bodies(self, webhook_id: str) -> list[bytes]:
        with self._lock:
            return [b for (_, i), m in self._messages.items() if i == webhook_id
                    for b in m.bodies]

    def summary(self) -> dict[str, Any]:
        with self._lock:
            return {
                "rejected": self.rejected,
                "messages": [
                    {"path": p, "webhook_id": i, "deliveries": m.deliveries,
                     "failed": m.failed, "effects": len(m.effects)}
                    for (p, i), m in sorted(self._messages.items())
                ],
            }

    def keys_for(self, path: str) -> list[bytes]:
        """The secrets of the endpoint at ``path`` (none for an id the store refuses)."""
        if isinstance(self.key, bytes):
            return [self.key]
        try:
            return list(self.key(unquote(path.rstrip("/").rsplit("/", 1)[-1])))
        except SekaliError:
            return []

    def reset(self) -> None:
        with self._lock:
            self._messages.clear()
            self.rejected = 0

    def receive(self, path: str, headers: dict[str, str], body: bytes) -> tuple[int, Any, float]:
        """Handle one POST: ``(status, answer, seconds to wait before answering)``."""
        try:
            msg_id = verify(self.keys_for(path), headers, body, time.time(), self.tolerance)
        except SignatureInvalid as exc:
            with self._lock:
                self.rejected += 1
            return 401, {"error": str(exc)}, 0.0
        faults = self.faults_snapshot()
        with self._lock:
            message = self._messages.setdefault((path, msg_id), _Message())
            seen = message.deliveries + message.failed
            if faults.status is not None and (faults.fail_times == 0
                                              or seen < faults.fail_times):
                message.failed += 1
                return faults.status, {"error": "injected failure"}, 0.0
            message.deliveries += 1
            message.bodies.append(body)
            act = not (faults.dedupe and message.effects)
        if act and faults.latency_ms > 0:
            time.sleep(faults.latency_ms / 1000)
        if act:
            with self._lock:
                message.effects.append({"reference": "rcv_" + uuid.uuid4().hex[:16],
                                        "at": time.time()})
        return 200, {"ok": True, "duplicate": not act}, faults.answer_delay_ms / 1000

    def lookup(self, path: str, target: str, webhook_id: str, headers: dict[str, str]
               ) -> tuple[int, Any]:
        """Answer a lookup of ``webhook_id`` at ``path``, signed over ``target``."""
        try:
            signed = verify_lookup(self.keys_for(path), headers, target, time.time(),
                                   self.tolerance)
        except SignatureInvalid as exc:
            with self._lock:
                self.rejected += 1
            return 401, {"error": str(exc)}
        if signed != webhook_id:
            return 401, {"error": "webhook-id header does not match the id asked for"}
        with self._lock:
            message = self._messages.get((path, webhook_id), _Message())
            return 200, {"webhook_id": webhook_id, "deliveries": message.deliveries,
                         "effects": [dict(e) for e in message.effects]}


class _Handler(JsonHandler):
    def dispatch(self, method: str) -> None:
        receiver: WebhookReceiver = self.server.owner
        url = urlsplit(self.path)
        headers = {name: value for name, value in self.headers.items()}
        try:
            body = self.read_body(MAX_BODY)
            if url.path.startswith("/_admin/"):
                if not self.admin_allowed(receiver.admin_token):
                    raise RequestRefused(401, "Authorization: Bearer <admin token> required")
                self._admin(method, url.path, body)
            elif url.path == "/healthz":
                self.send_json(200, {"ok": True})
            elif method == "GET":
                webhook_id = (parse_qs(url.query).get("webhook_id") or [""])[0]
                if not webhook_id:
                    self.send_json(400, {"error": "webhook_id: query parameter required"})
                    return
                target = url.path + (f"?{url.query}" if url.query else "")
                self.send_json(*receiver.lookup(url.path, target, webhook_id, headers))
            else:
                status, answer, delay = receiver.receive(url.path, headers, body)
                if delay > 0:
                    time.sleep(delay)
                retry = receiver.faults_snapshot().retry_after_s
                extra = {"Retry-After": f"{retry:g}"} if status in (429, 503) and retry else None
                self.send_json(status, answer, extra)
        except RequestRefused as exc:
            self.send_json(exc.status, {"error": str(exc)})
        except OSError:
            log.info("webhooks: the sender went away during %s %s", method, url.path)
            self.close_connection = True
        except Exception as exc:  # noqa: BLE001 - a server answers 500, it does not die
            log.exception("webhook receiver error")
            self.send_json(500, {"error": repr(exc)})

    def _admin(self, method: str, path: str, body: bytes) -> None:
        receiver: WebhookReceiver = self.server.owner
        if path == "/_admin/deliveries" and method == "GET":
            self.send_json(200, receiver.summary())
        elif path == "/_admin/faults":
            if method == "POST":
                try:
                    receiver.set_faults(**json.loads(body or b"{}"))
                except (ValueError, TypeError) as exc:
                    self.send_json(400, {"error": str(exc)})
                    return
            self.send_json(200, asdict(receiver.faults_snapshot()))
        elif path == "/_admin/reset" and method == "POST":
            receiver.reset()
            self.send_json(200, {"ok": True})
        else:
            self.send_json(404, {"error": f"no route {method} {path}"})


WebhookReceiver.handler = _Handler


__all__ = ["ReceiverFaults", "WebhookReceiver"]
