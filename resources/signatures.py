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

Several secrets sign at once during a rotation (:func:`signed_headers` takes a list): the
header carries one ``v1,`` signature per secret, and a receiver holding any one of them accepts.

A *lookup* (sekali's own question to an endpoint, "did you act on message X?", a GET with no
body) is signed as a different message type: with :func:`lookup_key` of each secret (an HMAC of
the secret, never the secret itself) over the request's target (``/path?query``), so a
lookup's headers replayed as a delivery (an empty POST) never verify, and a delivery's headers
never pass as a lookup.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Mapping, Sequence

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


def lookup_key(key: bytes) -> bytes:
    """The key a lookup is signed with, derived from a secret: never the secret itself, so no
    lookup signature is a delivery signature."""
    return hmac.new(key, b"sekali-lookup-v1", hashlib.sha256).digest()


def _keys(key: bytes | Sequence[bytes]) -> list[bytes]:
    return [key] if isinstance(key, bytes) else list(key)


def signed_headers(key: bytes | Sequence[bytes], msg_id: str, body: bytes, now: float
                   ) -> dict[str, str]:
    """The three headers of ``body`` sent as message ``msg_id`` at ``now``, signed with each
    of the keys (one ``v1,`` signature each, space-separated)."""
    keys = _keys(key)
    if not keys:
        raise SigningKeyInvalid("no signing secret to sign with")
    timestamp = int(now)
    return {
        ID_HEADER: msg_id,
        TIMESTAMP_HEADER: str(timestamp),
        SIGNATURE_HEADER: " ".join(signature(k, msg_id, timestamp, body) for k in keys),
    }


def lookup_headers(key: bytes | Sequence[bytes], msg_id: str, target: str, now: float
                   ) -> dict[str, str]:
    """The headers of a lookup of message ``msg_id`` at ``target`` (``/path?query``)."""
    return signed_headers([lookup_key(k) for k in _keys(key)], msg_id, target.encode(), now)


def verify_lookup(key: bytes | Sequence[bytes], headers: Mapping[str, str], target: str,
                  now: float, tolerance: float = DEFAULT_TOLERANCE) -> str:
    """:func:`verify` for a lookup of ``target``: the message id it asks about."""
    return verify([lookup_key(k) for k in _keys(key)], headers, target.encode(), now, tolerance)


def verify(
    key: bytes | Sequence[bytes], headers: Mapping[str, str], body: bytes, now: float,
    tolerance: float = DEFAULT_TOLERANCE,
) -> str:
    """The message id when ``headers`` sign ``body`` with ``key`` (or any one of several keys)
    within ``tolerance`` seconds of ``now``; :class:`SignatureInvalid` saying which check
    failed otherwise. Header names are matched without regard to case."""
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
    expected = [signature(k, msg_id, timestamp, body).encode() for k in _keys(key)]
    for candidate in given.split()[:16]:
        if any(hmac.compare_digest(candidate.encode(), e) for e in expected):
            return msg_id
    raise SignatureInvalid(f"{SIGNATURE_HEADER}: no v1 signature matches the body")


__all__ = [
    "SignatureInvalid",
    "SigningKeyInvalid",
    "secret_bytes",
    "signature",
    "lookup_headers",
    "lookup_key",
    "signed_headers",
    "verify",
    "verify_lookup",
]
