"""The validation boundary: every way a request comes in asks here before anything is stored or
run. ``enqueue`` and ``sekali enqueue``, a Launchpad run's config (the per-request op), a DLQ
replay (the replay sensor) and the batch ops (payloads read back from ``job_requests``) all call
:func:`admit`.

Guarantees, whatever the input (any Python value, any text):

- It returns, or raises :class:`ValidationError` naming the field (``job_type``, ``key``,
  ``request_id``, ``correlation_id``, ``payload`` for the whole payload, ``context.n`` or
  ``items[2].id`` inside it) and, for a limit, the limit (``key_length=512``). Nothing else
  escapes: no RecursionError, no OverflowError, no driver error at a later INSERT.
- A refusal keeps exactly one ``job_rejections`` row, bounded (an excerpt, size and sha256:
  :meth:`engine.requests.RequestStore.reject`) and stored on its own connection on Postgres,
  so the caller's rollback does not lose it.
- What passes is storable on SQLite and Postgres alike: job type, key and ids hold no control
  character and no lone surrogate and fit their indexes; payload strings hold no NUL and no lone
  surrogate; numbers are finite and within a signed 64-bit integer; the payload's JSON text is
  within :class:`InputLimits` ``payload_bytes`` and ``max_depth``. Then the job type's own
  ``validate`` runs, and the key (given or derived) is checked like a given one.

The cost is bounded by the limits, not by the input: text is measured before it is parsed, and
the walk over a Python value stops as soon as it has seen more than ``payload_bytes``.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Connection

from engine.contract import JobType
from engine.privacy import mask_text
from engine.registry import get_job_type
from engine.requests import JobRequest, RequestStore, windowed_key
from engine.tenants import DEFAULT_TENANT
from resources.errors import ValidationError, shown
from resources.headers import refuse_found
from resources.storage.settings import ID_BYTES, KEY_BYTES, InputLimits
from resources.telemetry.redact import loggable

log = logging.getLogger(__name__)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
PRIORITY_MIN, PRIORITY_MAX = -10, 10
"""A request's priority (``enqueue(priority=)``): 0 is normal, 10 the most urgent. Bounded so
that aging (one step per ``SEKALI_INTAKE_PRIORITY_AGING`` seconds waited) bounds every wait."""
__all__ = [
    "Admitted",
    "AdmittedPayload",
    "InputLimits",
    "ValidationError",
    "admit",
    "admit_request_row",
    "check_id",
    "check_key",
    "check_priority",
    "check_request",
    "check_text",
]

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
_NUL = re.compile("\x00")
_SURROGATE = re.compile("[\ud800-\udfff]")
_PLAIN_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")


class AdmittedPayload(dict[str, Any]):
    """A payload as the validation boundary (:func:`check_request`) normalised it for
    ``job_type``. The engine passes it down as it is and does not check it again
    (:func:`engine.runtime.execute_request` validates any other payload): one check per way
    in, at the boundary."""

    def __init__(self, job_type: str, normalised: dict[str, Any]) -> None:
        super().__init__(normalised)
        self.job_type = job_type


@dataclass(frozen=True)
class Admitted:
    """A request that passed: its job type, the payload as the job type normalised it, and the
    key (the one given, or the job type's ``key_for``)."""

    job_type: JobType
    payload: dict[str, Any]
    key: str
    priority: int = 0
    tenant: str = DEFAULT_TENANT


def admit(
    requests: RequestStore,
    job_type: Any,
    payload: Any,
    key: Any = None,
    *,
    source: str,
    request_id: Any = None,
    correlation_id: Any = None,
    limits: InputLimits | None = None,
    conn: Connection | None = None,
    priority: Any = 0,
    dedupe_at: float | None = None,
    kept_elsewhere: bool = False,
) -> Admitted:
    """Check a request (:func:`check_request`); on refusal keep one rejection row and raise.

    ``conn``: the caller's transaction. The rejection joins it on SQLite (a second writer would
    wait on the caller's own write lock) and is written on its own connection on Postgres.
    ``priority`` and ``dedupe_at``: see :func:`check_request`. ``kept_elsewhere``: the caller's
    failure keeps the request anyway (a step's dead letter holds its payload), so a rejection
    row the database cannot take now is logged and the refusal still raised, permanent; without
    it the database's error is raised (a producer retries and its refusal is kept then).
    """
    limits = limits or InputLimits.from_env()
    try:
        return check_request(
            job_type,
            payload,
            key,
            request_id=request_id,
            correlation_id=correlation_id,
            limits=limits,
            priority=priority,
            dedupe_at=dedupe_at,
        )
    except ValidationError as exc:
        own_connection = conn is None or not requests.db.sql_dialect.writers_wait
        try:
            rejection = requests.reject(
                job_type,
                payload,
                field=exc.field,
                error=mask_text(str(exc), job_type if isinstance(job_type, str) else None,
                                payload),
                key=key,
                source=source,
                excerpt_bytes=limits.excerpt_bytes,
                conn=None if own_connection else conn,
            )
        except Exception as unstored:
            if not kept_elsewhere:
                raise
            log.warning("refused a request at %s, rejection not kept (%s): %s", source,
                        type(unstored).__name__, loggable(str(exc)))
            raise exc from None
        exc.rejection_id = rejection
        log.warning(
            "refused a request at %s (rejection %d): %s",
            source,
            rejection,
            loggable(str(exc)),
            extra={"field": exc.field, "source": source, "rejection_id": rejection},
        )
        raise


def admit_request_row(requests: RequestStore, request: JobRequest, *, source: str) -> Admitted:
    """:func:`admit` for a request read back from ``job_requests`` (the batch ops): a row
    written before these limits, or around ``enqueue``, is refused before it runs."""
    return admit(
        requests,
        request.job_type,
        request.payload,
        request.key,
        source=source,
        request_id=request.id,
        correlation_id=request.correlation_id,
    )


def check_request(
    job_type: Any,
    payload: Any,
    key: Any = None,
    *,
    request_id: Any = None,
    correlation_id: Any = None,
    limits: InputLimits | None = None,
    priority: Any = 0,
    dedupe_at: float | None = None,
) -> Admitted:
    """The checks alone, nothing written: :class:`Admitted` or :class:`ValidationError`.

    ``dedupe_at``: a new request's time. When given and the job type has a dedupe window, the
    key becomes the window's key (:func:`engine.requests.windowed_key`) before its length is
    checked; a key read back from the table (already derived) is passed without it.
    """
    limits = limits or InputLimits.from_env()
    name = check_text("job_type", job_type, limits.id_length, "id_length")
    level = check_priority(priority)
    if key is not None:
        check_key(key, limits)
    if request_id is not None:
        check_id("request_id", request_id)
    if correlation_id is not None:
        check_text("correlation_id", correlation_id, limits.id_length, "id_length",
                   max_bytes=ID_BYTES)
    value = _parse(payload, limits)
    _walk(value, limits)
    _check_size(value, limits)
    spec = get_job_type(name)
    try:
        normalised = AdmittedPayload(spec.name, spec.validate(dict(value)))
        chosen = key if key is not None else spec.keying.key_for(normalised)
    except ValidationError:
        raise
    except Exception as exc:  # noqa: BLE001 - a job type's checks met input they did not expect
        raise ValidationError(
            "payload", f"refused by the {name} job type's checks ({type(exc).__name__})"
        ) from None
    if dedupe_at is not None:
        chosen = windowed_key(chosen, spec.keying.dedupe_window, dedupe_at)
    check_key(chosen, limits)
    return Admitted(spec, normalised, chosen, level, spec.tenant_for(normalised))


def check_key(value: Any, limits: InputLimits) -> str:
    """An idempotency key: :func:`check_text` within ``key_length`` characters, and within
    :data:`KEY_BYTES` of UTF-8, so that every column and index stores it whole."""
    return check_text("key", value, limits.key_length, "key_length", max_bytes=KEY_BYTES)


def check_priority(value: Any) -> int:
    """A priority: a whole number from :data:`PRIORITY_MIN` to :data:`PRIORITY_MAX`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError("priority", f"must be a whole number, got {shown(value)}")
    if not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise ValidationError(
            "priority",
            f"must be from {PRIORITY_MIN} to {PRIORITY_MAX}",
            value,
            limit=f"priority={PRIORITY_MIN}..{PRIORITY_MAX}",
        )
    return value


def check_text(field: str, value: Any, max_chars: int, limit_name: str, *,
               allow_empty: bool = False, max_bytes: int | None = None) -> str:
    """A job type, key or id: a string, not empty, at most ``max_chars`` characters (and
    ``max_bytes`` of UTF-8, when given), with no control character and no lone surrogate
    (neither database stores them in a key)."""
    if not isinstance(value, str):
        raise ValidationError(field, f"must be a string, got {type(value).__name__}")
    if not value and not allow_empty:
        raise ValidationError(field, "must be a non-empty string")
    if len(value) > max_chars:
        raise ValidationError(
            field,
            f"{len(value)} characters, longer than the limit of {max_chars} ({limit_name})",
            limit=f"{limit_name}={max_chars}",
        )
    _check_characters(field, value, _CONTROL, "a control character")
    size = len(value.encode("utf-8")) if max_bytes is not None else 0
    if max_bytes is not None and size > max_bytes:
        name = "key_bytes" if field == "key" else "id_bytes"
        raise ValidationError(
            field, f"{size} bytes of UTF-8, more than the limit of {max_bytes} ({name})",
            limit=f"{name}={max_bytes}",
        )
    return value


def check_id(field: str, value: Any) -> int:
    """A row id: a whole number from 1 to the signed 64-bit maximum (what both databases'
    BIGINT holds; a larger one is an OverflowError on SQLite)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(field, f"must be a whole number, got {type(value).__name__}")
    if not 1 <= value <= INT64_MAX:
        raise ValidationError(
            field, f"must be from 1 to {INT64_MAX} (a signed 64-bit id)", limit="int64"
        )
    return value


def _check_characters(field: str, value: str, forbidden: re.Pattern[str], what: str) -> None:
    refuse_found(field, value, _SURROGATE, "a lone surrogate", ": send valid Unicode")
    refuse_found(field, value, forbidden, what)


# -- the payload ------------------------------------------------------------------------------


class _HugeInt:
    """What a JSON integer of more than 19 digits parses to: refused by the walk, by name."""


_HUGE = _HugeInt()


def _parse_int(digits: str) -> int | _HugeInt:
    return int(digits) if len(digits.lstrip("-")) <= 19 else _HUGE


def _parse(payload: Any, limits: InputLimits) -> dict[str, Any]:
    """The payload as a dict: a dict as is, JSON text measured first and then parsed."""
    if isinstance(payload, str):
        size = len(payload.encode("utf-8", "surrogatepass"))
        if size > limits.payload_bytes:
            raise _too_large(size, limits)
        try:
            payload = json.loads(payload, parse_int=_parse_int)
        except RecursionError:
            raise _too_deep(limits) from None
        except ValueError as exc:
            problem = exc.msg if isinstance(exc, json.JSONDecodeError) else "unreadable"
            raise ValidationError("payload", f"not valid JSON ({problem})") from None
    if not isinstance(payload, dict):
        raise ValidationError("payload", f"must be a JSON object, got {type(payload).__name__}")
    return payload


def _walk(value: dict[str, Any], limits: InputLimits) -> None:
    """Every node of the payload, without recursion: depth, key and value types, strings,
    numbers. Stops once the nodes seen add up to more than ``payload_bytes`` (a lower bound of
    their JSON text), so a huge or cyclic value costs no more than a small one."""
    seen = 0
    stack: list[tuple[Any, str, int]] = [(value, "", 1)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, dict | list | tuple):
            if depth > limits.max_depth:
                raise _too_deep(limits)
            seen += 2
            if isinstance(node, dict):
                for k, v in node.items():
                    if not isinstance(k, str):
                        raise ValidationError(
                            path or "payload",
                            f"object keys must be strings, got {type(k).__name__}",
                        )
                    field = _join(path, k)
                    check_text(field, k, limits.key_length, "key_length", allow_empty=True)
                    seen += len(k) + 4
                    stack.append((v, field, depth + 1))
                    if seen > limits.payload_bytes:
                        raise _too_large(None, limits)
            else:
                for i, v in enumerate(node):
                    seen += 1
                    stack.append((v, f"{path or 'payload'}[{i}]", depth + 1))
                    if seen > limits.payload_bytes:
                        raise _too_large(None, limits)
        elif isinstance(node, str):
            seen += len(node) + 2
            if seen > limits.payload_bytes:
                raise _too_large(None, limits)
            if len(node) > limits.string_length:
                raise ValidationError(
                    path,
                    f"a string of {len(node)} characters, longer than the limit of "
                    f"{limits.string_length} (string_length)",
                    limit=f"string_length={limits.string_length}",
                )
            _check_characters(path, node, _NUL, "a NUL character (no text column stores it)")
        elif node is None or isinstance(node, bool):
            seen += 4
        elif isinstance(node, int):
            seen += 1
            if not INT64_MIN <= node <= INT64_MAX:
                raise _out_of_range(path)
        elif isinstance(node, _HugeInt):
            raise _out_of_range(path)
        elif isinstance(node, float):
            seen += 1
            if not math.isfinite(node):
                raise ValidationError(
                    path, f"{node!r}: NaN and Infinity are not JSON numbers; send a finite number"
                )
        else:
            raise ValidationError(path, f"a {type(node).__name__} is not a JSON value")
        if seen > limits.payload_bytes:
            raise _too_large(None, limits)


def _check_size(value: dict[str, Any], limits: InputLimits) -> None:
    """The exact size of the payload's compact JSON text, in UTF-8."""
    size = len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))
    if size > limits.payload_bytes:
        raise _too_large(size, limits)


def _join(path: str, key: str) -> str:
    """``context.n``; a key that is not a plain name is quoted: ``context["a b"]``."""
    if _PLAIN_NAME.match(key):
        return f"{path}.{key}" if path else key
    quoted = json.dumps(key[:64])
    return f"{path or 'payload'}[{quoted}]"


def _too_large(size: int | None, limits: InputLimits) -> ValidationError:
    measured = f"{size} bytes, " if size is not None else ""
    return ValidationError(
        "payload",
        f"{measured}larger than the limit of {limits.payload_bytes} bytes of JSON (payload_bytes)",
        limit=f"payload_bytes={limits.payload_bytes}",
    )


def _too_deep(limits: InputLimits) -> ValidationError:
    return ValidationError(
        "payload",
        f"nested deeper than the limit of {limits.max_depth} levels (max_depth)",
        limit=f"max_depth={limits.max_depth}",
    )


def _out_of_range(path: str) -> ValidationError:
    return ValidationError(
        path,
        f"an integer out of the signed 64-bit range [{INT64_MIN}, {INT64_MAX}]",
        limit="int64",
    )
