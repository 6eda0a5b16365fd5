"""The anti-stampede cache: one rebuild per expiry across all processes (invariant 4 of
docs/design.md).

What is guaranteed, for one key, across every process sharing the Redis and namespace:

- **Hits cost one GET.** A fresh value is read with a plain ``GET`` and judged in Python (soft
  and hard expiry; the XFetch draw only when the value is near its refresh point): one round trip
  and one JSON decode; anything else goes to the script below, which judges again atomically.
- **One loader per expiry.** A miss runs one Lua script: read the envelope and, if it is missing
  or hard-expired, ``SET NX PX`` the rebuild lock with a random token. Only the winner runs the
  loader. The losers register as waiters in that same script and block on ``BLPOP`` of the key's
  signal list; the winner's write script pushes one wake-up per registered waiter, carrying the
  winner's token and the stored envelope, so a waiter of that rebuild returns the value without
  another round trip; nobody polls and nobody sleeps until a timeout. The winner encodes the value
  once and wakes the waiters before it decodes its own copy. In one process, concurrent callers
  of the same key share one flight: one Redis round trip and one load (:class:`SingleFlight`).
- **Stale-while-revalidate.** Within ``stale_ttl`` after the soft expiry a caller gets the stale
  value at once (from its one GET); a background task (thread pool, one per key per process) runs
  the script, and the same ``NX`` lock lets at most one refresh run across all processes.
- **Safe invalidation.** ``invalidate`` bumps a version and deletes the envelope in one script.
  The write script checks the lock token *and* the version read when the lock was taken, so a
  rebuild that started before the invalidation cannot store its older value after it::

      t=0.0  A misses, takes the lock (version 7), starts reading the database (old row)
      t=0.1  a job commits a new row, then calls invalidate(K): version 8, envelope deleted
      t=0.3  A's loader returns the old row; write script sees version 8 != 7: nothing stored
      t=0.4  B misses, takes the lock (version 8), loads and stores the new row

- **Bounded waits.** A waiter gives up after ``wait_timeout`` (a stale value is never waited for:
  it is returned at once). Each wake-up (and at least every ``safety_tick`` seconds, in case the
  holder died; its lock expires after ``lock_ttl``) re-runs the miss script, which also tries to
  take the lock, so the last attempt is one more bounded try to load. If that fails too the caller
  gets :class:`CacheLoadTimeout`. Each BLPOP asks the server for at most half the client's
  socket timeout, so a healthy server always answers first; a Redis that does not answer makes
  any call raise :class:`StoreUnavailable` within the client's bound (``RedisTimeouts.bound``,
  7 s by default), and ``get_or_load`` within ``wait_timeout`` plus that bound. Loaders must
  finish within ``lock_ttl`` (the lock is not renewed); a slower loader's write is refused and
  another caller takes over.
- **Loader failures.** The loader's own callers (in-process flight included) get its exception.
  Waiters in other processes wake and get :class:`CacheLoaderFailed` with its class and message:
  no second stampede. A failed background refresh keeps the stale value (stale-if-error) and
  holds the lock for ``error_backoff`` so the refresh is not retried by every caller. With
  ``negative_ttl`` the failure is cached: callers get :class:`CacheLoaderFailed` without loading.
- **Jitter and early refresh.** Every write's TTL is scaled by ``1 + jitter * U(-1, 1)``. With
  ``beta > 0`` (the default, 1) a fresh value is refreshed early with probability
  ``exp(-gap / (beta * delta))`` (XFetch: ``now - delta * beta * ln(rand) >= expiry``; delta = the
  stored compute time), so a slow loader's hot key is rebuilt by one caller before it expires.
- **A cohort loaded together comes due at an even rate** (``spread_first_refresh``, on by
  default). Keys loaded on misses at the same moment (a cold start, an invalidation wave) would
  otherwise all come due within ``2 * jitter`` of one TTL. A value loaded on a miss therefore gets
  its first refresh point drawn uniformly within its TTL (the renewal process's equilibrium:
  refreshes then arrive at the steady rate from the start); its expiry stays ``ttl`` (jittered).
  Between that point and the expiry the value is served at once (counted as a stale hit) while one
  background refresh runs; later writes use ``ttl`` with jitter as usual. The cost is one early
  load per key after a miss.

Time (``clock``) and randomness (``random``) are injected; workers' clocks must agree to well
within a TTL since expiries are absolute times written by one process and read by others.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random as _random
import re
import threading
import time
import uuid
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import redis

from resources.cache.scripts import (
    FAIL,
    FAIL_KEYS,
    FETCH,
    FETCH_KEYS,
    INVALIDATE,
    INVALIDATE_KEYS,
    PREFIX,
    WRITE,
    WRITE_KEYS,
    KeyLayout,
    keys_for,
)
from resources.cache.stats import CacheRecorder
from resources.errors import CacheLoaderFailed, CacheLoadTimeout, StoreUnavailable
from resources.storage.redis import RedisClient, Script, client_timeouts, redis_client
from resources.telemetry.tracing import set_attributes, span, tracing_enabled

log = logging.getLogger(__name__)

T = TypeVar("T")
Loader = Callable[[], Any]


class _NoValue:
    """The marker for "nothing cached": a cached ``None`` is a value, not a miss."""

    _instance: _NoValue | None = None

    def __new__(cls) -> _NoValue:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "NO_VALUE"

    def __bool__(self) -> bool:
        return False

    def __reduce__(self) -> str:
        return "NO_VALUE"


NO_VALUE: Final = _NoValue()


@dataclass(frozen=True)
class Envelope:
    """A cached value with its soft and hard expiry, compute time, version and the TTLs used."""

    value: Any
    soft: float
    hard: float
    delta: float
    version: int
    ttl: float
    stale_ttl: float

    def encode(self) -> str:
        return self.encode_raw(
            json.dumps(self.value), self.soft, self.hard, self.delta, self.version, self.ttl,
            self.stale_ttl,
        )

    @staticmethod
    def encode_raw(
        value_json: str,
        soft: float,
        hard: float,
        delta: float,
        version: int,
        ttl: float,
        stale_ttl: float,
    ) -> str:
        """The envelope around a value already encoded as JSON (encoded once per load)."""
        # Header first and in this order: the Lua scripts read s, h, d without decoding the value.
        return (
            f'{{"s":{soft!r},"h":{hard!r},"d":{delta!r},"n":{version},'
            f'"t":{ttl!r},"st":{stale_ttl!r},"v":{value_json}}}'
        )

    @classmethod
    def decode(cls, raw: bytes | str) -> Envelope:
        d = json.loads(raw)
        return cls(d["v"], d["s"], d["h"], d["d"], d["n"], d["t"], d["st"])


_HEADER: Final = re.compile(
    rb'\{"s":([^,]+),"h":([^,]+),"d":([^,]+),"n":[^,]+,"t":[^,]+,"st":[^,]+,"v":'
)
"""The envelope's header as :meth:`Envelope.encode_raw` writes it; ``end()`` is where the
value's JSON starts."""
_scan: Final[Callable[[str, int], tuple[Any, int]]] = (
    json.JSONDecoder().scan_once  # type: ignore[attr-defined]
)
"""The JSON scanner itself: decodes the value where the header ends, in place."""


