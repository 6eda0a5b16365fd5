"""Typed payloads: one pydantic model (or dataclass) gives a job type its launch form fields,
its validation (refusals name the field and keep the platform's checks and messages), its
example, and the object its handler receives."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Annotated, Any, Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field

from engine import (
    Check,
    JobType,
    Keying,
    PayloadField,
    Presentation,
    Queue,
    Running,
    formatted,
    require_int,
    require_str,
)
from engine.registry import JOB_TYPES
from pipelines.jobs.email import EmailRequest
from pipelines.jobs.inventory import ReserveRequest
from pipelines.jobs.payment import ChargeRequest
from resources.errors import ValidationError


class Line(BaseModel):
    sku: Annotated[str, Check(require_str)] = Field(description="What.")
    quantity: Annotated[int, Check(require_int, maximum=9)] = Field(description="How many.")


class Award(BaseModel):
    """A points award."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"account_id": "a-1", "points": 5, "tier": "gold", "lines": [], "email": "a@b.c"},
    ]})

    account_id: Annotated[str, Check(require_str), Field(description="The account.")]
    points: int = Field(description="Points to add.")
    tier: Literal["gold", "silver"] = Field("silver", description="The tier.")
    lines: list[Line] = Field(default_factory=list, description="Lines.")
    labels: dict[str, str] = Field(default_factory=dict, description="Labels.")
    email: str = Field("", description="Where to tell.")


KEY = formatted("points:{account_id}")


def _award(key_for: Callable[[dict[str, Any]], str] = KEY) -> JobType:
    return JobType(
        name="award_points", queue=Queue.LIGHT, payload=Award,
        handler=lambda ctx, p: p, side_effect=False,
        keying=Keying(key_for=key_for, resource_id=formatted("{account_id}")),
        running=Running(max_runtime_seconds=10),
        presentation=Presentation(personal=frozenset({"email"})),
    )


def test_a_model_declares_the_fields_the_example_and_the_validation() -> None:
    """Catches: a declared model whose fields, defaults, choices or descriptions do not reach
    the launch form, or whose example is dropped."""
    jt = _award()
    assert [f.name for f in jt.presentation.fields] == ["account_id", "points", "tier", "lines",
                                                        "labels", "email"]
    by = {f.name: f for f in jt.presentation.fields}
    assert by["account_id"] == PayloadField("account_id", str, "The account.")
    assert by["tier"] == PayloadField("tier", str, "The tier.", required=False, default="silver",
                                      choices=("gold", "silver"))
    assert by["lines"].type is list and not by["lines"].required
    assert [i.name for i in by["lines"].items] == ["sku", "quantity"]
    assert by["labels"] == PayloadField("labels", dict, "Labels.", required=False)
    assert jt.presentation.example["account_id"] == "a-1"
    assert jt.prefix == "points:"
    clean = jt.validate({"account_id": 7, "points": 3, "lines": [{"sku": "x", "quantity": 2}]})
    assert clean == {"account_id": "7", "points": 3, "tier": "silver",
                     "lines": [{"sku": "x", "quantity": 2}], "labels": {}, "email": ""}
    assert jt.keying.key_for(clean) == "points:7" and jt.keying.resource_id(clean) == "7"
    typed = jt.typed(clean)
    assert isinstance(typed, Award) and isinstance(typed.lines[0], Line)


@pytest.mark.parametrize(("payload", "field", "words"), [
    ({"points": 1}, "account_id", "required: a non-empty string"),
    ({"account_id": None, "points": 1}, "account_id", "required: a non-empty string"),
    ({"account_id": "a b", "points": 1}, "account_id", "no spaces or ':'"),
    ({"account_id": "a" * 201, "points": 1}, "account_id", "at most 200 characters"),
    ({"account_id": "a"}, "points", "required"),
    ({"account_id": "a", "points": "lots"}, "points", 'got "lots"'),
    ({"account_id": "a", "points": 1, "tier": "bronze"}, "tier", "got \"bronze\""),
    ({"account_id": "a", "points": 1, "lines": [{"sku": "x", "quantity": 10}]},
     "lines[0].quantity", "must be between 1 and 9"),
    ({"account_id": "a", "points": 1, "lines": [{"sku": "x", "quantity": 1}, {"sku": "y"}]},
     "lines[1].quantity", "required"),
    ({"account_id": "a", "points": 1, "colour": "red"}, "colour", "unknown field (allowed:"),
])
def test_refusals_name_the_field_and_keep_the_checks_messages(
    payload: dict[str, Any], field: str, words: str
) -> None:
    """Catches: a model refusal that names no field (or pydantic's location tuple), or a
    platform check (length before pattern, no ':' in an id) lost behind the model."""
    with pytest.raises(ValidationError) as refused:
        _award().validate(payload)
    assert refused.value.field == field
    assert words in refused.value.problem


def test_a_personal_field_is_never_quoted() -> None:
    """Catches: an address echoed into the error, the run log and the DLQ."""
    with pytest.raises(ValidationError) as refused:
        _award().validate({"account_id": "a", "points": 1, "email": ["secret@example.com"]})
    assert refused.value.field == "email" and "secret" not in str(refused.value)


@dataclasses.dataclass(frozen=True)
class Ping:
    host: Annotated[str, Check(require_str), Field(description="Where.")]
    times: int = dataclasses.field(default=1, metadata={"description": "How often."})


def test_a_dataclass_declares_a_payload_too() -> None:
    jt = JobType(
        name="ping",
        queue=Queue.LIGHT,
        payload=Ping,
        handler=lambda ctx, p: p,
        side_effect=False,
        keying=Keying(key_for=formatted("ping:{host}"), resource_id=formatted("{host}")),
        running=Running(max_runtime_seconds=5),
    )
    assert jt.presentation.fields == (PayloadField("host", str, "Where."),
                                      PayloadField("times", int, "How often.", required=False,
                                                   default=1))
    assert jt.typed(jt.validate({"host": "h1"})) == Ping("h1", 1)
    with pytest.raises(ValidationError, match="times"):
        jt.validate({"host": "h1", "times": "x"})


def test_a_key_naming_no_field_is_refused_at_declaration() -> None:
    with pytest.raises(ValueError, match="'acount_id'"):
        _award(key_for=formatted("points:{acount_id}"))
    with pytest.raises(ValueError, match="payload"):
        JobType(
            name="bare",
            queue=Queue.LIGHT,
            handler=lambda ctx, p: p,
            side_effect=False,
            keying=Keying(key_for=formatted("b:{x}"), resource_id=formatted("{x}")),
            running=Running(max_runtime_seconds=1),
        )


def test_the_built_in_handlers_receive_their_models() -> None:
    """Catches: a built-in still declared as a dict validator (its handler gets a dict)."""
    models = {"charge_payment": ChargeRequest, "send_email": EmailRequest,
              "reserve_inventory": ReserveRequest}
    for name, model in models.items():
        jt = JOB_TYPES[name]
        assert jt.payload is model
        assert isinstance(jt.typed(jt.validate(dict(jt.presentation.example))), model)
    converted = ("fulfill_order", "rebuild_report_cache", *models)
    assert all(JOB_TYPES[name].payload is not None for name in converted)
