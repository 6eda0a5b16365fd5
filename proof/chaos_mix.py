"""The built-in request mix of ``sekali chaos``, read from the registered job types: each type in
the mix declares its band of a request's roll and how to build its payload
(:class:`engine.chaos.ChaosProof`), so the harness names none of them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from engine.chaos import ChaosProof
from engine.contract import JobType
from engine.registry import JOB_TYPES
from resources.storage.db import Database


def chaos_of(job_type: JobType) -> ChaosProof:
    """What ``job_type`` declares for the proof; the defaults when it declares nothing."""
    return job_type.upkeep.chaos or ChaosProof()


def mix_types() -> list[JobType]:
    """The job types of the built-in mix, by band; their bands must tile ``[0, 1)``."""
    types = sorted((jt for jt in JOB_TYPES.values() if chaos_of(jt).mix is not None),
                   key=lambda jt: chaos_of(jt).mix or (0.0, 0.0))
    edge = 0.0
    for jt in types:
        low, high = chaos_of(jt).mix or (0.0, 0.0)
        if low != edge:
            raise ValueError(f"the chaos mix bands leave a gap or overlap at {edge} "
                             f"({jt.name} starts at {low}): declare bands that tile [0, 1)")
        edge = high
    if types and edge != 1.0:
        raise ValueError(f"the chaos mix bands end at {edge}, not 1.0")
    return types


def mix_names() -> tuple[str, ...]:
    return tuple(jt.name for jt in mix_types())


def pick(types: Sequence[JobType], roll: float) -> JobType:
    """The type whose band holds ``roll`` (in ``[0, 1)``)."""
    for jt in types:
        low, high = chaos_of(jt).mix or (0.0, 0.0)
        if low <= roll < high:
            return jt
    raise ValueError(f"no job type of the chaos mix holds the roll {roll}")


def seed_world(db: Database, requests: Sequence[tuple[str, Mapping[str, Any], bool]]) -> None:
    """What the valid requests (``(job type, payload, poison)``) need before the run, by each
    type's ``seed``."""
    by_type: dict[str, list[Mapping[str, Any]]] = {}
    for name, payload, poison in requests:
        if not poison:
            by_type.setdefault(name, []).append(payload)
    for name, payloads in by_type.items():
        seed = chaos_of(JOB_TYPES[name]).seed
        if seed is not None:
            seed(db, payloads)


def after_effect_points(names: Sequence[str]) -> str:
    """The job types' own crash points just after an effect that is a transaction of its own,
    as ``SEKALI_CRASH_AT`` takes them."""
    points = [p for name in names for p in chaos_of(JOB_TYPES[name]).after_effect]
    return ",".join(dict.fromkeys(points))
