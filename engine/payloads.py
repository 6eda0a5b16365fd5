"""Typed payloads: a job type declares its payload as one pydantic model (or dataclass), and its
launch form's fields, its validation, its example and the object its handler receives all
follow from that one declaration.

- **Fields** (:func:`fields_of`): each model field becomes a :class:`PayloadField` in
  declaration order: its annotation gives the type (``str``, ``int``, ``float``, ``bool``, a
  ``Literal`` of strings is a ``str`` with those choices, a ``dict`` is a map, a ``list`` of a
  model is a list of objects with that model's fields), ``Field(description=...)`` the words,
  and a default makes it optional.
- **Validation** (:func:`validator_of`): unknown fields are refused first (naming the first),
  then the model validates. A field annotated with :class:`Check` runs that check on the raw
  value *before* pydantic's own type check: the platform's ``require_*`` helpers, with their
  limits and messages (length limits before any pattern, control characters refused). A
  required field that is absent or null reaches its check as ``None`` (so its own
  ``required: ...`` message names it); any other refusal of pydantic's becomes a
  :class:`ValidationError` naming the field's path (``items[2].quantity``) and never quoting
  a ``personal`` field's value. The validated payload is the model's JSON dump: a plain dict,
  what is stored, keyed and shown.
- **Example** (:func:`example_of`): the model's ``json_schema_extra`` ``examples[0]`` (or
  ``example``).
- **The handler's object** (:func:`typed_of`): the model built from the validated dict.

pydantic is imported when a job type with a model is declared, never by ``import engine``.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from resources.errors import ValidationError, shown


@dataclass(frozen=True)
class PayloadField:
    """One field of a job type's payload, as a person launching it by hand should see it.

    The declaration is the shape and the words (the Dagster layer turns a job type's fields into
    the typed config of its launch form, so a wrong type or a missing field is refused before a
    run starts, with the field named); the job type's ``validate`` stays the check of values.
    A job type with a ``payload`` model gets them from it (:func:`fields_of`).
    ``type`` is ``str``, ``int``, ``dict`` (a map of strings) or ``list`` (of objects with the
    ``items`` fields); ``choices`` are the only values a ``str`` may take; a field with
    ``required=False`` takes ``default`` (``None`` for a map means empty).
    """

    name: str
    type: type
    description: str
    required: bool = True
    default: Any = None
    choices: tuple[str, ...] = ()
    items: tuple[PayloadField, ...] = ()


CheckFn = Callable[..., Any]
_REFUSED = "sekali_refused"


class Check:
    """``Annotated[str, Check(require_str)]``: run ``check(payload, field, **options)`` (the
    platform's ``require_*`` signature) on the raw value before the field's own type check; its
    return value is what the field holds. Raising :class:`ValidationError` refuses the payload
    with that message."""

    def __init__(self, check: CheckFn, /, **options: Any) -> None:
        self.check = check
        self.options = options

    def __repr__(self) -> str:
        return f"Check({getattr(self.check, '__name__', self.check)!r})"

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        from pydantic_core import PydanticCustomError, core_schema  # noqa: PLC0415 - see module

        name = handler.field_name or "value"

        def run(value: Any) -> Any:
            try:
                return self.check({name: value}, name, **self.options)
            except ValidationError as exc:  # carried out through pydantic, which adds the path
                raise PydanticCustomError(_REFUSED, "{problem}", {
                    "problem": exc.problem, "field": exc.field, "limit": exc.limit,
                }) from None

        return core_schema.no_info_before_validator_function(run, handler(source))


def _model_fields(model: type) -> dict[str, Any]:
    """``name -> FieldInfo`` of a pydantic model or a dataclass, in declaration order."""
    found = getattr(model, "model_fields", None)
    if found is not None:
        return dict(found)
    if dataclasses.is_dataclass(model):
        from pydantic.fields import FieldInfo  # noqa: PLC0415 - see the module docstring

        hints = typing.get_type_hints(model, include_extras=True)
        out: dict[str, Any] = {}
        for f in dataclasses.fields(model):
            if f.default is not dataclasses.MISSING:
                info = FieldInfo.from_annotated_attribute(hints[f.name], f.default)
            elif f.default_factory is not dataclasses.MISSING:
                info = FieldInfo.from_annotated_attribute(hints[f.name], dataclasses.field(
                    default_factory=f.default_factory))
                info.default_factory = f.default_factory
            else:
                info = FieldInfo.from_annotation(hints[f.name])
            if info.description is None and "description" in f.metadata:
                info.description = str(f.metadata["description"])
            out[f.name] = info
        return out
    raise TypeError(f"payload must be a pydantic model or a dataclass, got {model!r}")


def _is_payload_class(kind: Any) -> bool:
    return isinstance(kind, type) and (
        hasattr(kind, "model_fields") or dataclasses.is_dataclass(kind)
    )


def _unwrap(annotation: Any) -> Any:
    """``X | None`` is ``X``; ``Annotated[X, ...]`` is ``X``."""
    if typing.get_origin(annotation) is typing.Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(rest) == 1:
            return _unwrap(rest[0])
    return annotation


def _field(name: str, info: Any, owner: str) -> PayloadField:
    annotation = _unwrap(info.annotation)
    origin = typing.get_origin(annotation)
    choices: tuple[str, ...] = ()
    items: tuple[PayloadField, ...] = ()
    kind: type
    if origin is typing.Literal:
        choices = tuple(str(c) for c in typing.get_args(annotation))
        kind = str
    elif origin in (list, tuple, typing.Sequence) or annotation is list:
        (inner,) = typing.get_args(annotation)[:1] or (None,)
        if not _is_payload_class(inner):
            raise TypeError(f"{owner}.{name}: a list field holds objects (a model or dataclass)")
        kind, items = list, fields_of(inner)
    elif origin in (dict, Mapping) or annotation is dict:
        kind = dict
    elif annotation in (str, int, float, bool):
        kind = annotation
    else:
        raise TypeError(
            f"{owner}.{name}: {annotation!r} cannot be a launch form field (use str, int, "
            "float, bool, a Literal of strings, dict[str, str] or a list of a model)"
        )
    required = bool(info.is_required())
    default = None
    if not required and info.default_factory is None:
        default = info.default
    return PayloadField(
        name, kind, info.description or "", required=required, default=default,
        choices=choices, items=items,
    )


def fields_of(model: type) -> tuple[PayloadField, ...]:
    """The launch form's fields of ``model``, in declaration order (see the module)."""
    owner = model.__name__
    return tuple(_field(name, info, owner) for name, info in _model_fields(model).items())


def example_of(model: type) -> dict[str, Any]:
    """The model's declared example (``json_schema_extra``'s ``examples[0]`` or ``example``),
    or ``{}``."""
    config = getattr(model, "model_config", {}) or {}
    extra = config.get("json_schema_extra") if isinstance(config, Mapping) else None
    if isinstance(extra, Mapping):
        examples = extra.get("examples")
        if isinstance(examples, list | tuple) and examples:
            return dict(examples[0])
        if isinstance(extra.get("example"), Mapping):
            return dict(extra["example"])
    return {}


@functools.cache
def _adapter(model: type) -> Any:
    import pydantic  # noqa: PLC0415 - only when a model is declared (module docstring)

    return pydantic.TypeAdapter(model)


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "payload"


def validator_of(
    model: type, *, personal: frozenset[str] = frozenset()
) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The validation of ``model`` (see the module): ``payload -> validated dict``."""
    infos = _model_fields(model)
    names = set(infos)
    required = [name for name, info in infos.items() if info.is_required()]
    allowed = ", ".join(sorted(names))

    def validate(payload: dict[str, Any]) -> dict[str, Any]:
        import pydantic  # noqa: PLC0415 - only when a model is declared (module docstring)

        if not isinstance(payload, Mapping):
            raise ValidationError("payload", f"must be an object, got {shown(payload)}")
        extra = sorted(set(payload) - names)
        if extra:
            raise ValidationError(extra[0], f"unknown field (allowed: {allowed})")
        raw = {**dict.fromkeys(required), **payload}
        adapter = _adapter(model)
        try:
            value = adapter.validate_python(raw)
        except pydantic.ValidationError as exc:
            error = exc.errors(include_url=False)[0]
            loc = tuple(error["loc"])
            given = error.get("input")
            if error["type"] == _REFUSED:  # a Check's own refusal: its words, the full path
                ctx = error.get("ctx") or {}
                head = _path(loc[:-1]) if len(loc) > 1 else ""
                path = f"{head}.{ctx['field']}" if head else str(ctx["field"])
                raise ValidationError(
                    path, str(ctx["problem"]), given, limit=ctx.get("limit")
                ) from None
            field = _path(loc)
            top = str(loc[0]) if loc else ""
            if error["type"] == "missing" or (given is None and top in required):
                raise ValidationError(field, "required") from None
            problem = str(error["msg"])
            problem = problem[0].lower() + problem[1:] if problem else "invalid"
            if top in personal:
                raise ValidationError(field, problem) from None
            raise ValidationError(field, f"{problem}, got {shown(given)}", given) from None
        dumped = adapter.dump_python(value, mode="json")
        return dict(dumped)

    return validate


def typed_of(model: type) -> Callable[[dict[str, Any]], Any]:
    """``validated dict -> the model``: what a handler of a typed job type receives."""

    def build(clean: dict[str, Any]) -> Any:
        return _adapter(model).validate_python(clean)

    return build


__all__ = ["Check", "PayloadField", "example_of", "fields_of", "typed_of", "validator_of"]
