"""Names of keys and locks folded into patterns, so per-entity stats stay bounded.

Stats are kept per pattern, not per key: ``order:123`` and ``order:124`` count together under
``order:*``. Only the first segment of a name says what kind of thing it is; every later one is
taken as an identifier, whether it holds a digit or not (``user:42:orders`` -> ``user:*:*``,
``email:welcome:alice:2026-11-01`` -> ``email:*:*:*``): a user name or an SKU in the middle
would otherwise add stats fields for every value, for ever. Within the first segment (or a name
without colons) an id written into a word is folded too: ``order-123`` -> ``order-*``, a uuid
or a hex digest -> ``*``. The hashes these patterns are written to are capped as well
(:mod:`resources.telemetry.counters`), for names no rule can see through.
"""

from __future__ import annotations

import re

_UUID = re.compile(
    r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
)
_WORD_WITH_DIGIT = re.compile(r"(?<![A-Za-z0-9])[A-Za-z0-9]*\d[A-Za-z0-9]*")
"""A word holding a digit. It may start only where a word starts (the look-behind), so a long
word without a digit is scanned once, not once from each of its letters: linear in the name."""


def fold_ids(segment: str) -> str:
    """``order-123`` -> ``order-*``; ``tenant7`` -> ``*``; a uuid or hex digest -> ``*``;
    ``nightly`` stays."""
    return _WORD_WITH_DIGIT.sub("*", _UUID.sub("*", segment))


def key_pattern(key: str) -> str:
    """``order:123`` -> ``order:*``; ``user:42:orders`` -> ``user:*:*``; ``order-123`` ->
    ``order-*``; ``plain`` stays."""
    head, *rest = key.split(":")
    return ":".join([fold_ids(head), *("*" for _ in rest)])
