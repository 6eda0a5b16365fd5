"""Text that goes into a protocol header (HTTP, SMTP): refused with a control character, written
safely whatever script it is in.

A header line ends at CR LF: a CR or LF inside a value ends the headers early (the rest becomes
the body, or a header of the caller's choosing), so a value with any control character is
refused, naming the field (:class:`resources.errors.ValidationError`, permanent). HTTP header
values travel as Latin-1 (``http.client`` raises ``UnicodeEncodeError`` on anything else), so
:func:`http_header_value` writes a value outside printable ASCII, or one holding ``%``, as
percent-encoded UTF-8: a plain value (printable ASCII without ``%``) goes as it is, an encoded
one always holds a ``%``, so two values never share a form, and :func:`http_header_text` reads
either back. Mail headers use RFC 2047 encoded words instead (``pipelines/domain/mail.py``).

The checks cost a scan of the value, linear in its length.
"""

from __future__ import annotations

import re
from urllib.parse import quote, unquote

from resources.errors import ValidationError

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_PLAIN = re.compile("[\x20-\x24\x26-\x7e]*")  # printable ASCII but %
_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in "%")


def refuse_control(field: str, value: str) -> str:
    """``value``, or :class:`ValidationError` naming ``field`` when it holds a control character
    (CR, LF, any C0 or C1, DEL, a line or paragraph separator)."""
    return refuse_found(field, value, _CONTROL, "a control character",
                        "; a header value may not hold one")


def refuse_found(field: str, value: str, forbidden: re.Pattern[str], what: str,
                 advice: str = "") -> str:
    """``value``, or :class:`ValidationError` naming ``field``, the first character that
    ``forbidden`` finds (``what``), its position and its code point."""
    found = forbidden.search(value)
    if found is not None:
        raise ValidationError(
            field,
            f"contains {what} at position {found.start()} (U+{ord(found.group()):04X}){advice}",
        )
    return value


def http_header_value(field: str, value: str) -> str:
    """``value`` as an HTTP header carries it (module docstring): itself when it is printable
    ASCII without ``%``, else percent-encoded UTF-8. Refuses a control character."""
    refuse_control(field, value)
    if _PLAIN.fullmatch(value):
        return value
    return quote(value, safe=_SAFE)


def http_header_text(raw: str) -> str:
    """The value :func:`http_header_value` wrote (what a receiver stores)."""
    return unquote(raw) if "%" in raw else raw


__all__ = ["http_header_text", "http_header_value", "refuse_control", "refuse_found"]
