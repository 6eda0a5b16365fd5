"""``deliver_webhook``: POST one event to one customer endpoint, signed, delivered once.

Key ``webhook:{endpoint_id}:{event_id}``. The message is signed the Standard Webhooks way
(:mod:`resources.signatures`): its ``webhook-id`` is derived from the key
(:func:`webhook_id_for`) and its body is the same bytes on every attempt, so every resend of
one intent is the same message, which receivers dedupe on. sekali does not rely on that alone:

1. **The send is written down before it goes out**: a checkpoint ``webhook_sent`` with
   ``sent_at`` on the claim, then the lease is confirmed in the store, and the client writes
   no byte once the bound that confirmation gave has passed.
2. **An unknown outcome is never resent blind.** A send that got no answer (a read timeout, a
   reset after the body went out, the deadline, 502/504 from a proxy) may have been delivered,
   and a slow receiver may act on it later. Until ``sent_at`` plus the settle window
   (``Services.settle_seconds``, longer than 0.4 of a lease plus the receiver's longest
   processing time: the send bound never passes ``sent_at`` plus 0.4 of a lease) every
   retry, redelivery or takeover raises :class:`WebhookNotSettled` (transient, ``retry_after``
   the time left). After it the endpoint is asked (:func:`lookup`, ``GET <url>?webhook_id=``,
   signed): a delivery found completes the intent; none found sends again, once. An endpoint
   that cannot be asked (404, 405 or 501 to the lookup) gets the same message again and its
   own dedupe decides; the attempt records ``lookup_unsupported``.

Failure classes: 2xx delivered; 408 and 429 transient (``Retry-After`` honoured); any other
4xx, and a 3xx (redirects are not followed), permanent: the request goes to the DLQ, never
retried; 5xx, no connection and timeouts transient; a destination the egress rules refuse
(:mod:`resources.egress`: loopback, private, link-local, ... addresses, ports other than 80 and
443, plain http) permanent, naming the rule, with nothing sent. No error holds an answer's body:
its status, size and hash only.

Each endpoint signs with its own secrets (:mod:`resources.webhook_secrets`: derived from the
deployment's key until rotated; several sign during a rotation's overlap), so a customer's
secret verifies nothing sent to another customer. The lookup is signed as its own message type
(:func:`resources.signatures.lookup_headers`).

An event without a ``url`` goes to ``<SEKALI_WEBHOOKS_URL>/hooks/<endpoint_id>`` (the id
percent-encoded, and limited to a safe alphabet anyway): the declared address (the sandbox
receiver, or a relay in front of the customers' endpoints).

Settings: ``SEKALI_WEBHOOKS_SIGNING_KEY`` (``whsec_<base64>``; never logged), or
``SEKALI_WEBHOOKS_SIGNING_KEY_FILE`` (a file only its owner may read). Unset, a key is made
once under the state folder (``webhooks/signing.key``, 0600, refused when another user owns it
or may read it) and shared by every process using that folder and by ``sekali dev``'s
receiver: fine on one machine, wrong for several hosts, so production sets one of the
variables. ``SEKALI_WEBHOOKS_URL`` (default ``http://127.0.0.1:8766``) is the declared address,
where ``sekali dev`` runs the sandbox receiver (:mod:`sandbox.webhooks`).

States (attempt status before/after): ``not_sent -> delivered``; ``not_sent ->
maybe_delivered`` (no answer) ``-> delivered`` (found, or sent again after the window).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote, urlencode, urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field

from engine import (
    SEND_TRIES,
    Calls,
    Check,
    ClientOptions,
    Concurrency,
    Downstream,
    Effect,
    FlowControl,
    JobContext,
    JobType,
    Keying,
    Presentation,
    Queue,
    Running,
    Sandbox,
    formatted,
    require_str,
)
from resources.errors import (
    NotYetSettled,
    PermanentJobError,
    SendDeadlinePassed,
    TransientJobError,
    ValidationError,
    shown,
)
from resources.headers import refuse_control
from resources.http import BoundedHttp, HttpNoAnswer, HttpUnreachable, retry_after
from resources.signatures import (
    SECRET_PREFIX,
    SigningKeyInvalid,
    lookup_headers,
    secret_bytes,
    signed_headers,
)
from resources.storage.db import shared_database
from resources.storage.files import (
    SecretFileUnsafe,
    private_folder,
    read_secret_file,
    write_private,
)
from resources.storage.settings import Settings, state_dir
from resources.webhook_secrets import WebhookSecrets, check_endpoint_id
from sandbox.webhooks import WebhookReceiver

log = logging.getLogger(__name__)

SIGNING_KEY_ENV = "SEKALI_WEBHOOKS_SIGNING_KEY"
SIGNING_KEY_FILE_ENV = "SEKALI_WEBHOOKS_SIGNING_KEY_FILE"
URL_ENV = "SEKALI_WEBHOOKS_URL"
DEFAULT_URL = "http://127.0.0.1:8766"
MAX_URL = 2048
MAX_DATA_BYTES = 64 * 1024
SENT = "webhook_sent"  # recovery point: a POST went out at data["sent_at"], outcome unknown
ANSWERED = "webhook_answered"  # recovery point: the endpoint answered that send (not 2xx)
MAYBE_DELIVERED = "maybe_delivered"
_NO_LOOKUP = frozenset({404, 405, 501})
_MAYBE_STATUSES = frozenset({502, 504})


class WebhookRejected(PermanentJobError):
    """The endpoint refused the message (a 4xx other than 408/429, or a redirect): sending the
    same message again cannot help. Fix the endpoint or its URL, then replay from the DLQ."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"webhook endpoint answered {detail}")
        self.status = status


