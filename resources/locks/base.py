"""What every lock backend shares: owner token, fence, ``check()``, and the renewal watchdog."""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from types import TracebackType
from typing import Literal, Protocol

from sqlalchemy import exc as sa_exc

from resources.errors import LockLost, LockNotAcquired, SekaliError
from resources.locks.stats import LockObserver, NullLockObserver
from resources.storage.redis import REDIS_ERRORS
from resources.telemetry.tracing import set_attributes, span

log = logging.getLogger(__name__)
_STORE_ERRORS: tuple[type[Exception], ...] = (*REDIS_ERRORS, sa_exc.SQLAlchemyError, SekaliError)
Clock = Callable[[], float]

# -- the renewal watchdog ----------------------------------------------------------------------


class _Renewer:
    """One daemon thread per process extends every held lock that asked for renewal.

    A thread per lock would cost a thread start per acquisition; a heap of due times costs a
    push. Entries of released locks are skipped lazily.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, BaseLock, int]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def schedule(self, lock: BaseLock, due: float, generation: int) -> None:
        with self._cv:
            earliest = self._heap[0][0] if self._heap else None
            heapq.heappush(self._heap, (due, next(self._seq), lock, generation))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lock-renewer", daemon=True)
                self._thread.start()
            if earliest is None or due < earliest:
                self._cv.notify()  # only a new earliest deadline changes the thread's sleep

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    timeout = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._cv.wait(timeout)
                _, _, lock, generation = heapq.heappop(self._heap)
            try:
                next_due = lock._renew(generation)
            except Exception:  # noqa: BLE001 - the watchdog must outlive any one lock
                log.exception("lock renewal crashed", extra={"lock": lock.name})
                continue
            if next_due is not None:
                self.schedule(lock, next_due, generation)


_renewer: tuple[int, _Renewer] | None = None
_renewer_guard = threading.Lock()


def _get_renewer() -> _Renewer:
    global _renewer
    with _renewer_guard:
        if _renewer is None or _renewer[0] != os.getpid():
            _renewer = (os.getpid(), _Renewer())
        return _renewer[1]


# -- the common shape ---------------------------------------------------------------------------


DEFAULT_TTL_SECONDS = 30.0
"""A lock's TTL where its owner says none (the ``locks`` resource, the services built from
settings); the watchdog renews it every third of that while its holder runs."""


class BaseLock:
    """What every backend shares: hold bookkeeping, ``check()``, renewal, context manager.

    A lock object is reusable (acquire, release, acquire) but not re-entrant, and one holder
    uses it at a time. Subclasses implement ``_try_acquire``, ``_wait``, ``_extend_remote``,
    ``_release_remote`` and ``_read_owner``.
    """

    def __init__(
        self,
        name: str,
        *,
        ttl: float,
        auto_renew: bool,
        blocking_timeout: float | None,
        max_hold: float | None,
        observer: LockObserver | None,
        monotonic: Clock = time.monotonic,
    ) -> None:
        if not name:
            raise ValueError("lock name must be a non-empty string")
        if ttl <= 0:
            raise ValueError("ttl must be positive")
        if max_hold is not None and max_hold <= 0:
            raise ValueError("max_hold must be positive (or None for no bound)")
        self.name = name
        self.ttl = float(ttl)
        self.auto_renew = auto_renew
        self.blocking_timeout = blocking_timeout
        self.max_hold = max_hold
        self.observer: LockObserver = observer or NullLockObserver()
        self.monotonic = monotonic
        self.token: str | None = None
        self.fence: int = 0
        self._held = False
        self._generation = 0
        self._acquired_at = 0.0
        self._valid_until = 0.0
        self._lost: str | None = None
        self._state = threading.Lock()

    # backend hooks
    def _try_acquire(self, token: str, enqueue: bool) -> tuple[int | None, float | None]:
        """Return ``(fence, None)`` on a grant, else ``(None, hint)``: seconds worth waiting."""
        raise NotImplementedError

    def _wait(self, token: str, seconds: float) -> None:
        raise NotImplementedError

    def _leave_queue(self, token: str) -> None:
        return None

    def _extend_remote(self, token: str) -> bool:
        raise NotImplementedError

    def _release_remote(self, token: str) -> bool:
        raise NotImplementedError

    def _read_owner(self) -> str | None:
        raise NotImplementedError

    # the interface
    @property
    def held(self) -> bool:
        return self._held

    def acquire(self, blocking_timeout: float | None | Literal["default"] = "default") -> BaseLock:
        """Acquire or raise :class:`LockNotAcquired`. ``0`` tries once; ``None`` waits forever.

        The wait and the grant are a ``lock.acquire`` span of the current trace (with the fence).
        """
        with span("lock.acquire", lock=self.name, backend=type(self).__name__):
            self._acquire(blocking_timeout)
            set_attributes(fence=self.fence)
        return self

    def _acquire(self, blocking_timeout: float | None | Literal["default"] = "default") -> BaseLock:
        if self._held:
            raise RuntimeError(f"lock {self.name!r} is already held by this object")
        timeout = self.blocking_timeout if blocking_timeout == "default" else blocking_timeout
        token = uuid.uuid4().hex
        start = self.monotonic()
        deadline = None if timeout is None else start + max(0.0, float(timeout))
        enqueue = timeout is None or timeout > 0
        while True:
            # the grant's TTL starts no earlier than this attempt was sent, not the first one:
            # a waiter queued longer than the TTL would otherwise get a lock already "expired"
            sent = self.monotonic()
            fence, hint = self._try_acquire(token, enqueue)
            now = self.monotonic()
            if fence is not None:
                break
            remaining = None if deadline is None else deadline - now
            if remaining is not None and remaining <= 0:
                self._leave_queue(token)
                self.observer.record("acquire_failed", self.name)
                raise LockNotAcquired(self.name, now - start)
            wait = hint if hint is not None else 0.1
            if remaining is not None:
                wait = min(wait, remaining)
            self._wait(token, max(wait, 0.001))
        with self._state:
            self.token = token
            self.fence = fence
            self._held = True
            self._lost = None
            self._generation += 1
            self._acquired_at = now
            self._valid_until = sent + self.ttl  # counted from the granting request: conservative
            generation = self._generation
        self.observer.record("acquired", self.name)
        self.observer.record("wait_seconds", self.name, now - start)
        if self.auto_renew:
            _get_renewer().schedule(self, now + self.ttl / 3, generation)
        log.debug("lock acquired", extra={"lock": self.name, "fence": fence})
        return self

    def release(self) -> bool:
        """Release if still ours. Returns False if it had expired or the store did not answer
        (then it expires by itself). Never raises for those: the work is already done."""
        with self._state:
            if not self._held:
                return False
            self._held = False
            token = self.token
        assert token is not None
        self.observer.record("hold_seconds", self.name, self.monotonic() - self._acquired_at)
        try:
            released = self._release_remote(token)
        except _STORE_ERRORS as exc:
            log.warning("lock release failed: %s", exc, extra={"lock": self.name})
            return False
        if not released:
            log.warning("lock had expired before release", extra={"lock": self.name})
        return released

    def extend(self) -> None:
        """Push the expiry ``ttl`` from now. :class:`LockLost` if it is no longer ours."""
        if not self._held or self.token is None:
            raise LockLost(self.name, "not held")
        start = self.monotonic()
        try:
            ok = self._extend_remote(self.token)
        except _STORE_ERRORS as exc:
            raise self._mark_lost(f"store unavailable during extend ({exc})") from exc
        if not ok:
            raise self._mark_lost("another holder has it (extend refused)")
        self._valid_until = start + self.ttl

    def check(self, *, remote: bool = True) -> None:
        """Raise :class:`LockLost` unless the lock is still ours. Call before each side effect.

        Local checks first (no round trip): renewal saw the lock gone, the TTL ran out without
        a renewal, or the hold exceeded ``max_hold``. Then, if ``remote``, one read of the store
        (a GET on Redis, a SELECT on the database), bounded by the client's timeouts; a store
        that does not answer counts as lost, and so does an answer that came back after the TTL
        ran out.
        """
        if not self._held:
            raise LockLost(self.name, "not held")
        if self._lost is not None:
            raise self._mark_lost(self._lost)
        now = self.monotonic()
        if self.max_hold is not None and now - self._acquired_at > self.max_hold:
            raise self._mark_lost(f"held longer than max_hold={self.max_hold}s")
        if now >= self._valid_until:
            raise self._mark_lost("ttl ran out without a renewal")
        if not remote:
            return
        try:
            owner = self._read_owner()
        except _STORE_ERRORS as exc:
            raise self._mark_lost(f"store unavailable ({exc})") from exc
        if owner != self.token:
            reason = "the lock is gone" if owner is None else "another holder has it"
            raise self._mark_lost(reason)
        if self.monotonic() >= self._valid_until:
            # the answer says the lock was ours when the store read it, but the read was slow
            # enough for the TTL to run out since: nothing says it is still ours
            raise self._mark_lost("ttl ran out while the store was being asked")

    def _mark_lost(self, reason: str) -> LockLost:
        first = self._lost is None
        self._lost = reason
        if first:
            self.observer.record("lost", self.name)
            log.warning("lock lost: %s", reason, extra={"lock": self.name, "fence": self.fence})
        return LockLost(self.name, reason)

    def _renew(self, generation: int) -> float | None:
        """Called by the watchdog. Returns when to run again, or None to stop renewing.

        A renewal that fails (the store does not answer within the client's bound) is tried
        again every ``min(ttl / 10, 0.5)`` s; once the TTL counted from the last successful
        renewal has run out the lock is lost, for good: the holder's next ``check()`` raises
        :class:`LockLost`, and a later answer from the store does not bring it back.
        """
        if not self._held or generation != self._generation or self._lost is not None:
            return None
        now = self.monotonic()
        if self.max_hold is not None and now - self._acquired_at >= self.max_hold:
            log.warning("max_hold reached: renewal stops", extra={"lock": self.name})
            return None
        token = self.token
        assert token is not None
        try:
            ok = self._extend_remote(token)
        except _STORE_ERRORS as exc:
            self.observer.record("renew_failed", self.name)
            log.warning("lock renewal failed: %s", exc, extra={"lock": self.name})
            if self.monotonic() >= self._valid_until:
                self._lost = f"renewal failed until the ttl ran out ({exc})"
                return None
            return self.monotonic() + min(self.ttl / 10, 0.5)
        if generation != self._generation:
            return None
        if not ok:
            self._lost = "renewal refused: another holder has it"
            return None
        self._valid_until = now + self.ttl
        self.observer.record("renewed", self.name)
        return now + self.ttl / 3

    def __enter__(self) -> BaseLock:
        return self.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        state = f"held fence={self.fence}" if self._held else "free"
        return f"{type(self).__name__}({self.name!r}, {state})"




class LockFactory(Protocol):
    """Makes an unheld lock of one backend named ``name``, with the caller's bounds on the wait
    (``blocking_timeout``) and on renewal (``max_hold``); the backend's TTL is its own.
    ``functools.partial(RedisLock, client, ttl=30.0)`` is one."""

    def __call__(
        self, name: str, *, blocking_timeout: float | None, max_hold: float | None
    ) -> BaseLock: ...
