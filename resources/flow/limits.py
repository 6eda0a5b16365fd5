"""The limits of one deployment, by name: concurrency limiters built on demand, and the rate
limiter of each downstream that settings name (every other downstream is unlimited)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from resources.errors import ValidationError
from resources.flow.concurrency import ConcurrencyLimiter, Slot
from resources.flow.rate import RateGrant, RateLimiter
from resources.storage.redis import RedisClient
from resources.storage.settings import RATE_ENV_PREFIX

_PER = {"s": 1.0, "sec": 1.0, "min": 60.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class RateSetting:
    """One downstream's shared rate: ``rate`` calls a second in bursts of up to ``burst``; a
    call waits at most ``wait`` seconds for its turn (then :class:`RateLimited`); a
    ``Retry-After`` lowers the rate to ``throttled`` (0: a pause) for as long as it says."""

    rate: float
    burst: float
    wait: float = 10.0
    throttled: float = 0.0

    @classmethod
    def parse(cls, text: str, *, name: str = "rate") -> RateSetting:
        """``50`` or ``50/s`` (also ``/min``, ``/h``), then optional ``,burst=B``, ``,wait=S``
        and ``,throttled=R`` (a rate like the first). ``burst`` defaults to one second's worth,
        at least 1. A bad text raises :class:`ValidationError` naming ``name``."""
        head, *options = [part.strip() for part in text.split(",")]
        try:
            extra = dict(_option(part) for part in options)
            unknown = sorted(set(extra) - {"burst", "wait", "throttled"})
            if unknown:
                raise ValueError(f"unknown option(s) {unknown}")
            rate = _per_second(head)
            setting = cls(
                rate=rate,
                burst=float(extra.get("burst", max(1.0, rate))),
                wait=float(extra.get("wait", 10.0)),
                throttled=_per_second(extra.get("throttled", "0")),
            )
        except ValueError as exc:
            raise ValidationError(name, f"{exc}; write e.g. '50/s,burst=20,wait=5'", text) from None
        if setting.rate <= 0 or setting.burst < 1 or setting.wait < 0 or setting.throttled < 0:
            raise ValidationError(name, "needs rate > 0, burst >= 1, wait >= 0", text)
        return setting


def _per_second(text: str) -> float:
    number, _, unit = text.partition("/")
    unit = unit.strip() or "s"
    if unit not in _PER:
        raise ValueError(f"unknown unit {unit!r} (s, min, h)")
    return float(number) / _PER[unit]


def _option(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep:
        raise ValueError(f"option {text!r} is not name=value")
    return key.strip(), value.strip()


class ConcurrencyLimits:
    """Concurrency limiters by ``(name, limit)`` on one Redis, sharing one lease and one wait.

    ``hold(name, key, limit)`` waits at most ``wait`` seconds (``None``: as long as it takes),
    then raises :class:`resources.errors.LimitNotAcquired`. Keep ``lease`` at or below the
    lease of the work the slot serves (the idempotency lease): a worker that died holding a
    slot then blocks the worker that takes its work over no longer than the takeover waits.
    """

    def __init__(
        self,
        client: RedisClient,
        *,
        lease: float = 30.0,
        wait: float | None = 30.0,
        prefix: str = "sekali:flow:limit:",
    ) -> None:
        self.client = client
        self.lease = lease
        self.wait = wait
        self.prefix = prefix
        self._limiters: dict[tuple[str, int, float], ConcurrencyLimiter] = {}

    def limiter(self, name: str, limit: int, lease: float | None = None) -> ConcurrencyLimiter:
        """``lease``: the slot follows the lease of the work it serves, never above
        :attr:`lease` (whole seconds, at least one, so a bounded set of limiters is kept)."""
        seconds = self.lease if lease is None else min(self.lease, max(1.0, math.ceil(lease)))
        found = self._limiters.get((name, limit, seconds))
        if found is None:
            found = ConcurrencyLimiter(
                self.client, name, limit=limit, lease=seconds, prefix=self.prefix
            )
            self._limiters[(name, limit, seconds)] = found
        return found

    def hold(
        self, name: str, key: str, limit: int, *, lease: float | None = None
    ) -> contextlib.AbstractContextManager[Slot]:
        return self.limiter(name, limit, lease).hold(key, blocking_timeout=self.wait)


class RateLimits:
    """The shared rate limiter of each downstream named in ``rates`` (``downstream -> text``,
    as :attr:`resources.storage.settings.Settings.rates` holds them; the texts are parsed here,
    so a bad one fails when the limits are built, naming its variable)."""

    def __init__(
        self,
        client: RedisClient,
        rates: Mapping[str, str | RateSetting],
        *,
        prefix: str = "sekali:flow:rate:",
    ) -> None:
        self.settings: dict[str, RateSetting] = {
            name: value
            if isinstance(value, RateSetting)
            else RateSetting.parse(value, name=RATE_ENV_PREFIX + name.upper())
            for name, value in rates.items()
        }
        self._limiters = {
            name: RateLimiter(client, name, rate=s.rate, burst=s.burst, prefix=prefix)
            for name, s in self.settings.items()
        }

    def limiter(self, downstream: str) -> RateLimiter | None:
        """The downstream's limiter, or None when it is unlimited."""
        return self._limiters.get(downstream)

    @contextlib.contextmanager
    def paced(self, downstream: str) -> Iterator[RateGrant | None]:
        """One call to ``downstream`` at its shared rate (see :meth:`RateLimiter.paced`);
        a no-op for a downstream without a rate."""
        limiter = self._limiters.get(downstream)
        if limiter is None:
            yield None
            return
        setting = self.settings[downstream]
        with limiter.paced(blocking_timeout=setting.wait, throttle_rate=setting.throttled) as g:
            yield g