class WebhookUnavailable(TransientJobError):
    """The endpoint did not take the message now (5xx, 408, 429, no connection, no answer).
    Retried with backoff (``retry_after`` from its ``Retry-After``). ``maybe_delivered``: the
    message went out and may have been acted on; it is looked up before it is sent again."""

    def __init__(self, message: str, *, status: int | None = None,
                 retry_after: float | None = None, maybe_delivered: bool = False) -> None:
        super().__init__(message, retry_after=retry_after)
        self.status = status
        self.maybe_delivered = maybe_delivered


class LookupUnsupported(TransientJobError):
    """The endpoint cannot be asked about a delivery (404, 405 or 501 to the signed lookup):
    the message is sent again under the same ``webhook-id`` and the receiver's dedupe decides."""


class WebhookNotSettled(NotYetSettled):
    """A send of this message got no answer and may still be acted on: nothing is sent again
    before ``settles_at``. Retried then, when asking the endpoint is conclusive."""

    def __init__(self, key: str, sent_at: float, settles_at: float, now: float,
                 cause: str = "") -> None:
        super().__init__(
            (f"{cause}; " if cause else "")
            + f"the webhook {key!r} sent at {sent_at:.3f} may have been delivered; the endpoint "
            f"is asked, never sent to blind, after {settles_at:.3f} "
            f"(retry in {max(0.0, settles_at - now):.1f}s)",
            settles_at=settles_at, retry_after=max(0.0, settles_at - now),
        )
        self.sent_at = sent_at


def webhook_id_for(key: str) -> str:
    """The ``webhook-id`` of an intent: the same for every attempt of one key."""
    return "msg_" + hashlib.sha256(key.encode()).hexdigest()[:32]


def _plain(p: Any) -> Mapping[str, Any]:
    """A validated payload as its dict, whether typed (the handler's) or already a dict."""
    return p.model_dump(mode="json") if isinstance(p, BaseModel) else p


