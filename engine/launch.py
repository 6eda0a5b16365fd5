"""How a request becomes a run of its job type's per-request job: the run config every way in
builds (the intake sensor, a DLQ replay, reconciliation handing a stuck claim to the DLQ).

The shape is the per-request op's config, ``{"ops": {"<job type>_op": {"config": {payload,
key, request_id, correlation_id}}}}`` (the typed config class itself is the Dagster adapter's:
``pipelines.ops.request_job``). Plain data, no Dagster.
"""

from __future__ import annotations

from typing import Any

from engine.contract import op_name_of
from engine.registry import get_job_type
from resources.errors import ValidationError


def op_run_config(job_type: str, config: dict[str, Any]) -> dict[str, Any]:
    """``config`` as the run config of ``job_type``'s per-request op, unchecked."""
    return {"ops": {op_name_of(job_type): {"config": config}}}


def request_run_config(
    job_type: str,
    payload: Any,
    *,
    key: str | None = None,
    request_id: int | None = None,
    correlation_id: str | None = None,
) -> dict[str, Any]:
    """Run config of ``job_type``'s per-request job for ``payload``, fitting its config class.

    The payload goes through the job type's ``validate`` first, so a payload stored in an older
    form (a free-form map from before the typed config, a number where a string is wanted)
    comes out in the form the class takes. Raises :class:`ValidationError` (naming the field)
    when the payload is not valid at all: such a request cannot make a valid run.
    """
    jt = get_job_type(job_type)
    if not isinstance(payload, dict):
        raise ValidationError("payload", "must be an object", payload)
    config: dict[str, Any] = {"payload": jt.validate(dict(payload))}
    for name, value in (("key", key), ("request_id", request_id),
                        ("correlation_id", correlation_id)):
        if value is not None:
            config[name] = value
    return op_run_config(jt.name, config)
