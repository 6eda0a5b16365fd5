"""Names of keys and locks folded into patterns, so per-entity stats stay bounded.

Stats are kept per pattern, not per key: ``order:123`` and ``order:124`` count together under
``order:*``. The last segment is always taken as an identifier, and an earlier one when it holds
a digit (``user:42:orders`` -> ``user:*:*``, ``tenant7:order:9`` -> ``*:order:*``); without
that, a key with an id in the middle would add stats fields for every id, for ever.
"""

from __future__ import annotations


def key_pattern(key: str) -> str:
    """``order:123`` -> ``order:*``; ``user:42:orders`` -> ``user:*:*``; ``plain`` stays."""
    parts = key.split(":")
    if len(parts) == 1:
        return key
    head = ["*" if any(ch.isdigit() for ch in part) else part for part in parts[:-1]]
    return ":".join([*head, "*"])
