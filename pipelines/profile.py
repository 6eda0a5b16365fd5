"""The one place that chooses resources: embedded defaults or production, from the environment
at run time (resources read ``DATABASE_URL`` / ``REDIS_URL`` in setup, never at import)."""

from __future__ import annotations

from typing import Any

from resources.idempotency import IdempotencyResource


def resource_defs() -> dict[str, Any]:
    return {
        "idempotency": IdempotencyResource(),
    }
