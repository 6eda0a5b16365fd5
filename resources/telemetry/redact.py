"""Masking of personal data in text: e-mail addresses anywhere, and any value a caller names.

Logs, attempt errors and DLQ records outlive the request they describe and are read by more
people than the request's payload, so what they carry is masked where it is written: an e-mail
address becomes ``<email>``, a value a job type marks personal (its payload's ``to``, a name)
becomes ``<redacted>``, and the row values a Postgres error echoes in its ``DETAIL`` (a
failing row, a duplicate key: the payload again) become ``<row values hidden>``; SQLAlchemy's
own echo of bound parameters is off at the engine (``hide_parameters``). Which fields are
personal is the job platform's knowledge (``pipelines/privacy.py``); this module only masks.

:class:`RedactingFilter` applies the same masking to whole log records (message, exception
text, structured extras); :func:`resources.telemetry.logs.configure_json_logging` installs it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

EMAIL_MASK = "<email>"
VALUE_MASK = "<redacted>"

_LOCAL = "[A-Za-z0-9.!#$%&'*+/=?^_`{|}~-]"
_EMAIL = re.compile(
    rf"(?<!{_LOCAL}){_LOCAL}+@[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)+"
)
"""An address with a dotted domain: ``ann@example.com``; not a Message-ID's ``<id@sekali>``.

Linear in the text's length: a match may start only where a run of local-part characters
starts (the look-behind), so each run is scanned from one start, not from each of its
characters (which made ``a*8000@a*8000`` take 2.2 s); after the ``@`` each repetition starts
with a character the one before cannot end with. The matches are the same: a match found
inside a run would have been found from the run's start."""

_ROW_VALUES = re.compile(r"(DETAIL:\s*)(?:Failing row contains|Key \().*")
"""Postgres echoes a failing row's values (NOT NULL, CHECK) or a duplicate key's in DETAIL."""
ROW_MASK = "<row values hidden>"

_MIN_VALUE = 3  # shorter values would mask unrelated text ("a", "42")


def _with_prefixes(values: Iterable[str]) -> set[str]:
    """``values`` and, for each URL among them, the URL cut before its query and before its
    path: errors name a URL without its query (``resources.egress.shown_url``) or by its
    host, and those forms must be masked as the whole is."""
    out = set()
    for value in values:
        out.add(value)
        scheme, sep, rest = value.partition("://")
        if sep and scheme.isalpha():
            out.add(value.split("?", 1)[0].split("#", 1)[0])
            out.add(f"{scheme}://{rest.split('/', 1)[0].split('?', 1)[0]}")
    return out


def redact(text: str, values: Iterable[str] = ()) -> str:
    """``text`` with every e-mail address, every one of ``values`` (a URL also by its prefix
    without the query, and by its scheme and host) and the row values a database error echoes
    masked."""
    wanted = {v for v in _with_prefixes(values) if len(v) >= _MIN_VALUE}
    for value in sorted(wanted, key=len, reverse=True):
        text = text.replace(value, VALUE_MASK)
    return _EMAIL.sub(EMAIL_MASK, _ROW_VALUES.sub(rf"\g<1>{ROW_MASK}", text))


URL_PASSWORD_MASK = "***"


def hide_url_password(url: str) -> str:
    """``url`` with the password of its user part masked (``redis://:***@host:6379/0``,
    ``postgresql://app:***@db/app``, ``redis+cluster://:***@h1:7000,h2:7001``), for output and
    logs; a URL without one is returned as it is. Plain string splitting: linear, and it works
    on the comma-separated host lists that ``urllib`` does not parse."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    authority, slash, tail = rest.partition("/")
    credentials, at, hosts = authority.rpartition("@")
    user, colon, password = credentials.partition(":")
    if not at or not colon or not password:
        return url
    return f"{scheme}://{user}:{URL_PASSWORD_MASK}@{hosts}{slash}{tail}"


def redact_data(value: Any, values: Iterable[str] = ()) -> Any:
    """Every string inside ``value`` (dicts, lists, tuples) redacted; other values unchanged."""
    values = tuple(values)
    if isinstance(value, str):
        return redact(value, values)
    if isinstance(value, dict):
        return {k: redact_data(v, values) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_data(v, values) for v in value)
    return value


class RedactingFilter(logging.Filter):
    """Masks e-mail addresses in a record before any handler formats it: the message (with its
    arguments), the exception text, and the ``sekali`` extra. Put it on a handler, so records
    propagated from every logger pass through it. Never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg = redact(record.getMessage())
        record.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        nested = record.__dict__.get("sekali")
        if isinstance(nested, dict):
            record.__dict__["sekali"] = redact_data(nested)
        return True


_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def loggable(text: str) -> str:
    """``text`` as a log line may carry it: control characters escaped (no line of its own, no
    terminal codes) and what UTF-8 cannot encode (a lone surrogate from hostile input) shown as
    its escape, so no handler, pipe or test report fails on it."""
    text = _UNPRINTABLE.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
