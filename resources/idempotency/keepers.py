"""The keepers of claims: threads that heartbeat a lease while its holder works, and tell the
holder to stop once the lease is lost or may have run out, or once the work's bound has passed.

:meth:`IdempotencyStore.keep_alive <resources.idempotency.store.IdempotencyStore.keep_alive>`
and ``keep_alive_many`` start them; a job sees one as a :class:`Keeper`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from resources.errors import HandlerTimedOut, LeaseLost, SekaliError
from resources.idempotency.records import Claim

logger = logging.getLogger(__name__)


class LeaseStore(Protocol):
    """What a keeper needs of the ledger (:class:`IdempotencyStore` is one)."""

    @property
    def clock(self) -> Callable[[], float]: ...

    def heartbeat(self, claim: Claim, *, until: float | None = None) -> float: ...

    def heartbeat_many(self, claims: Sequence[Claim]) -> tuple[float, set[str]]: ...

    def fresh_for(self, claims: Sequence[Claim]) -> float: ...


class Keeper(Protocol):
    """What a job sees of the keeper of its claim. ``until``: the monotonic time at which the
    work's bound runs out (None: unbounded); from then on :meth:`check` and :meth:`confirm`
    raise :class:`HandlerTimedOut` and no renewal is made."""

    @property
    def until(self) -> float | None: ...

    def check(self) -> None:
        """Raise :class:`LeaseLost` if a heartbeat found the lease taken over."""

    def confirm(self) -> None:
        """Make sure the lease is still ours now, asking the store unless it is surely fresh."""


class LeaseKeeper:
    """A daemon thread that heartbeats one claim until stopped, and tells its holder to stop.

    Each heartbeat extends the lease from the moment it was sent; the keeper remembers the
    expiry of the last one the store confirmed. :meth:`check` raises :class:`LeaseLost` once a
    heartbeat found the lease taken over, or once that confirmed expiry has passed: from then on
    another worker may take the key over, so the holder must stop before its next effect, even
    while a heartbeat is still stuck on a database that does not answer. A failed heartbeat
    (``StoreUnavailable``: every store call gives up within ``DatabaseTimeouts.bound``) is tried
    again after a quarter of the interval; once the confirmed expiry has passed the keeper stops
    beating, so a database that comes back does not revive a lease its holder gave up::

        t=0    A claims K (lease 60 s, heartbeat every 20 s); the database freezes at t=5
        t=20   A's heartbeat: no answer; StoreUnavailable at t=55 at the latest (35 s bound)
        t=60   the lease A last confirmed (t=0 + 60) runs out: A's check() raises LeaseLost
        later  the database answers again; B's begin(K) takes over; A writes nothing more

    With ``runtime`` (the work's bound, seconds from ``confirmed_at``) the keeper renews only
    until the bound: no beat after it, and none carries the lease past the claim's first expiry
    + ``runtime`` (store time), so a holder that hangs (a call that never returns) gives its key
    up within its bound + one lease whatever its process does. From the bound on, :meth:`check`
    and :meth:`confirm` raise :class:`HandlerTimedOut`::

        t=0    A claims K (lease 30 s, bound 120 s); A's call to a downstream never returns
        t=120  the bound: no more beats; A's confirm() (a late send) raises HandlerTimedOut
        t<=150 the last lease runs out; B's begin(K) takes over (a crash counted against K)
    """

    def __init__(
        self,
        store: LeaseStore,
        claim: Claim,
        interval: float,
        confirmed_at: float | None = None,
        *,
        runtime: float | None = None,
    ) -> None:
        self.store = store
        self.claim = claim
        self.interval = interval
        self.lost: LeaseLost | None = None
        self.expires = claim.lease_expires_at
        self.beats = 0
        self.confirmed_at = confirmed_at if confirmed_at is not None else -math.inf
        self.runtime = runtime
        start = confirmed_at if confirmed_at is not None else time.monotonic()
        self._until = None if runtime is None else start + runtime
        self.cap = None if runtime is None else claim.lease_expires_at + runtime
        self.overran: HandlerTimedOut | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease:{claim.key}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def until(self) -> float | None:
        return self._until

    def met(self) -> None:
        """The work returned within its bound: lift it (what follows, the completion, is the
        store's own call, bounded by the store's timeouts)."""
        if not self._overran():
            self._until = self.cap = None

    def _overran(self) -> bool:
        if self._until is None or time.monotonic() < self._until:
            return False
        if self.overran is None:
            assert self.runtime is not None
            self.overran = HandlerTimedOut(self.claim.key, self.runtime)
        return True

    def _run(self) -> None:
        delay = self.interval
        while not self._stop.wait(delay):
            if self._overran():
                return  # the bound: renew no more, the lease runs out on its own
            try:
                self._beat()
                self.beats += 1
                delay = self.interval
            except LeaseLost as exc:
                self.lost = exc
                return
            except Exception:  # noqa: BLE001 - store briefly unavailable: beat again soon
                if self._expired():
                    logger.warning("lease of %s ran out unrenewed; the holder must stop",
                                   self.claim.key, exc_info=True)
                    return
                logger.warning("heartbeat of %s failed; retrying", self.claim.key, exc_info=True)
                delay = self.interval / 4

    def _expired(self) -> bool:
        if self.store.clock() < self.expires:
            return False
        if self.lost is None:
            self.lost = LeaseLost(
                self.claim.key,
                self.claim.owner_token,
                reason="ran out before a heartbeat could renew it (the store did not answer)",
            )
        return True

    def _beat(self) -> None:
        asked = time.monotonic()
        self.expires = self.store.heartbeat(self.claim, until=self.cap)
        self.confirmed_at = asked

    def check(self) -> None:
        """Raise :class:`LeaseLost` if the lease was taken over or may have run out, and
        :class:`HandlerTimedOut` once the work's bound has passed."""
        if self.lost is not None:
            raise self.lost
        if self._overran():
            assert self.overran is not None
            raise self.overran
        if self._expired():
            assert self.lost is not None
            raise self.lost

    def confirm(self) -> None:
        """Heartbeat now, in this thread, unless the claim or a heartbeat was confirmed within
        :meth:`IdempotencyStore.fresh_for` (monotonic time, so a paused process always asks).
        Raises :class:`LeaseLost` if the key was taken over."""
        self.check()
        if time.monotonic() - self.confirmed_at < self.store.fresh_for([self.claim]):
            return
        try:
            self._beat()
        except LeaseLost as exc:
            self.lost = exc
            raise

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class BatchLeaseKeeper:
    """One daemon thread that keeps every claim of a batch alive with one statement per beat.

    A key leaves the batch with :meth:`release` once it completed or failed (its later beats
    would only report it "lost"). :meth:`keeper_for` gives each job its own :class:`Keeper`.

    It stops its jobs exactly as :class:`LeaseKeeper` stops one: a key's :meth:`check` raises
    :class:`LeaseLost` once a beat found the key taken over, or once the expiry the store last
    confirmed for it has passed (no beat got through: from then on another worker may take the
    key over), so each job stops before its next effect. An expired key is never beaten again,
    so a store that comes back does not revive a lease its holder gave up.

    :meth:`bound` gives a key its work's bound once its handler starts (the keys of a batch
    run one after another): from then on the key is beaten no more and its :meth:`check`
    raises :class:`HandlerTimedOut`, as :class:`LeaseKeeper` does with ``runtime``. No beat
    carries a bounded key past its bound's start + the bound + its lease (store time), even one
    checked just before the bound and written after it: that key is beaten alone, capped.
    """

    def __init__(
        self,
        store: LeaseStore,
        claims: Sequence[Claim],
        interval: float,
        confirmed_at: float | None = None,
    ) -> None:
        self.store = store
        self.interval = interval
        self.lost: dict[str, LeaseLost] = {}
        self.beats = 0
        self.confirmed_at = confirmed_at if confirmed_at is not None else -math.inf
        self._claims = {claim.key: claim for claim in claims}
        self._expires = {claim.key: claim.lease_expires_at for claim in claims}
        self._until: dict[str, tuple[float, float]] = {}
        self._cap: dict[str, float] = {}
        self.overran: dict[str, HandlerTimedOut] = {}
        self._lock = threading.Lock()
        self._beating = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease:batch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def release(self, key: str) -> None:
        with self._lock:
            self._claims.pop(key, None)
            self._expires.pop(key, None)

    def bound(self, key: str, runtime: float) -> float:
        """Start ``key``'s bound of ``runtime`` seconds now; returns its monotonic end."""
        until = time.monotonic() + runtime
        with self._lock:
            self._until[key] = (until, runtime)
            claim = self._claims.get(key)
            if claim is not None:
                self._cap[key] = self.store.clock() + runtime + claim.lease_seconds
        return until

    def until(self, key: str) -> float | None:
        found = self._until.get(key)
        return None if found is None else found[0]

    def met(self, key: str) -> None:
        """``key``'s work returned within its bound: lift it, so the batch's completion after
        its later members ran is not refused."""
        if self._overran(key) is None:
            with self._lock:
                self._until.pop(key, None)
                self._cap.pop(key, None)

    def _overran(self, key: str) -> HandlerTimedOut | None:
        found = self._until.get(key)
        if found is None or time.monotonic() < found[0]:
            return None
        with self._lock:
            return self.overran.setdefault(key, HandlerTimedOut(key, found[1]))

    def check(self, key: str) -> None:
        """Raise :class:`LeaseLost` if ``key`` was taken over or its lease may have run out,
        :class:`HandlerTimedOut` once its bound has passed."""
        error: SekaliError | None = self.lost.get(key) or self._overran(key)
        error = error or self._expired(key)
        if error is not None:
            raise error

    def _expired(self, key: str) -> LeaseLost | None:
        with self._lock:
            claim = self._claims.get(key)
            if claim is None or self.store.clock() < self._expires[key]:
                return None
            return self.lost.setdefault(
                key,
                LeaseLost(
                    key,
                    claim.owner_token,
                    reason="ran out before a heartbeat could renew it (the store did not answer)",
                ),
            )

    def confirm(self, key: str) -> None:
        """:meth:`LeaseKeeper.confirm` for one key; a heartbeat, when needed, beats them all."""
        self.check(key)
        with self._lock:
            claims = list(self._claims.values())
        if time.monotonic() - self.confirmed_at >= self.store.fresh_for(claims):
            self._beat()
            self.check(key)

    def keeper_for(self, claim: Claim) -> Keeper:
        return _BatchMember(self, claim.key)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
                self.beats += 1
            except Exception:  # noqa: BLE001 - store briefly unavailable: beat again
                with self._lock:
                    keys = list(self._claims)
                if all(self._expired(key) is not None for key in keys):
                    logger.warning("the batch's leases ran out unrenewed; its jobs must stop",
                                   exc_info=True)
                    return
                logger.warning("heartbeat of a batch failed; retrying", exc_info=True)

    def _beat(self) -> None:
        with self._beating:
            with self._lock:
                keys = list(self._claims)
            for key in keys:
                self._expired(key)
                self._overran(key)
            with self._lock:
                live = [c for key, c in self._claims.items()
                        if key not in self.lost and key not in self.overran]
            if not live:
                return
            asked = time.monotonic()
            now = self.store.clock()
            capped: list[Claim] = []
            together: list[Claim] = []
            for claim in live:
                past = now + claim.lease_seconds > self._cap.get(claim.key, math.inf)
                (capped if past else together).append(claim)
            if together:
                expires, lost = self.store.heartbeat_many(together)
                self._renewed(together, lost, expires)
            for claim in capped:
                try:
                    expires = self.store.heartbeat(claim, until=self._cap[claim.key])
                except LeaseLost:
                    self._renewed([claim], {claim.key}, now)
                else:
                    self._renewed([claim], set(), expires)
            self.confirmed_at = asked

    def _renewed(self, claims: Sequence[Claim], lost: set[str], expires: float) -> None:
        """What a beat of ``claims`` found: ``lost`` taken over, the others valid to ``expires``."""
        with self._lock:
            for claim in claims:
                if claim.key in lost and claim.key in self._claims:
                    self.lost[claim.key] = LeaseLost(claim.key, claim.owner_token)
                elif claim.key in self._expires:
                    self._expires[claim.key] = expires


@dataclass(frozen=True)
class _BatchMember:
    keeper: BatchLeaseKeeper
    key: str

    def check(self) -> None:
        self.keeper.check(self.key)

    def confirm(self) -> None:
        self.keeper.confirm(self.key)

    @property
    def until(self) -> float | None:
        return self.keeper.until(self.key)