def value_of(raw: bytes, header: re.Match[bytes]) -> Any:
    """The value of a stored envelope whose header ``_HEADER`` matched, without decoding the
    header: the hit path judges freshness from three header numbers, and building the whole
    envelope as a dict cost about as much again as the value itself."""
    return _scan(raw.decode(), header.end())[0]


def jittered(ttl: float, jitter: float, rand: float) -> float:
    """``ttl`` scaled by ``1 + jitter * (2 * rand - 1)``: uniform within +/- jitter."""
    return ttl * (1.0 + jitter * (2.0 * rand - 1.0))


_XFETCH_NEGLIGIBLE = 40.0
"""A value further than ``40 * beta * delta`` from its refresh point refreshes early with
probability ``exp(-40)`` (4e-18): the hit path then skips the XFetch draw."""


def xfetch_factor(beta: float, rand: float) -> float:
    """``-beta * ln(rand)``; refresh early when ``now + delta * factor >= soft expiry``."""
    if beta <= 0:
        return 0.0
    return -beta * math.log(max(rand, 1e-300))


class _Call:
    __slots__ = ("done", "error", "result")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


_LEADING: Final = object()
"""A flight's entry while nobody has joined its leader: the uncontended call (every hit)
allocates nothing; the first follower replaces it with a :class:`_Call` to wait on."""


