"""A downstream: an outside service a job type calls, declared once and found by its name.

A job type names the downstreams its handler calls (``clients=(LEDGER,)``); everything else
about a downstream follows from its one declaration:

- the client: ``build(settings, options)`` makes it from :class:`Settings` (its address) and
  :class:`ClientOptions` (overrides; every client has explicit connect/read timeouts and a
  deadline for a whole call, never a library default). Handlers get it as
  ``ctx.client(name)``; the Dagster resource of the same name wraps the same ``build``;
- its shared rate: ``SEKALI_RATE_<NAME>`` (``50/s,burst=20``). With a rate set, every call of
  the client's ``calls`` takes a token from one Redis bucket shared by all workers
  (:class:`Paced`), so the downstream sees at most ``burst + rate * t`` calls in any ``t``
  seconds; an answer carrying ``Retry-After`` lowers the rate for every worker for that long;
- its retry-budget bucket: its name. A job type's retries for a failure of this downstream
  draw on the one budget every worker shares;
- optionally its sandbox stand-in (:class:`Sandbox`), which ``sekali dev`` starts on the
  address the settings name, and which may say how to read its own record of the effects it
  received (``Sandbox.record``): the ground truth ``sekali chaos`` counts by.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from resources.egress import ALLOW_ENV, allow_list
from resources.flow import RateLimits
from resources.storage.settings import Settings

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class ClientOptions:
    """Overrides of a client's defaults (None keeps the downstream's own): ``address`` (a URL,
    or ``host:port``), ``timeout`` (connect and each read), ``deadline`` (a whole call), and
    ``extra`` for what only this downstream knows."""

    address: str | None = None
    timeout: float | None = None
    deadline: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


class Stoppable(Protocol):
    def stop(self) -> None: ...


@dataclass(frozen=True)
class Effect:
    """One effect a downstream holds for an intent: its id there and, when known, when (for a
    stand-in's own record: when it arrived, by the stand-in's wall clock)."""

    reference: str
    at: float | None = None
    detail: Mapping[str, Any] = field(default_factory=dict)


Record = Callable[[Any, str, Any], Sequence[Effect]]
"""``record(stand_in, key, payload) -> effects``: every effect the running stand-in (what
``Sandbox.start`` returned) received for the intent with idempotency key ``key`` (``payload``
validated), read from its own storage, duplicates included, each with its arrival time."""


@dataclass(frozen=True)
class Sandbox:
    """How ``sekali dev`` starts a stand-in of the downstream on this machine.

    ``address(settings)`` is ``(host, port, setting)``: where the client will look for it, and
    the setting that moves it (checked free before anything starts). ``start(settings, state)``
    starts it on that address, keeping its records under the ``state`` folder, and returns
    something to ``stop()``."""

    label: str
    address: Callable[[Settings], tuple[str, int, str]]
    start: Callable[[Settings, Path], Stoppable]
    environment: Callable[[Path], Mapping[str, str]] = lambda state: {}
    """The settings (environment variables) a client needs beside the address to use the
    stand-in started under ``state``: where its records can be read, for a lookup hook."""
    record: Record | None = None
    """How to count what the stand-in received (see :data:`Record`), never through the client
    or the job type's lookup: ``sekali chaos --job-type`` judges "at most one effect", "none
    lost" and the send bound by it, and calibrates the lookup against it. Without one, a chaos
    verdict counts through the lookup and says the counts are unverified."""


@dataclass(frozen=True)
class Downstream:
    """One outside service (see the module). ``name`` is lower case (``points_ledger``): the
    key of ``ctx.client``, of the Dagster resource, of ``SEKALI_RATE_<NAME>`` and of the retry
    budget. ``calls`` are the client's methods that reach the service (each takes a token when
    a rate is set); empty means every public method."""

    name: str
    build: Callable[[Settings, ClientOptions], Any]
    description: str = ""
    calls: tuple[str, ...] = ()
    sandbox: Sandbox | None = None
    dedupes: bool = False
    """The service honours the idempotency key sent with an effect: a repeated send of one
    intent makes no second effect (a payment provider's ``Idempotency-Key``). SMTP does not.
    A job type's first send looks up first by default when one of its downstreams does not
    (``Calls.lookup_first``)."""
    destinations_from_payloads: bool = False
    """The client calls addresses that payloads name (a customer's webhook URL): lookups
    through it run only on workers, under their egress rules, never from an operator's CLI
    (:func:`engine.replay.lookup_client`)."""

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(
                f"downstream name {self.name!r}: lower case letters, digits and '_', starting "
                "with a letter (it names an environment variable and a resource)"
            )

    @property
    def rate_variable(self) -> str:
        return f"SEKALI_RATE_{self.name.upper()}"

    @property
    def url_variable(self) -> str:
        """``SEKALI_<NAME>_URL``: where a downstream without a setting of its own is found
        (its ``build`` reads it when the resource gives no ``address``)."""
        return f"SEKALI_{self.name.upper()}_URL"

    def client(
        self, settings: Settings, rates: RateLimits, options: ClientOptions | None = None
    ) -> Any:
        """The client, at the downstream's shared rate when ``rates`` has one for it."""
        return paced(self, self.build(settings, options or ClientOptions()), rates)


class Paced:
    """A client whose calls to the downstream each take a token of its shared rate first.

    Generic: it wraps any client, pacing the methods the downstream lists in ``calls`` (every
    public method when it lists none); other attributes pass through untouched."""

    def __init__(self, inner: Any, downstream: Downstream, limits: RateLimits) -> None:
        self.inner = inner
        self.downstream = downstream
        self.limits = limits

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        calls = self.downstream.calls
        if not callable(value) or name.startswith("_") or (calls and name not in calls):
            return value

        @functools.wraps(value)
        def call(*args: Any, **kwargs: Any) -> Any:
            with self.limits.paced(self.downstream.name):
                return value(*args, **kwargs)

        return call


def sandbox_egress(boxes: Iterable[Sandbox], settings: Settings,
                   environ: Mapping[str, str]) -> dict[str, str]:
    """``SEKALI_EGRESS_ALLOW`` for processes that call the stand-ins ``boxes`` started under
    ``settings``: what ``environ`` allows, plus each stand-in's address (the egress rules
    refuse loopback otherwise, :mod:`resources.egress`)."""
    addresses = [f"{host}:{port}" for host, port, _ in (b.address(settings) for b in boxes)]
    return {ALLOW_ENV: allow_list(addresses, environ)}


def paced(downstream: Downstream, client: Any, rates: RateLimits) -> Any:
    """``client`` at ``downstream``'s shared rate, or ``client`` itself when no rate is set."""
    if rates.limiter(downstream.name) is None:
        return client
    return Paced(client, downstream, rates)


__all__ = ["ClientOptions", "Downstream", "Effect", "Paced", "Record", "Sandbox", "Stoppable",
           "paced", "sandbox_egress"]
