"""Fair share across tenants: the ``tenants`` table (settings and scheduler state) and the
scheduler that splits each claim page between the tenants with work.

A job type declares a fairness key (:attr:`engine.contract.JobType.fairness_key`); every
request carries its tenant (``job_requests.tenant``, :data:`DEFAULT_TENANT` without a key).
The operator sets a tenant's weight, guaranteed minimum share and burst maximum share at
runtime (``sekali tenants set``, the ``tenant_operations`` job); the next claim reads them.

The scheduler is stride scheduling (virtual-time weighted fair queueing, the slot-by-slot form
of deficit round robin). Per page:

1. the tenants with claimable work and their settings give each one an effective share
   ``s_t`` (:func:`effective_shares`): weights split the page, a tenant below its minimum is
   raised to it, one above its maximum is held at it (the rest of the page, if every tenant
   with work is held, stays unclaimed: the maximum is a ceiling, not a preference);
2. each tenant has a pass (virtual time): a tenant that starts having work again starts at
   the virtual clock ``V`` (no credit saved up while it had none, nothing lost either);
3. slot after slot, the tenant with the lowest pass takes it and its pass grows by ``1/s_t``
   (:func:`allocate`); a tenant whose work runs out leaves the page to the others.

Bound: while a tenant is backlogged, every pass stays within one stride of ``V``, so over any
``n`` consecutive claims it takes ``k_t`` with ``|k_t - s_t * n| <= 2 + s_t * N`` (``N``
tenants with work): with 4 tenants and windows of 200 claims, a share error of at most 0.03.
Priorities with aging still order the claims inside a tenant (``claim_rank``).

Several claimers: every fair claim locks the ``~clock`` row first, so pages are taken one
after the other and the passes see every claim; nothing is claimed twice (the claim itself
stays one statement with ``FOR UPDATE SKIP LOCKED`` on Postgres).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import BigInteger, Column, Float, Table, Text, text
from sqlalchemy.engine import Connection

from resources.errors import ValidationError, shown
from resources.storage.db import Database, metadata
from resources.storage.queries import load_queries

_Q = load_queries(Path(__file__).with_suffix(".sql"))

DEFAULT_TENANT = "default"
"""The tenant of a request whose job type declares no fairness key."""
RESERVED = "~"
"""Names starting with it are the platform's: ``~clock`` (the scheduler's virtual clock) and
``~other`` (the metrics' bucket for the tenants past the top ones)."""
CLOCK = "~clock"
OTHER = "~other"
MAX_NAME = 200

tenants = Table(
    "tenants",
    metadata,
    Column("name", Text, primary_key=True),
    Column("weight", Float, nullable=False),
    Column("min_share", Float),
    Column("max_share", Float),
    Column("pass", Float, nullable=False),
    Column("claimed", BigInteger, nullable=False),
    Column("set_at", Float),
    Column("updated_at", Float),
)


def check_tenant(value: Any, field: str = "tenant") -> str:
    """A tenant name: a non-empty string of at most 200 characters, no control character, not
    starting with ``~`` (reserved). :class:`ValidationError` naming ``field`` otherwise."""
    if not isinstance(value, str) or not value.strip():
        raise ValidationError(field, f"must be a non-empty string, got {shown(value)}", value)
    if len(value) > MAX_NAME:
        raise ValidationError(field, f"must be at most {MAX_NAME} characters", value)
    if value.startswith(RESERVED):
        raise ValidationError(field, f"names starting with {RESERVED!r} are reserved", value)
    if any(ord(ch) < 32 or ord(ch) == 127 or 0xD800 <= ord(ch) <= 0xDFFF for ch in value):
        raise ValidationError(field, "must not contain control characters", value)
    return value


@dataclass(frozen=True)
class TenantSetting:
    """What the operator set for a tenant (defaults: weight 1, no minimum, no maximum)."""

    name: str
    weight: float = 1.0
    min_share: float | None = None
    max_share: float | None = None
    set_at: float | None = None
    claimed: int = 0
    """Requests the fair claim has given this tenant so far."""

    def __post_init__(self) -> None:
        check_tenant(self.name, "name")
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValidationError("weight", f"must be a number > 0, got {self.weight!r}")
        low = 0.0 if self.min_share is None else self.min_share
        high = 1.0 if self.max_share is None else self.max_share
        if not (math.isfinite(low) and 0 <= low <= 1):
            raise ValidationError("min", f"must be a share between 0 and 1, got {low!r}")
        if not (math.isfinite(high) and 0 < high <= 1):
            raise ValidationError("max", f"must be a share in (0, 1], got {high!r}")
        if low > high:
            raise ValidationError("min", f"{low:g} is above the maximum {high:g}")


def effective_shares(
    active: Iterable[str], settings: Mapping[str, TenantSetting]
) -> dict[str, float]:
    """Each active tenant's share of a page: weights, then minimums raised and maximums held
    (water-filling). The shares sum to 1 unless every tenant is held at its maximum; minimums
    that together exceed 1 are scaled down to fit."""
    names = sorted(set(active))
    if not names:
        return {}
    get = {n: settings.get(n) or TenantSetting(n) for n in names}
    mins = {n: get[n].min_share or 0.0 for n in names}
    total_min = sum(mins.values())
    if total_min > 1:
        mins = {n: m / total_min for n, m in mins.items()}
    fixed: dict[str, float] = {}
    while True:
        free = [n for n in names if n not in fixed]
        if not free:
            return fixed
        budget = max(0.0, 1.0 - sum(fixed.values()))
        weight = sum(get[n].weight for n in free)
        prop = {n: budget * get[n].weight / weight for n in free}
        raised = {n: mins[n] for n in free if prop[n] < mins[n] - 1e-12}
        if raised:
            fixed.update(raised)
            continue
        caps = {n: get[n].max_share for n in free}
        held = {n: cap for n, cap in caps.items() if cap is not None and prop[n] > cap + 1e-12}
        if held:
            fixed.update(held)
            continue
        return {**fixed, **prop}


@dataclass(frozen=True)
class Plan:
    """One page's allocation: ``slots`` (a tenant per claim, in order), each tenant's quota,
    the passes after it, and the virtual clock."""

    slots: tuple[str, ...]
    quotas: dict[str, int]
    shares: dict[str, float]
    starts: dict[str, float]
    clock: float


_IDLE = "~idle"


def allocate(
    available: Mapping[str, int],
    shares: Mapping[str, float],
    passes: Mapping[str, float],
    clock: float,
    limit: int,
) -> Plan:
    """Stride scheduling over ``limit`` slots (see the module docstring).

    ``available``: each tenant's claimable requests (at most ``limit`` counted); ``passes``:
    their stored passes (absent: new). The unassigned share (every tenant with work held at its
    maximum) is an idle tenant whose slots stay empty. Ties go to the name, so every claimer
    computes the same plan from the same state.
    """
    starts = {t: max(passes.get(t, clock), clock) for t, n in available.items() if n > 0}
    slack = 1.0 - sum(shares.get(t, 0.0) for t in starts)
    heap = [(p, t) for t, p in starts.items() if shares.get(t, 0.0) > 0]
    serving = len(heap)
    if slack > 1e-9 and heap:
        heap.append((clock, _IDLE))
    heapq.heapify(heap)
    left = dict(available)
    quotas: dict[str, int] = {}
    slots: list[str] = []
    now = clock
    while len(slots) < limit and serving:
        pass_, tenant = heapq.heappop(heap)
        now = max(now, pass_)
        stride = 1.0 / (slack if tenant == _IDLE else shares[tenant])
        slots.append(tenant)
        if tenant == _IDLE:
            heapq.heappush(heap, (pass_ + stride, tenant))
            continue
        quotas[tenant] = quotas.get(tenant, 0) + 1
        left[tenant] -= 1
        if left[tenant] > 0:
            heapq.heappush(heap, (pass_ + stride, tenant))
        else:
            serving -= 1
    return Plan(tuple(s for s in slots if s != _IDLE), quotas, dict(shares), starts, now)


def charged_passes(
    plan: Plan, claimed: Mapping[str, int], passes: Mapping[str, float]
) -> dict[str, float]:
    """The passes after a page, from what was really claimed (a row another transaction held
    is not charged). A tenant served outside the plan (a debounced group) is charged one
    stride per claim at its own start."""
    out = {}
    for tenant, count in claimed.items():
        share = plan.shares.get(tenant) or 1.0
        start = plan.starts.get(tenant, max(passes.get(tenant, plan.clock), plan.clock))
        out[tenant] = start + count / share
    return out


class TenantStore:
    """The ``tenants`` table: the operator's settings, and the scheduler's state that the fair
    claim (:meth:`engine.requests.RequestStore.claim_for_launch`) reads and writes in its own
    transaction."""

    def __init__(self, db: Database, *, clock: Callable[[], float] = time.time) -> None:
        self.db = db
        self.clock = clock

    # -- the operator -------------------------------------------------------------------------

    def set(
        self, name: str, *, weight: float, min_share: float | None = None,
        max_share: float | None = None,
    ) -> TenantSetting:
        """Set a tenant's weight, minimum and maximum share (None: none). Refused with the
        field named when the minimums of all tenants would add up to more than 1. Read by the
        next claim."""
        TenantSetting(name, weight, min_share, max_share)  # checked before anything is written
        now = self.clock()
        with self.db.transaction() as conn:
            others = conn.execute(
                text(_Q["other_minimums"]),
                {"n": name},
            ).scalar_one()
            total = float(others) + (min_share or 0.0)
            if total > 1 + 1e-9:
                raise ValidationError(
                    "min", f"the minimum shares would add up to {total:g} (at most 1): lower "
                    "another tenant's first"
                )
            conn.execute(
                text(_Q["set_tenant"]),
                {"n": name, "w": weight, "lo": min_share, "hi": max_share, "now": now},
            )
        return TenantSetting(name, weight, min_share, max_share, now)

    def list(self) -> list[TenantSetting]:
        """Every tenant set or served, by name."""
        with self.db.statement() as conn:
            rows = conn.execute(text(_Q["list_tenants"])).all()
        return [setting_from_row(r) for r in rows]

    @staticmethod
    def default(name: str) -> TenantSetting:
        """The settings of a tenant nobody set."""
        return TenantSetting(name)

    # -- the fair claim (inside its transaction) ------------------------------------------------

    @staticmethod
    def lock_clock(conn: Connection, now: float) -> float:
        """Take the scheduler's lock (the ``~clock`` row) and return the virtual clock."""
        row = conn.execute(
            text(_Q["lock_clock"]),
            {"now": now, "c": CLOCK},
        ).first()
        if row is None:  # a table emptied by hand: the clock starts again
            conn.execute(text(_Q["start_clock"]), {"c": CLOCK, "now": now})
            return 0.0
        return float(row[0])

    @staticmethod
    def charge(
        conn: Connection, passes: Mapping[str, float], claimed: Mapping[str, int],
        clock: float, now: float,
    ) -> None:
        """Record a page in one statement: each served tenant's pass and count, and the
        virtual clock."""
        rows = [(t, passes[t], claimed.get(t, 0)) for t in sorted(passes)] + [(CLOCK, clock, 0)]
        values = ", ".join(f"(:n{i}, :p{i}, :k{i}, :now)" for i in range(len(rows)))
        params: dict[str, Any] = {"now": now}
        for i, (name, pass_, count) in enumerate(rows):
            params.update({f"n{i}": name, f"p{i}": pass_, f"k{i}": count})
        conn.execute(text(_Q["charge"].format(values=values)), params)


def setting_from_row(row: Any) -> TenantSetting:
    """A :class:`TenantSetting` from a row with ``name``, ``weight``, ``min_share``,
    ``max_share`` (and optionally ``set_at``, ``claimed``); a missing row's NULLs are defaults."""
    m = row._mapping
    return TenantSetting(
        name=m["name"],
        weight=1.0 if m["weight"] is None else float(m["weight"]),
        min_share=None if m["min_share"] is None else float(m["min_share"]),
        max_share=None if m["max_share"] is None else float(m["max_share"]),
        set_at=m.get("set_at"),
        claimed=int(m.get("claimed") or 0),
    )

