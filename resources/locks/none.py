"""No lock: for jobs that are idempotent and overwrite-safe, where a lock adds only contention."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any, Literal

from resources.locks.base import BaseLock

log = logging.getLogger(__name__)
Clock = Callable[[], float]

# -- none -------------------------------------------------------------------------------------


class NoLock(BaseLock):
    """The same interface, locking nothing: for idempotent, overwrite-safe jobs.

    ``fence`` is always 0 and ``check()`` never raises: do not pair it with fenced writes.
    """

    def __init__(self, name: str = "nolock", *, ttl: float = 60.0, **_ignored: Any) -> None:
        super().__init__(
            name, ttl=ttl, auto_renew=False, blocking_timeout=0, max_hold=None, observer=None
        )

    def acquire(self, blocking_timeout: float | None | Literal["default"] = "default") -> NoLock:
        self.token = uuid.uuid4().hex
        self.fence = 0
        self._held = True
        return self

    def release(self) -> bool:
        was = self._held
        self._held = False
        return was

    def extend(self) -> None:
        return None

    def check(self, *, remote: bool = True) -> None:
        return None

    def __enter__(self) -> NoLock:
        return self.acquire()


