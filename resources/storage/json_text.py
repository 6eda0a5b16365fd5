"""How sekali stores JSON in text columns: one definition, so equal values store equal text."""

from __future__ import annotations

import json
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