def body_of(p: Any) -> bytes:
    """The message body: the same bytes on every attempt (keys sorted, no spaces)."""
    p = _plain(p)
    event = {"type": p["event_type"], "id": p["event_id"], "data": p["data"]}
    return json.dumps(event, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


# -- the signing key -------------------------------------------------------------------------

_made_keys: dict[Path, bytes] = {}
_made_lock = threading.Lock()


def signing_key(environ: Mapping[str, str] | None = None) -> bytes:
    """``SEKALI_WEBHOOKS_SIGNING_KEY``'s bytes, or those of the file
    ``SEKALI_WEBHOOKS_SIGNING_KEY_FILE`` names (refused when others may read it) or, neither
    set, the state folder's own key."""
    env = os.environ if environ is None else environ
    written = env.get(SIGNING_KEY_ENV, "").strip()
    if written:
        return secret_bytes(written, setting=SIGNING_KEY_ENV)
    named = env.get(SIGNING_KEY_FILE_ENV, "").strip()
    if named:
        try:
            return secret_bytes(read_secret_file(Path(named)), setting=SIGNING_KEY_FILE_ENV)
        except (OSError, SecretFileUnsafe) as exc:
            raise SigningKeyInvalid(f"{SIGNING_KEY_FILE_ENV}: {exc}") from None
    return signing_key_in(state_dir() / "webhooks")


def signing_key_in(folder: Path) -> bytes:
    """The bytes of :func:`folder_key`, read once per process."""
    with _made_lock:
        if folder not in _made_keys:
            _made_keys[folder] = secret_bytes(folder_key(folder), setting=str(folder))
        return _made_keys[folder]


def folder_key(folder: Path) -> str:
    """The secret kept in ``folder/signing.key``, made once (0600, in a 0700 folder; written to a
    temporary file, then linked into place: two processes making it at once both end up reading
    the one that won). An existing file is refused (:class:`SigningKeyInvalid`) unless this user
    owns it and nobody else may read or write it."""
    path = folder / "signing.key"
    if not path.exists():
        private_folder(folder)
        text = SECRET_PREFIX + base64.b64encode(os.urandom(32)).decode()
        fd, tmp = tempfile.mkstemp(dir=folder)
        try:
            os.write(fd, text.encode())
            os.close(fd)
            with contextlib.suppress(FileExistsError):  # made by another process
                os.link(tmp, path)
        finally:
            os.unlink(tmp)
    try:
        return read_secret_file(path)
    except SecretFileUnsafe as exc:
        raise SigningKeyInvalid(f"the state folder's signing key: {exc}") from None


# -- the client ------------------------------------------------------------------------------


class WebhookClient:
    """Signed POSTs to endpoints, and the signed lookup of a message at one (see the module).

    ``keys(endpoint_id)`` gives the endpoint's active secrets' bytes (one signature each),
    read per message, so a missing or bad key fails the delivery that needs it, naming the
    setting, not every job's start-up, and a rotation applies to the next message.
    ``http_allowed(endpoint_id)``: whether that endpoint may be plain ``http`` (otherwise only
    destinations the egress allow-list names may)."""

    def __init__(self, http: BoundedHttp, keys: Callable[[str], Sequence[bytes]],
                 clock: Callable[[], float] = time.time, base_url: str = DEFAULT_URL,
                 http_allowed: Callable[[str], bool] = lambda endpoint_id: False) -> None:
        self.http = http
        self._keys = keys
        self.clock = clock
        self.base_url = base_url.rstrip("/")
        self._http_allowed = http_allowed

    def endpoint_url(self, p: Any) -> str:
        """The payload's ``url``, or else ``<base_url>/hooks/<endpoint_id>`` (the id
        percent-encoded: it cannot leave its path segment): an endpoint reached through the
        declared address (the sandbox receiver, or a relay in front of the customers'
        endpoints)."""
        p = _plain(p)
        return str(p.get("url") or f"{self.base_url}/hooks/{quote(p['endpoint_id'], safe='')}")

    def _headers(self, signed: dict[str, str]) -> dict[str, str]:
        return {"Content-Type": "application/json", "User-Agent": "sekali-webhooks", **signed}

    def deliver(self, url: str, webhook_id: str, body: bytes, *, endpoint_id: str,
                send_by: float | None = None) -> int:
        """POST the message, signed with ``endpoint_id``'s secrets; its 2xx status, or
        :class:`WebhookRejected` / :class:`WebhookUnavailable` as the module says
        (:class:`resources.egress.EgressRefused` when the destination may not be called)."""
        headers = self._headers(signed_headers(self._keys(endpoint_id), webhook_id, body,
                                               self.clock()))
        try:
            answer = self.http.request("POST", url, body=body, headers=headers, send_by=send_by,
                                       require_tls=not self._http_allowed(endpoint_id))
        except HttpUnreachable as exc:
            raise WebhookUnavailable(str(exc)) from exc
        except HttpNoAnswer as exc:
            raise WebhookUnavailable(str(exc), maybe_delivered=True) from exc
        status = answer.status
        if 200 <= status < 300:
            return status
        if status >= 500 or status in (408, 429):
            raise WebhookUnavailable(
                f"webhook endpoint answered {answer.described()}", status=status,
                retry_after=retry_after(answer.header("Retry-After"), self.clock()),
                maybe_delivered=status in _MAYBE_STATUSES,
            )
        raise WebhookRejected(status, answer.described())

    def deliveries(self, url: str, webhook_id: str, *, endpoint_id: str) -> list[Effect]:
        """What the endpoint acted on for ``webhook_id``; :class:`LookupUnsupported` when it
        cannot be asked, :class:`WebhookUnavailable` when it does not answer now."""
        parts = urlsplit(url)
        query = "&".join(q for q in (parts.query, urlencode({"webhook_id": webhook_id})) if q)
        lookup_url = urlunsplit((parts.scheme, parts.netloc, parts.path, query, ""))
        target = (parts.path or "/") + "?" + query
        headers = self._headers(lookup_headers(self._keys(endpoint_id), webhook_id, target,
                                               self.clock()))
        try:
            answer = self.http.request("GET", lookup_url, headers=headers,
                                       require_tls=not self._http_allowed(endpoint_id))
        except (HttpUnreachable, HttpNoAnswer) as exc:
            raise WebhookUnavailable(f"lookup: {exc}") from exc
        if answer.status in _NO_LOOKUP:
            raise LookupUnsupported(f"the endpoint answered {answer.status} to the lookup")
        if answer.status != 200 or answer.truncated:
            raise WebhookUnavailable(f"lookup answered {answer.described()}",
                                     status=answer.status)
        try:
            effects = json.loads(answer.body)["effects"]
            return [Effect(str(e["reference"]), float(e["at"]) if e.get("at") else None)
                    for e in effects]
        except (ValueError, KeyError, TypeError) as exc:
            raise WebhookUnavailable(
                f"lookup answer is not the expected JSON ({type(exc).__name__})") from exc

    def close(self) -> None:
        self.http.close()


def lookup(client: Callable[[str], Any], key: str, payload: Any) -> list[Effect]:
    """The deliveries the endpoint acted on for intent ``key`` (the job type's lookup hook)."""
    webhooks: WebhookClient = client(WEBHOOKS.name)
    return webhooks.deliveries(webhooks.endpoint_url(payload), webhook_id_for(key),
                               endpoint_id=_plain(payload)["endpoint_id"])


# -- the downstream declaration --------------------------------------------------------------


def _client(settings: Settings, options: ClientOptions) -> WebhookClient:
    """Reads its settings when built; the secrets on each message (a bad or unsafe key fails
    the delivery that needs it, not the build). A signing key given as resource config would
    be kept in Dagster's run storage: refused, naming the variables to use instead."""
    if "signing_key" in options.extra:
        raise SigningKeyInvalid(
            f"extra.signing_key: a secret in resource config is stored with every run; set "
            f"{SIGNING_KEY_ENV} or {SIGNING_KEY_FILE_ENV} in the worker's environment")
    env = {name: os.environ.get(name, "") for name in (SIGNING_KEY_ENV, SIGNING_KEY_FILE_ENV)}
    folder = state_dir() / "webhooks"

    def key() -> bytes:
        if any(v.strip() for v in env.values()):
            return signing_key(env)
        return signing_key_in(folder)

    secrets = WebhookSecrets(shared_database(settings.database_url), key)
    http = BoundedHttp(timeout=options.timeout or 5.0, deadline=options.deadline or 15.0,
                       max_body=int(options.extra.get("max_body", 16 * 1024)))
    return WebhookClient(http, secrets.signing_keys, base_url=options.address or _base_url(),
                         http_allowed=secrets.http_allowed)


def _base_url() -> str:
    return os.environ.get(URL_ENV) or DEFAULT_URL


def _address(settings: Settings) -> tuple[str, int, str]:
    parts = urlsplit(_base_url())
    return parts.hostname or "127.0.0.1", parts.port or 80, URL_ENV


def _start_sandbox(settings: Settings, state: Path) -> WebhookReceiver:
    """The receiver of ``sekali dev``; its admin token is left, 0600, in the state folder."""
    host, port, _ = _address(settings)
    secrets = WebhookSecrets(shared_database(settings.database_url), signing_key)
    receiver = WebhookReceiver(secrets.signing_keys, host=host, port=port).start()
    write_private(state / "webhooks-admin-token", receiver.admin_token + "\n")
    return receiver


def _sandbox_environment(state: Path) -> dict[str, str]:
    """What processes signing for a receiver started under ``state`` need: its key, unless the
    environment already names one."""
    if any(os.environ.get(n, "").strip() for n in (SIGNING_KEY_ENV, SIGNING_KEY_FILE_ENV)):
        return {}
    return {SIGNING_KEY_ENV: folder_key(state / "webhooks")}


WEBHOOKS = Downstream(
    name="webhooks",
    build=_client,
    description="Customers' webhook endpoints: signed POSTs, and the signed lookup of one.",
    calls=("deliver", "deliveries"),
    destinations_from_payloads=True,
    sandbox=Sandbox("sandbox webhook receiver", _address, _start_sandbox, _sandbox_environment,
                    record=lambda receiver, key, payload: [
                        Effect(str(e["reference"]), float(e["at"]))
                        for e in receiver.effects(webhook_id_for(key))]),
)


# -- the job type ----------------------------------------------------------------------------


def _url(payload: dict[str, Any], field_name: str) -> str:
    value = payload.get(field_name)
    if value is None or value == "":
        return ""
    if not isinstance(value, str):
        raise ValidationError("url", f"must be a string, got {shown(value)}")
    if len(value) > MAX_URL:
        raise ValidationError("url", f"must be at most {MAX_URL} characters, got {len(value)}",
                              limit=str(MAX_URL))
    refuse_control("url", value)
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises on a port that is not a number in range
    except ValueError:
        raise ValidationError("url", "is not a URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or " " in value:
        raise ValidationError("url", "must be an absolute http:// or https:// URL with a host")
    if parts.username is not None or parts.password is not None or parts.fragment:
        raise ValidationError("url", "may not hold credentials or a #fragment")
    return value


def _endpoint_id(payload: dict[str, Any], field_name: str) -> str:
    return check_endpoint_id(require_str(payload, field_name), field_name)


def destination_key(payload: dict[str, Any]) -> str:
    """The concurrency key of a delivery: where it goes (the URL's scheme, host and port, or
    the relay's address and the endpoint's path on it), not the caller-chosen endpoint id, so
    many endpoint ids naming one host share its cap."""
    url = str(payload.get("url") or "")
    if not url:
        return f"relay:{payload['endpoint_id']}"
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"destination:{parts.scheme}://{(parts.hostname or '').rstrip('.')}:{port}"


def _data(payload: dict[str, Any], field_name: str) -> dict[str, Any]:
    data = payload.get(field_name)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValidationError("data", f"must be a JSON object, got {shown(data)}")
    try:
        size = len(json.dumps(data, ensure_ascii=False, allow_nan=False).encode())
    except (TypeError, ValueError, RecursionError):
        raise ValidationError("data", "must be JSON (objects, lists, strings, numbers)") from None
    if size > MAX_DATA_BYTES:
        raise ValidationError("data", f"must be at most {MAX_DATA_BYTES} bytes as JSON, got "
                              f"{size}", limit=str(MAX_DATA_BYTES))
    return data


class WebhookEvent(BaseModel):
    """One event for one endpoint: the key is ``webhook:{endpoint_id}:{event_id}``."""

    model_config = ConfigDict(frozen=True, json_schema_extra={"examples": [
        {"endpoint_id": "ep-example-1", "url": "", "event_id": "evt-example-1",
         "event_type": "order.paid", "data": {"order_id": "o-example-1"}},
    ]})

    endpoint_id: Annotated[str, Check(_endpoint_id), Field(
        description="The customer's endpoint; part of the key (letters, digits, . _ ~ -).")]
    url: Annotated[str, Check(_url), Field(
        description="The endpoint's http(s) URL; empty: <SEKALI_WEBHOOKS_URL>/hooks/"
                    "<endpoint_id>.")] = ""
    event_id: Annotated[str, Check(require_str), Field(
        description="The event; one delivery per (endpoint, event).")]
    event_type: Annotated[str, Check(require_str), Field(
        description="The event's type, e.g. order.paid.")]
    data: Annotated[dict[str, Any], Check(_data)] = Field(
        default_factory=dict, description="The event's data (a JSON object, at most 64 KiB).")


key_for = formatted("webhook:{endpoint_id}:{event_id}")


def _answered(ctx: JobContext, status: int | None) -> None:
    """The send got an answer that says it was not delivered: no lookup needed next time."""
    with ctx.transaction("record_answer") as conn:
        ctx.checkpoint(ANSWERED, {"status": status}, conn=conn)


def _send(ctx: JobContext, client: WebhookClient, p: WebhookEvent, webhook_id: str) -> int:
    body = body_of(p)
    for tries_left in range(SEND_TRIES - 1, -1, -1):
        sent_at = ctx.stamp_send()
        with ctx.transaction("record_send") as conn:
            ctx.checkpoint(SENT, {"sent_at": sent_at, "webhook_id": webhook_id}, conn=conn)
        send_by = ctx.confirm_lease()
        try:
            with ctx.timed("webhook_post"):
                return client.deliver(client.endpoint_url(p), webhook_id, body,
                                      endpoint_id=p.endpoint_id, send_by=send_by)
        except SendDeadlinePassed:
            _answered(ctx, None)  # nothing left this process
            if not tries_left:
                raise
        except WebhookUnavailable as exc:
            if exc.maybe_delivered:
                ctx.attempt.status_after = MAYBE_DELIVERED
                settles_at = sent_at + ctx.services.settle_seconds
                raise WebhookNotSettled(ctx.key, sent_at, settles_at, time.time(),
                                        str(exc)) from exc
            _answered(ctx, exc.status)
            raise
        except PermanentJobError as exc:
            _answered(ctx, getattr(exc, "status", None))
            raise
    raise AssertionError("the last try returns or raises")


def deliver_webhook(ctx: JobContext, p: WebhookEvent) -> dict[str, Any]:
    client: WebhookClient = ctx.client(WEBHOOKS.name)
    webhook_id = webhook_id_for(ctx.key)
    result = {"endpoint_id": p.endpoint_id, "event_id": p.event_id,
              "webhook_id": webhook_id}
    ctx.attempt.status_before = "not_sent"
    if ctx.claim.recovery_point == SENT:
        ctx.attempt.status_before = MAYBE_DELIVERED
        sent_at = float(ctx.claim.recovery_data["sent_at"])
        settles_at = sent_at + ctx.services.settle_seconds
        if time.time() < settles_at:
            ctx.attempt.status_after = MAYBE_DELIVERED
            raise WebhookNotSettled(ctx.key, sent_at, settles_at, time.time())
        try:
            with ctx.timed("webhook_lookup"):
                found = lookup(ctx.client, ctx.key, p)
        except LookupUnsupported:
            log.info("%s: the endpoint cannot be asked; sending the same message again",
                     ctx.key)
            ctx.attempt.status_before = "lookup_unsupported"
            found = []
        if found:
            ctx.attempt.status_after = "delivered"
            return {**result, "status": None, "found": found[0].reference}
    ctx.crash_point("before_send")
    with ctx.concurrency_slot(JOB_TYPE):
        status = _send(ctx, client, p, webhook_id)
    ctx.crash_point("after_send")
    ctx.attempt.status_after = "delivered"
    return {**result, "status": status, "found": None}


JOB_TYPE = JobType(
    name="deliver_webhook",
    queue=Queue.LIGHT,
    payload=WebhookEvent,
    handler=deliver_webhook,
    side_effect=True,
    keying=Keying(key_for=key_for, resource_id=formatted("{endpoint_id}")),
    running=Running(max_runtime_seconds=120),
    calls=Calls(clients=(WEBHOOKS,), lookup=lookup),
    flow=FlowControl(concurrency=Concurrency(destination_key, limit=4)),
    presentation=Presentation(
        description="POST one signed event to one endpoint, once (key "
                    "webhook:{endpoint_id}:{event_id}).",
        result_fields=("webhook_id",),
        personal=frozenset({"url"}),
    ),
)
validate = JOB_TYPE.validate
