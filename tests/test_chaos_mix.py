"""The built-in chaos mix comes from what the job types declare (:mod:`proof.chaos_mix`)."""

from __future__ import annotations

import dataclasses

import pytest

from engine.chaos import ChaosProof
from engine.registry import JOB_TYPES
from proof.chaos_mix import chaos_of, mix_types, pick
from resources.errors import ValidationError


def test_the_declared_bands_tile_the_roll_and_each_type_samples_a_valid_payload() -> None:
    """Would catch a band left open or overlapping (a roll no type holds, or two), and a
    sample the job type's own validation refuses, or one it accepts as poison."""
    types = mix_types()
    assert len(types) >= 2
    for roll in (0.0, 0.25, 0.5, 0.7, 0.85, 0.999999):
        low, high = chaos_of(pick(types, roll)).mix or (0.0, 0.0)
        assert low <= roll < high
    for jt in types:
        sample = chaos_of(jt).sample
        assert sample is not None
        jt.validate(sample(3, False))
        with pytest.raises(ValidationError):
            jt.validate(sample(3, True))


def test_a_gap_between_bands_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    first = mix_types()[0]
    chaos = chaos_of(first)
    assert chaos.mix is not None
    narrowed = dataclasses.replace(chaos, mix=(chaos.mix[0], chaos.mix[1] / 2))
    monkeypatch.setitem(JOB_TYPES, first.name, dataclasses.replace(
        first, upkeep=dataclasses.replace(first.upkeep, chaos=narrowed)))
    with pytest.raises(ValueError, match="gap or overlap"):
        mix_types()


def test_a_band_without_a_sample_is_refused_at_declaration() -> None:
    with pytest.raises(ValueError, match="sample"):
        ChaosProof(mix=(0.0, 1.0))