class SingleFlight:
    """Callers of one key in one process share one call of ``fn`` and its result or error.

    An uncontended call takes the lock twice and allocates nothing, so the hit path stays cheap.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[Hashable, Any] = {}

    def run(self, key: Hashable, fn: Callable[..., T], *args: Any) -> tuple[T, bool]:
        """Return (``fn(*args)``, led): ``led`` is True for the one caller that ran ``fn``."""
        calls = self._calls
        with self._lock:
            call = calls.get(key)
            if call is None:
                calls[key] = _LEADING
            elif call is _LEADING:
                call = calls[key] = _Call()
        if call is not None:
            call.done.wait()
            if call.error is not None:
                raise call.error
            return call.result, False
        try:
            result = fn(*args)
        except BaseException as exc:
            with self._lock:
                joined = calls.pop(key)
            if joined is not _LEADING:
                joined.error = exc
                joined.done.set()
            raise
        with self._lock:
            joined = calls.pop(key)
        if joined is not _LEADING:
            joined.result = result
            joined.done.set()
        return result, True


@dataclass(frozen=True)
class CachePolicy:
    """What a :class:`StampedeCache` decides, apart from its I/O (the Redis client, the clock,
    the randomness), as dogpile's ``Lock`` takes its expiry apart from the mutex and the
    creator. The module docstring says what each field buys; one policy serves many caches.
    """

    ttl: float = 60.0
    """Seconds a value is fresh (before jitter)."""
    stale_ttl: float = 0.0
    """Seconds after ``ttl`` a stale value is served at once while one refresh runs."""
    jitter: float = 0.1
    """Every write's TTL is scaled by ``1 + jitter * U(-1, 1)``."""
    beta: float = 1.0
    """XFetch's early-refresh eagerness (0: never early)."""
    spread_first_refresh: bool = True
    """A value loaded on a miss gets its first refresh point drawn within its TTL."""
    lock_ttl: float = 15.0
    """Seconds the rebuild lock lives: a loader must finish within it."""
    wait_timeout: float = 20.0
    """Seconds a waiter waits for another caller's load before :class:`CacheLoadTimeout`."""
    negative_ttl: float = 0.0
    """Seconds a loader's failure is cached (0: not cached)."""
    error_backoff: float = 1.0
    """Seconds a failed background refresh holds the lock, so not every caller retries it."""
    safety_tick: float = 2.0
    """A waiter re-checks at least this often, in case the loader's holder died."""
    refresh_workers: int = 2
    """Threads running background refreshes in this process."""
    stats_flush_interval: float = 1.0
    """Seconds between flushes of the hit/miss counters to Redis."""
    hot_half_life: float = 300.0
    """Half-life, in seconds, of the hot-key scores."""


