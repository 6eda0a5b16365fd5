"""What a job type tells the chaos proof (``sekali chaos``) about itself: :class:`ChaosProof`,
declared as ``Upkeep(chaos=...)``.

The harness names no job type. It asks each registered type for what it needs: whether the
type is part of the built-in request mix and how to build request ``i``'s payload, how to seed
the world its requests need, its effect without any guard (the ``--naive`` comparison), and,
after the run, how many effects the downstream holds for a request and whether the business
rows carry the completing claim's fence. A type that declares nothing is judged by its
declaration alone (``sekali chaos --job-type``: payloads from its example, effects through its
lookup hook).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from resources.storage.db import Database


class NaiveRun(Protocol):
    """What a naive (unguarded) effect may use: the worker's clients, its database, and the
    fault points (``point("before_effect")``) for an effect that calls no client."""

    db: Database

    def client(self, name: str) -> Any: ...

    def point(self, name: str) -> None: ...


@dataclass(frozen=True)
class ChaosCase:
    """One request as the checker sees it after the run: its ``payload`` as sent, the
    ``arrivals`` the sandbox stand-ins recorded under its correlation id (a charge, a
    message), the faults that ``struck`` it (``kill:after_effect`` -> times) and its
    ``takeovers`` (distinct fences among its attempts, less one)."""

    payload: Mapping[str, Any]
    arrivals: Sequence[Mapping[str, Any]]
    struck: Mapping[str, int]
    takeovers: int


@dataclass
class ChaosCount:
    """The effects the downstream holds for one request; ``resends`` of one effect (the same
    Message-ID again), of which ``allowed_resends`` the faults that struck explain; ``stats``
    to add to the run's counters."""

    effects: int
    resends: int = 0
    allowed_resends: int = 0
    stats: dict[str, int] = field(default_factory=dict)


Gather = Callable[[Database], Any]
"""``gather(db) -> evidence``: the type's business rows, read once after the run."""
Count = Callable[[Any, ChaosCase], ChaosCount]
"""``count(evidence, case)``: what the downstream holds for the request."""
Fenced = Callable[[Any, Mapping[str, Any], int], str | None]
"""``fenced(evidence, payload, fence)``: None when the business rows carry the completing
claim's ``fence``, else what they carry instead (said in a stale-write violation)."""


@dataclass(frozen=True, kw_only=True)
class ChaosProof:
    """How ``sekali chaos`` exercises and judges a job type (see the module).

    ``mix``: the band ``[low, high)`` of a request's uniform roll that makes it this type in the
    built-in mix (the bands of the built-in types tile ``[0, 1)``); None: not in the mix.
    ``sample(i, poison)``: request ``i``'s payload, one its ``validate`` refuses when
    ``poison``. ``seed(db, payloads)``: what the valid payloads need before the run (stock).
    ``naive(run, clean, key, correlation_id)``: the effect with every guard off.
    ``effect_calls``: the client methods that make the effect (the fault points go around
    them) and ``lookup_calls`` the ones its lookup reads with: a chaos worker's client offers
    these alone.
    ``after_effect``: the type's own crash points just after an effect that is a transaction of
    its own. ``gather``/``count``/``fenced``: the verdict (:data:`Gather`, :data:`Count`,
    :data:`Fenced`); without ``count`` a request's effects are its arrivals.
    ``retention_first``: retention-travel plants its dead letters on this type's completed
    keys first (an effect the downstream does not dedupe).
    """

    mix: tuple[float, float] | None = None
    sample: Callable[[int, bool], dict[str, Any]] | None = None
    seed: Callable[[Database, Sequence[Mapping[str, Any]]], None] | None = None
    naive: Callable[[NaiveRun, dict[str, Any], str, str], None] | None = None
    effect_calls: tuple[str, ...] = ()
    lookup_calls: tuple[str, ...] = ()
    after_effect: tuple[str, ...] = ()
    gather: Gather | None = None
    count: Count | None = None
    fenced: Fenced | None = None
    retention_first: bool = False

    def __post_init__(self) -> None:
        if self.mix is not None:
            low, high = self.mix
            if not 0.0 <= low < high <= 1.0:
                raise ValueError(f"chaos mix band {self.mix} must satisfy 0 <= low < high <= 1")
            if self.sample is None:
                raise ValueError("a job type in the chaos mix must declare sample=")
