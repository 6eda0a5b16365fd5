"""How sekali stores JSON and text in text columns: one definition, so equal values store equal
text, and nothing a caller sends can make an INSERT fail on either database."""

from __future__ import annotations

import hashlib
import json
import re
import reprlib
from dataclasses import dataclass
from typing import Any


def canonical(value: Any) -> str:
    """Sorted keys, no spaces: the form payload hashes and stored request payloads use."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def to_text(value: Any) -> str:
    """A value as stored in a JSON text column (sorted keys; non-JSON types as strings)."""
    return json.dumps(value, sort_keys=True, default=str)


def from_text(text: str | None) -> Any:
    """The value of a JSON text column; NULL reads as None."""
    return None if text is None else json.loads(text)


# -- text that both databases store ---------------------------------------------------------

_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


def storable(text: str, max_bytes: int | None = None) -> str:
    """``text`` as both databases store it: NUL (Postgres refuses it in text) and lone
    surrogates (no UTF-8 encoding exists for them) written as backslash escapes, and cut to at
    most ``max_bytes`` of UTF-8 on a character boundary. Cost bounded by ``max_bytes``."""
    if max_bytes is not None:
        text = text[:max_bytes]
    if _UNSTORABLE.search(text):
        text = _UNSTORABLE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
    if max_bytes is not None and len(text) * 4 > max_bytes:
        text = text.encode("utf-8")[:max_bytes].decode("utf-8", "ignore")
    return text


def storable_key(text: str, max_bytes: int) -> str:
    """A unique column's value: ``text`` itself when it is storable and within ``max_bytes`` of
    UTF-8; otherwise a storable prefix and a hash of the whole, so two keys that differ only past
    the prefix (or in what :func:`storable` escaped) stay two keys."""
    fits = len(text) * 4 <= max_bytes or len(text.encode("utf-8", "surrogatepass")) <= max_bytes
    if fits and not _UNSTORABLE.search(text):
        return text
    whole = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return storable(text, max_bytes - 33) + "#" + whole


@dataclass(frozen=True)
class Digest:
    """A bounded description of a value: the start of its text, and the size (UTF-8 bytes) and
    sha256 of the whole text."""

    excerpt: str
    size: int
    sha256: str


def digest(value: Any, excerpt_bytes: int) -> Digest:
    """Describe any value within ``excerpt_bytes``, whatever it holds. Text is itself; other
    values are their :func:`canonical` JSON text, or, when they have none (cycles, nesting past
    the interpreter's recursion limit, a ``__str__`` that raises), a bounded ``repr``."""
    if isinstance(value, str):
        whole = value
    else:
        try:
            whole = canonical(value)
        except Exception:  # noqa: BLE001 - any value at all must be describable
            whole = _bounded_repr(value)
    data = whole.encode("utf-8", "surrogatepass")
    return Digest(storable(whole, excerpt_bytes), len(data), hashlib.sha256(data).hexdigest())


def _bounded_repr(value: Any) -> str:
    shape = reprlib.Repr()
    shape.maxlevel, shape.maxstring, shape.maxother = 8, 200, 200
    try:
        return shape.repr(value)
    except Exception:  # noqa: BLE001 - a hostile __repr__
        return f"<unrepresentable {type(value).__name__}>"


_SHAPE_DEPTH = 8
_SHAPE_ITEMS = 100


def shape(value: Any, depth: int = 0) -> Any:
    """``value`` with every value replaced by its kind (``<str 12>``, ``<int>``, ``<float>``,
    ``<bool>``; null stays null), keys and nesting kept: what a refused payload looked like,
    with nothing it said. Bounded: past 8 levels or 100 items of one container, ``"..."``; a
    key is cut to 64 characters."""
    if depth >= _SHAPE_DEPTH:
        return "..."
    if isinstance(value, dict):
        items = list(value.items())
        out: dict[str, Any] = {str(k)[:64]: shape(v, depth + 1) for k, v in items[:_SHAPE_ITEMS]}
        if len(items) > _SHAPE_ITEMS:
            out["..."] = f"<{len(items) - _SHAPE_ITEMS} more>"
        return out
    if isinstance(value, list | tuple):
        head = [shape(v, depth + 1) for v in value[:_SHAPE_ITEMS]]
        return head + ([f"<{len(value) - _SHAPE_ITEMS} more>"] if len(value) > _SHAPE_ITEMS
                       else [])
    if value is None:
        return None
    if isinstance(value, bool):
        return "<bool>"
    if isinstance(value, str):
        return f"<str {len(value)}>"
    return f"<{type(value).__name__}>"


def masked_digest(value: Any, excerpt_bytes: int) -> Digest:
    """:func:`digest` of ``value`` whose excerpt is its :func:`shape` (the size and sha256 are
    the whole value's): a refused payload kept without a value of it. Text that is JSON is
    read first; other text is described by its length."""
    whole = digest(value, excerpt_bytes)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            return Digest(f"<text {len(value)} characters>", whole.size, whole.sha256)
    try:
        text = canonical(shape(value))
    except Exception:  # noqa: BLE001 - any value at all must be describable
        text = f"<{type(value).__name__}>"
    return Digest(storable(text, excerpt_bytes), whole.size, whole.sha256)