class StampedeCache:
    """Get-or-load over Redis with one rebuild per expiry. Thread-safe; share one per process."""

    def __init__(
        self,
        client: RedisClient,
        *,
        namespace: str,
        policy: CachePolicy | None = None,
        clock: Callable[[], float] = time.time,
        random: Callable[[], float] = _random.random,
        **policy_fields: Any,
    ) -> None:
        """``policy`` (the defaults of :class:`CachePolicy` when None), with any of its fields
        given by name overriding it (``ttl=30``: the policy's other fields stay); an unknown
        name is a TypeError."""
        if not namespace:
            raise ValueError("namespace must be a non-empty string")
        self.policy = dataclasses.replace(policy or CachePolicy(), **policy_fields)
        self.client = client
        self._timeouts = client_timeouts(client)
        self.namespace = namespace
        self.clock = clock
        self.random = random
        self.recorder = CacheRecorder(
            client,
            namespace,
            flush_interval=self.policy.stats_flush_interval,
            half_life=self.policy.hot_half_life,
            clock=clock,
        )
        self._flight = SingleFlight()
        self._refreshes = SingleFlight()
        self._pool = ThreadPoolExecutor(
            self.policy.refresh_workers, thread_name_prefix="cache-refresh")
        self._pending: set[Future[Any]] = set()
        self._pending_lock = threading.Lock()
        self._refreshing: set[str] = set()
        # keeps=None: a cache may live on an evicting Redis (docs/locks.md, "Eviction")
        self._fetch = Script(client, FETCH, keeps=None)
        self._write = Script(client, WRITE, keeps=None)
        self._fail = Script(client, FAIL, keeps=None)
        self._invalidate = Script(client, INVALIDATE, keeps=None)

    @property
    def ttl(self) -> float:
        """The policy's fresh lifetime (:attr:`CachePolicy.ttl`)."""
        return self.policy.ttl

    @classmethod
    def from_url(cls, url: str, *, namespace: str, **kwargs: Any) -> StampedeCache:
        """A cache on the Redis at ``url``; no connection is opened until the first call."""
        return cls(redis_client(url), namespace=namespace, **kwargs)

    # -- public API -------------------------------------------------------------------------

    def get_or_load(
        self,
        key: str,
        loader: Loader,
        *,
        ttl: float | None = None,
        stale_ttl: float | None = None,
        jitter: float | None = None,
    ) -> Any:
        """The value of ``key``, loading it with ``loader()`` (JSON-serialisable) on a miss.

        ``ttl`` is the fresh lifetime, ``stale_ttl`` how long after it a stale value may still be
        served while one refresh runs, ``jitter`` the +/- fraction applied to every write's TTL.
        Raises the loader's exception (this caller loaded), :class:`CacheLoaderFailed` (another
        caller's load failed, or negative cache) or :class:`CacheLoadTimeout`.
        """
        started = time.monotonic()
        try:
            if tracing_enabled():
                with span("cache.get_or_load", cache_key=key, namespace=self.namespace):
                    (value, outcome), led = self._flight.run(
                        key, self._look, key, loader, ttl, stale_ttl, jitter
                    )
                    set_attributes(outcome=outcome, led=led)
            else:  # the hit path: no span to open and close when nobody collects them
                (value, outcome), led = self._flight.run(
                    key, self._look, key, loader, ttl, stale_ttl, jitter
                )
        except Exception:
            self.recorder.record(key, "misses", access=True)
            raise
        if outcome == "hit":
            self.recorder.hit(key)
            return value
        if not led and outcome in ("loaded", "waited"):
            outcome = "waited"
            self.recorder.record(key, "waits")
            self.recorder.record(key, "wait_time", time.monotonic() - started)
        self._count(key, outcome)
        return value

    def _look(
        self,
        key: str,
        loader: Loader,
        ttl: float | None,
        stale_ttl: float | None,
        jitter: float | None,
    ) -> tuple[Any, str]:
        """One flight: the hit path (one GET, judged here), else the script. Concurrent callers
        of one key in this process share the flight, so a cold stampede costs one GET."""
        try:
            raw: bytes | None = self.client.get(  # type: ignore[assignment]
                f"{PREFIX}{{{self.namespace}:{key}}}"
            )
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise StoreUnavailable(f"Redis did not answer: {exc}; retry later") from exc
        factor: float | None = None  # the call's one XFetch draw, made only when it can matter
        if raw is not None:
            header = _HEADER.match(raw)  # value_of(), inlined: this is every hit
            if header is None:
                raise ValueError(f"cache key {key!r} holds no envelope")
            soft, hard, delta = float(header[1]), float(header[2]), float(header[3])
            now = self.clock()
            if now < hard:
                gap = soft - now
                if gap > 0 and gap > delta * self.policy.beta * _XFETCH_NEGLIGIBLE:
                    return _scan(raw.decode(), header.end())[0], "hit"
                factor = self._xfetch_factor()
                if now + delta * factor < soft:
                    return value_of(raw, header), "hit"
                # Stale or XFetch-early: answer now; the lock attempt runs in the background.
                self._refresh_soon(key, loader, self._options(ttl, stale_ttl, jitter), factor, now)
                return value_of(raw, header), "stale" if now >= soft else "early"
        opts = self._options(ttl, stale_ttl, jitter)
        if factor is None:
            factor = self._xfetch_factor()
        return self._resolve(key, loader, opts, force=False, factor=factor)

    def get(self, key: str) -> Any:
        """The cached value (fresh or within its stale window), or ``NO_VALUE``; never loads."""
        envelope = self.envelope(key)
        if envelope is None or self.clock() >= envelope.hard:
            return NO_VALUE
        return envelope.value

    def envelope(self, key: str) -> Envelope | None:
        """The stored envelope (for inspection and tests), or None."""
        raw = self._call(self.client.get, KeyLayout.of(self.namespace, key).env)
        return None if raw is None else Envelope.decode(raw)

    def refresh(
        self,
        key: str,
        loader: Loader,
        *,
        ttl: float | None = None,
        stale_ttl: float | None = None,
        jitter: float | None = None,
    ) -> Any:
        """Force a rebuild now, under the same single flight as a miss.

        Without ``ttl``/``stale_ttl`` the ones stored in the current envelope are reused (else the
        cache defaults). If another caller is already rebuilding, returns the current value (or
        waits for it, if there is none) instead of loading twice.
        """
        current = self.envelope(key)
        opts = self._options(
            ttl if ttl is not None else (current.ttl if current else None),
            stale_ttl if stale_ttl is not None else (current.stale_ttl if current else None),
            jitter,
        )
        (value, _), _ = self._refreshes.run(
            key, lambda: self._resolve(key, loader, opts, force=True)
        )
        return value

    def invalidate(self, key: str) -> int:
        """Drop ``key`` and fence off rebuilds in flight; call it after the database commit.

        Returns the new version. Any rebuild that took its lock before this call cannot store its
        value afterwards; the next reader loads afresh.
        """
        layout = KeyLayout.of(self.namespace, key)
        keep = str(int(max(self.policy.lock_ttl * 4, 86400) * 1000))
        return int(
            self._call(self._invalidate, keys=keys_for(layout, INVALIDATE_KEYS), args=[keep])
        )

    def hot_keys(self, n: int = 10) -> list[tuple[str, float]]:
        """The ``n`` most accessed keys (decayed counts, all processes), hottest first."""
        return self.recorder.hot_keys(n)

    def stats(self) -> dict[str, dict[str, float]]:
        """Counters per key pattern (``user:*``), summed over all processes of the namespace."""
        return self.recorder.stats()

    def flush_stats(self) -> None:
        """Send this process's counters to Redis now (they also go at most every second)."""
        self.recorder.flush()

    def wait_for_refreshes(self, timeout: float | None = None) -> None:
        """Block until the background refreshes started by this instance have finished."""
        with self._pending_lock:
            pending = list(self._pending)
        for future in pending:
            future.exception(timeout=timeout)

    def close(self) -> None:
        """Finish background refreshes, flush the counters, close the connection pool."""
        self._pool.shutdown(wait=True)
        self.recorder.close()
        self.client.close()

    # -- the algorithm --------------------------------------------------------------------------

    def _options(
        self, ttl: float | None, stale_ttl: float | None, jitter: float | None
    ) -> tuple[float, float, float]:
        opts = (
            self.policy.ttl if ttl is None else ttl,
            self.policy.stale_ttl if stale_ttl is None else stale_ttl,
            self.policy.jitter if jitter is None else jitter,
        )
        if opts[0] <= 0 or opts[1] < 0 or not 0 <= opts[2] < 1:
            raise ValueError("need ttl > 0, stale_ttl >= 0 and 0 <= jitter < 1")
        return opts

    def _xfetch_factor(self) -> float:
        return xfetch_factor(self.policy.beta, 1.0 - self.random()) if self.policy.beta > 0 else 0.0

    def _resolve(
        self,
        key: str,
        loader: Loader,
        opts: tuple[float, float, float],
        *,
        force: bool,
        factor: float = 0.0,
    ) -> tuple[Any, str]:
        """One flight's work after the hit path missed (or a forced refresh). Returns
        (value, outcome): hit, stale, early, loaded or waited."""
        layout = KeyLayout.of(self.namespace, key)
        deadline = time.monotonic() + self.policy.wait_timeout
        wait_started: float | None = None
        waited_on: bytes | None = None
        while True:
            token = uuid.uuid4().hex
            # A forced refresh that had to wait took another caller's rebuild as its own:
            # forcing again would load a second time for one expiry.
            forced = force and wait_started is None
            reply = self._fetch_once(layout, token, factor, force=forced, waited_on=waited_on)
            state = reply[0].decode()
            if state == "fresh":
                if wait_started is not None:
                    self.recorder.record(key, "wait_time", time.monotonic() - wait_started)
                    return Envelope.decode(reply[1]).value, "waited"
                return Envelope.decode(reply[1]).value, "hit"
            if state in ("stale", "early"):
                envelope = Envelope.decode(reply[1])
                if reply[2] != 1:
                    return envelope.value, state
                version = reply[3].decode()
                if force:
                    return self._load(key, layout, loader, token, version, opts, hold=0.0), "loaded"
                if state == "early":
                    self.recorder.record(key, "early_refreshes")
                self._refresh_in_background(key, layout, loader, token, version, opts)
                return envelope.value, state
            if state in ("neg", "failed"):
                raise _failed(key, reply[5])
            if reply[2] == 1:
                outcome = "loaded"
                if wait_started is not None:
                    outcome = "waited"
                    self.recorder.record(key, "wait_time", time.monotonic() - wait_started)
                value = self._load(
                    key, layout, loader, token, reply[3].decode(), opts, hold=0.0, cold=True
                )
                return value, outcome
            holder, marker = reply[4], reply[5]
            if marker is not None and json.loads(marker)["token"].encode() in (holder, waited_on):
                raise _failed(key, marker)
            if holder is not None:
                waited_on = holder
            now = time.monotonic()
            if wait_started is None:
                wait_started = now
                self.recorder.record(key, "waits")
            if now >= deadline:
                self.recorder.record(key, "wait_time", now - wait_started)
                raise CacheLoadTimeout(key, now - wait_started)
            tick = self._timeouts.blocking_wait(min(deadline - now, self.policy.safety_tick))
            woken = self._call(self.client.blpop, [layout.signal], timeout=tick)
            if woken is not None and waited_on is not None:
                # The holder we wait for pushed "<its token> <the envelope it stored>": that is
                # the fresh value, no second round trip. A wake-up from an older rebuild, a
                # refused write or a failure carries no envelope of ours: look again.
                holder_token, _, envelope = woken[1].partition(b" ")
                if envelope and holder_token == waited_on:
                    self.recorder.record(key, "wait_time", time.monotonic() - wait_started)
                    return json.loads(envelope)["v"], "waited"

    def _load(
        self,
        key: str,
        layout: KeyLayout,
        loader: Loader,
        token: str,
        version: str,
        opts: tuple[float, float, float],
        *,
        hold: float,
        cold: bool = False,
    ) -> Any:
        """Run the loader as lock holder and store its value (or its failure). ``cold``: nothing
        was cached (a miss), so the first refresh point is spread over the TTL."""
        ttl, stale_ttl, jitter = opts
        started = self.clock()
        self.recorder.record(key, "loads")
        try:
            encoded = json.dumps(loader())
        except Exception as exc:
            self.recorder.record(key, "errors")
            marker = json.dumps(
                {"token": token, "class": type(exc).__name__, "message": str(exc)[:500]}
            )
            self._call(
                self._fail,
                keys=keys_for(layout, FAIL_KEYS),
                args=[
                    token,
                    marker,
                    str(int((self.policy.wait_timeout + self.policy.lock_ttl) * 1000)),
                    str(int(self.policy.negative_ttl * 1000)),
                    str(int(hold * 1000)),
                    str(int(self.policy.wait_timeout * 1000)),
                ],
            )
            raise
        now = self.clock()
        expires = now + jittered(ttl, jitter, self.random())
        soft = expires
        if cold and self.policy.spread_first_refresh:
            soft = now + (expires - now) * self.random()
        hard = expires + stale_ttl
        envelope = Envelope.encode_raw(
            encoded, soft, hard, now - started, int(version), ttl, stale_ttl
        )
        result = self._call(
            self._write,
            keys=keys_for(layout, WRITE_KEYS),
            args=[
                token,
                version,
                envelope,
                str(max(1, int((hard - now) * 1000))),
                str(int(self.policy.wait_timeout * 1000)),
            ],
        )
        if result != b"ok":
            log.info("cache write of %r refused (%s): value returned, not stored", key, result)
        return json.loads(encoded)  # after the waiters were woken

    def _fetch_once(
        self,
        layout: KeyLayout,
        token: str,
        factor: float,
        *,
        force: bool = False,
        waited_on: bytes | None = None,
        now: float | None = None,
    ) -> Any:
        return self._call(
            self._fetch,
            keys=keys_for(layout, FETCH_KEYS),
            args=[
                repr(self.clock() if now is None else now),
                repr(factor),
                token,
                str(int(self.policy.lock_ttl * 1000)),
                str(int((self.policy.wait_timeout + self.policy.lock_ttl) * 1000)),
                "1" if force else "0",
                waited_on.decode() if waited_on else "",
            ],
        )

    def _refresh_soon(
        self,
        key: str,
        loader: Loader,
        opts: tuple[float, float, float],
        factor: float,
        now: float,
    ) -> None:
        """Try the rebuild lock and refresh, off the caller's thread; one attempt per process."""
        with self._pending_lock:
            if key in self._refreshing:
                return
            self._refreshing.add(key)

        def job() -> None:
            try:
                layout = KeyLayout.of(self.namespace, key)
                token = uuid.uuid4().hex
                reply = self._fetch_once(layout, token, factor, now=now)
                state = reply[0].decode()
                got_lock = len(reply) > 2 and reply[2] == 1  # 'fresh' replies carry no more
                if got_lock and state not in ("stale", "early"):
                    # The value vanished (invalidated, or hard-expired while this job queued) and
                    # the script gave us the rebuild lock: load now, or every reader would wait
                    # on a lock nobody releases until it expires.
                    self._load(
                        key, layout, loader, token, reply[3].decode(), opts, hold=0.0, cold=True
                    )
                    return
                if state not in ("stale", "early") or not got_lock:
                    return  # fresh again, or another caller holds the lock
                if state == "early":
                    self.recorder.record(key, "early_refreshes")
                version = reply[3].decode()
                self._load(key, layout, loader, token, version, opts,
                           hold=self.policy.error_backoff)
            except Exception:
                log.warning("background refresh of %r failed; stale value kept", key, exc_info=True)
            finally:
                with self._pending_lock:
                    self._refreshing.discard(key)

        self._track(self._pool.submit(job))

    def _track(self, future: Future[Any]) -> None:
        with self._pending_lock:
            self._pending.add(future)
        future.add_done_callback(self._forget)

    def _refresh_in_background(
        self,
        key: str,
        layout: KeyLayout,
        loader: Loader,
        token: str,
        version: str,
        opts: tuple[float, float, float],
    ) -> None:
        def job() -> None:
            try:
                self._load(key, layout, loader, token, version, opts,
                           hold=self.policy.error_backoff)
            except Exception:
                log.warning("background refresh of %r failed; stale value kept", key, exc_info=True)

        self._track(self._pool.submit(job))

    def _forget(self, future: Future[Any]) -> None:
        with self._pending_lock:
            self._pending.discard(future)

    def _count(self, key: str, outcome: str) -> None:
        field = {
            "hit": "hits",
            "stale": "stale_hits",
            "early": "hits",
            "loaded": "misses",
            "waited": "misses",
        }[outcome]
        self.recorder.record(key, field, access=True)

    @staticmethod
    def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise StoreUnavailable(f"Redis did not answer: {exc}; retry later") from exc


def _failed(key: str, marker: bytes) -> CacheLoaderFailed:
    data = json.loads(marker)
    return CacheLoaderFailed(key, data["class"], data["message"])
