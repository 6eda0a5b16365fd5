"""Standard Webhooks signatures: what the sender writes, what a receiver checks.

A message is signed with three headers (https://www.standardwebhooks.com):

- ``webhook-id``: the message's id, the same for every resend of one message (receivers dedupe
  on it);
- ``webhook-timestamp``: integer seconds since the epoch when this send was signed;
- ``webhook-signature``: ``v1,<base64 HMAC-SHA256(secret, "{id}.{timestamp}.{body}")>``;
  several space-separated during a key rotation, any one matching is enough.

The secret is written ``whsec_<base64>`` (the bytes are the base64 decoding); a secret without
the prefix is taken as its UTF-8 bytes. A receiver refuses a timestamp further than
``tolerance`` seconds from its clock (a captured message cannot be replayed later) and compares
signatures in constant time. The secret is never part of an error or a log line.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Mapping

from resources.errors import PermanentJobError

SECRET_PREFIX = "whsec_"
ID_HEADER = "webhook-id"
TIMESTAMP_HEADER = "webhook-timestamp"
SIGNATURE_HEADER = "webhook-signature"
DEFAULT_TOLERANCE = 300.0
MIN_SECRET_BYTES = 24


class SignatureInvalid(PermanentJobError):
    """A message's signature headers are missing, stale or do not match its body: the receiver
    must not act on it. The same message signed again with the right secret is accepted; check
    that sender and receiver share the secret and that their clocks agree within the tolerance.
    """


class SigningKeyInvalid(PermanentJobError):
    """The signing secret cannot be used (not base64 after ``whsec_``, or too short). Set a
    secret of at least 24 random bytes, e.g. ``whsec_`` + base64 of ``os.urandom(32)``."""


def secret_bytes(secret: str, *, setting: str = "signing secret") -> bytes:
    """The key bytes of a secret as written (see the module); ``setting`` names where it came
    from in the error, never its value."""
    if secret.startswith(SECRET_PREFIX):
        try:
            key = base64.b64decode(secret[len(SECRET_PREFIX):], validate=True)
        except (binascii.Error, ValueError):
            raise SigningKeyInvalid(
                f"{setting}: not base64 after {SECRET_PREFIX!r}; write whsec_<base64 bytes>"
            ) from None
    else:
        key = secret.encode()
    if len(key) < MIN_SECRET_BYTES:
        raise SigningKeyInvalid(
            f"{setting}: {len(key)} bytes, at least {MIN_SECRET_BYTES} random bytes are needed"
        )
    return key


def signature(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """``v1,<base64 HMAC-SHA256>`` over ``{msg_id}.{timestamp}.{body}``."""
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def signed_headers(key: bytes, msg_id: str, body: bytes, now: float) -> dict[str, str]:
    """The three headers of ``body`` sent as message ``msg_id`` at ``now``."""
    timestamp = int(now)
    return {
        ID_HEADER: msg_id,
        TIMESTAMP_HEADER: str(timestamp),
        SIGNATURE_HEADER: signature(key, msg_id, timestamp, body),
    }


def verify(
    key: bytes, headers: Mapping[str, str], body: bytes, now: float,
    tolerance: float = DEFAULT_TOLERANCE,
) -> str:
    """The message id when ``headers`` sign ``body`` with ``key`` within ``tolerance`` seconds of
    ``now``; :class:`SignatureInvalid` saying which check failed otherwise. Header names are
    matched without regard to case."""
    lower = {name.lower(): value for name, value in headers.items()}
    msg_id = lower.get(ID_HEADER)
    raw_ts = lower.get(TIMESTAMP_HEADER)
    given = lower.get(SIGNATURE_HEADER)
    if not msg_id or not raw_ts or not given:
        missing = [h for h, v in ((ID_HEADER, msg_id), (TIMESTAMP_HEADER, raw_ts),
                                  (SIGNATURE_HEADER, given)) if not v]
        raise SignatureInvalid(f"missing header(s) {', '.join(missing)}")
    if not raw_ts.isdigit() or len(raw_ts) > 12:
        raise SignatureInvalid(f"{TIMESTAMP_HEADER}: not integer seconds")
    timestamp = int(raw_ts)
    if abs(now - timestamp) > tolerance:
        raise SignatureInvalid(
            f"{TIMESTAMP_HEADER}: {timestamp} is {now - timestamp:+.0f}s from now, outside the "
            f"{tolerance:g}s tolerance (a replay, or clocks apart)"
        )
    expected = signature(key, msg_id, timestamp, body).encode()
    for candidate in given.split()[:16]:
        if hmac.compare_digest(candidate.encode(), expected):
            return msg_id
    raise SignatureInvalid(f"{SIGNATURE_HEADER}: no v1 signature matches the body")


__all__ = [
    "SignatureInvalid",
    "SigningKeyInvalid",
    "secret_bytes",
    "signature",
    "signed_headers",
    "verify",
]
