"""How a request becomes a run of its job type's per-request job: the run config every way in
builds.

The shape is the per-request op's config, ``{"ops": {"<job type>_op": {"config": ...}}}`` (the
typed config class itself is the Dagster adapter's: ``pipelines.ops.request_job``). A stored
request's run (the intake sensor, a DLQ replay) names its ``request_id`` only
(:func:`stored_request_run_config`): the op reads the payload from ``job_requests``, so no
payload value reaches Dagster's run storage. A payload in the config
(:func:`request_run_config`) is what a person launching a run by hand gives. Plain data, no
Dagster.
"""

from __future__ import annotations

from typing import Any

from engine.contract import op_name_of
from engine.registry import get_job_type
from resources.errors import ValidationError


def op_run_config(job_type: str, config: dict[str, Any]) -> dict[str, Any]:
    """``config`` as the run config of ``job_type``'s per-request op, unchecked."""
    return {"ops": {op_name_of(job_type): {"config": config}}}


def stored_request_run_config(job_type: str, request_id: int) -> dict[str, Any]:
    """Run config of ``job_type``'s per-request job serving the stored request ``request_id``."""
    return op_run_config(job_type, {"request_id": int(request_id)})


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
