"""Worker functions the fair-share tests run in other processes (spawn context).

Module-level so ``multiprocessing`` can import them; each opens its own database.
"""

from __future__ import annotations

from typing import Any

from engine.requests import RequestStore
from resources.storage.db import Database


def claim_pages(
    url: str, page: int, watched: str, barrier: Any = None
) -> list[list[tuple[int, str]]]:
    """Claim pages of ``page`` requests until one comes back without ``watched``'s and none of
    its requests is pending; returns every page as ``(id, tenant)`` in claim order."""
    db = Database.from_url(url)
    try:
        store = RequestStore(db)
        store.get(1)  # connected before the start line
        if barrier is not None:
            barrier.wait(60)
        pages = []
        while True:
            claimed = store.claim_for_launch(page)
            pages.append([(r.id, r.tenant) for r in claimed])
            if not claimed:
                return pages
            if all(r.tenant != watched for r in claimed) and not store.find(
                status="pending", tenant=watched, limit=1
            ):
                return pages
    finally:
        db.dispose()
