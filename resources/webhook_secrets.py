"""A signing secret per webhook endpoint, with rotation: owner of ``webhook_secrets`` and
``webhook_endpoints``.

One secret for every endpoint would let any customer who verifies their webhooks forge
webhooks to every other customer. So each endpoint signs with its own secrets:

- **By default**, an endpoint's secret is derived from the deployment's key
  (:func:`derived_secret`: ``whsec_`` + HMAC-SHA256(key, endpoint id)): every endpoint has one
  from its first delivery, nothing has to be stored, and knowing one endpoint's secret tells
  nothing about another's. ``sekali webhooks secret list ENDPOINT --reveal`` shows it, to hand to
  the customer.
- **Rotation** (:meth:`WebhookSecrets.rotate`, ``sekali webhooks secret rotate ENDPOINT``): a new
  random secret is stored, and the secrets active until now stay active for ``overlap`` seconds
  more. Meanwhile every message carries one ``v1,`` signature per active secret, so a customer
  verifies throughout whether they switched yet; then the old ones expire and only the new one
  signs.
- **Plain http** is refused for an endpoint's URL unless :meth:`WebhookSecrets.allow_http` was
  set for it (or the operator's egress allow-list names the destination).

Secrets live here only: never in a payload, a run's config or a log line. ``endpoint_id`` is
limited to a safe alphabet (:func:`check_endpoint_id`) before it reaches a URL or a key.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import BigInteger, Column, Float, Integer, Table, Text, text

from resources.errors import ValidationError
from resources.signatures import SECRET_PREFIX, secret_bytes
from resources.storage.db import Database, metadata
from resources.storage.queries import load_queries

ENDPOINT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._~-]{0,199}")
"""Letters, digits and ``. _ ~ -``, starting with a letter or digit, at most 200 characters:
nothing a URL path, a query or a key separator (``:``) reads specially."""

webhook_secrets = Table(
    "webhook_secrets",
    metadata,
    Column("id", BigInteger, primary_key=True),
    Column("endpoint_id", Text, nullable=False),
    Column("secret", Text, nullable=False),
    Column("derived", Integer, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("expires_at", Float),
    Column("created_by", Text),
)

webhook_endpoints = Table(
    "webhook_endpoints",
    metadata,
    Column("endpoint_id", Text, primary_key=True),
    Column("allow_http", Integer, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("updated_by", Text),
)

_Q = load_queries(Path(__file__).with_suffix(".sql"))


def check_endpoint_id(value: Any, field: str = "endpoint_id") -> str:
    """``value`` when it is an endpoint id (:data:`ENDPOINT_ID`), else :class:`ValidationError`
    naming ``field``."""
    if not isinstance(value, str) or not ENDPOINT_ID.fullmatch(value):
        raise ValidationError(field, "letters, digits and . _ ~ - only, starting with a letter "
                                     "or digit, 1 to 200 characters")
    return value


def derived_secret(key: bytes, endpoint_id: str) -> str:
    """An endpoint's default secret, derived from the deployment's ``key``."""
    mac = hmac.new(key, b"sekali-endpoint-secret\x00" + endpoint_id.encode(), hashlib.sha256)
    return SECRET_PREFIX + base64.b64encode(mac.digest()).decode()


def masked(secret: str) -> str:
    """A secret as a listing shows it: its prefix and first four characters."""
    return secret[: len(SECRET_PREFIX) + 4] + "..."


@dataclass(frozen=True)
class SecretRow:
    """One secret of an endpoint (``id`` None for the derived default never rotated)."""

    id: int | None
    endpoint_id: str
    secret: str
    derived: bool
    created_at: float | None
    expires_at: float | None

    def active(self, now: float) -> bool:
        return self.expires_at is None or self.expires_at > now

    def view(self, now: float, *, reveal: bool = False) -> dict[str, Any]:
        return {"id": self.id, "endpoint_id": self.endpoint_id,
                "secret": self.secret if reveal else masked(self.secret),
                "derived": self.derived, "created_at": self.created_at,
                "expires_at": self.expires_at,
                "state": "active" if self.active(now) else "expired"}


class WebhookSecrets:
    """The store (see the module). ``key()`` gives the deployment's key, read when first
    needed, so a missing or unsafe key fails the delivery that needs it, naming the setting."""

    def __init__(self, db: Database, key: Callable[[], bytes],
                 clock: Callable[[], float] = time.time) -> None:
        self.db = db
        self._key = key
        self.clock = clock

    def secrets(self, endpoint_id: str) -> list[SecretRow]:
        """Every secret the endpoint has had, newest first; the derived default when none."""
        check_endpoint_id(endpoint_id)
        with self.db.statement() as conn:
            rows = conn.execute(text(_Q["secrets_of"]), {"endpoint": endpoint_id}).all()
        found = [SecretRow(r.id, r.endpoint_id, r.secret, bool(r.derived), r.created_at,
                           r.expires_at) for r in rows]
        if found:
            return found
        return [SecretRow(None, endpoint_id, derived_secret(self._key(), endpoint_id), True,
                          None, None)]

    def signing_keys(self, endpoint_id: str) -> list[bytes]:
        """The bytes of the endpoint's active secrets, newest first: each signs every message."""
        now = self.clock()
        return [secret_bytes(s.secret, setting=f"webhook secret {s.id} of {endpoint_id}")
                for s in self.secrets(endpoint_id) if s.active(now)]

    def rotate(self, endpoint_id: str, *, overlap: float, actor: str) -> SecretRow:
        """A new secret for the endpoint; the ones active now stay active ``overlap`` seconds
        more (the derived default is stored first, so its expiry is kept). One transaction:
        two rotations at once leave two new secrets, each old one expiring once."""
        check_endpoint_id(endpoint_id)
        if overlap < 0:
            raise ValidationError("overlap", "0 seconds or more", overlap)
        now = self.clock()
        secret = SECRET_PREFIX + base64.b64encode(os.urandom(32)).decode()
        with self.db.transaction() as conn:
            known = conn.execute(text(_Q["count_secrets"]), {"endpoint": endpoint_id}).scalar()
            if not known:
                conn.execute(text(_Q["insert_secret"]), {
                    "endpoint": endpoint_id, "secret": derived_secret(self._key(), endpoint_id),
                    "derived": 1, "now": now, "actor": actor})
            conn.execute(text(_Q["expire_active"]),
                         {"endpoint": endpoint_id, "now": now, "until": now + overlap})
            new_id = conn.execute(text(_Q["insert_secret"]), {
                "endpoint": endpoint_id, "secret": secret, "derived": 0, "now": now,
                "actor": actor}).scalar_one()
        return SecretRow(int(new_id), endpoint_id, secret, False, now, None)

    def listing(self, endpoint_id: str | None = None, *, reveal: bool = False
                ) -> list[dict[str, Any]]:
        """The secrets of one endpoint (or of every endpoint that has stored ones), masked
        unless ``reveal``, newest first."""
        now = self.clock()
        if endpoint_id is not None:
            return [s.view(now, reveal=reveal) for s in self.secrets(endpoint_id)]
        with self.db.statement() as conn:
            ids = [r[0] for r in conn.execute(text(_Q["endpoints_with_secrets"])).all()]
        return [s.view(now, reveal=reveal) for e in ids for s in self.secrets(e)]

    def allow_http(self, endpoint_id: str, allowed: bool, *, actor: str) -> None:
        """Let the endpoint's URL be plain ``http`` (or not, again)."""
        check_endpoint_id(endpoint_id)
        with self.db.transaction() as conn:
            conn.execute(text(_Q["set_allow_http"]), {
                "endpoint": endpoint_id, "allowed": int(allowed), "now": self.clock(),
                "actor": actor})

    def http_allowed(self, endpoint_id: str) -> bool:
        with self.db.statement() as conn:
            found = conn.execute(text(_Q["allow_http_of"]), {"endpoint": endpoint_id}).scalar()
        return bool(found)


__all__ = [
    "ENDPOINT_ID",
    "SecretRow",
    "WebhookSecrets",
    "check_endpoint_id",
    "derived_secret",
    "masked",
]
