"""The per-request Dagster job of a job type: one op, a thin adapter over the step entry
:func:`engine.step.run_step` (the same entry the chaos harness's workers call for each
delivery), that turns its failures into Dagster retries.

Run config: a run launched by the intake or a DLQ replay names the stored request only, and the
op reads its payload from ``job_requests``, so no payload value reaches Dagster's run storage::

    ops:
      charge_payment_op:
        config:
          request_id: 42

A run launched by hand (the UI's launchpad opens on the job type's example) carries the
payload, and the op makes it a request first (``source = launchpad``)::

    ops:
      charge_payment_op:
        config:
          payload: {order_id: o-1, amount_cents: 1250, currency: EUR}
          key: null            # optional; default derived from the payload
          correlation_id: null # optional; default the run tag sekali/correlation_id, else run id

``payload`` is typed per job type (:func:`config_class`, built from the job type's declared
fields): Dagster refuses an unknown field or a wrong type before the run is launched, naming
the field. The job type's ``validate`` still checks the values in the op, naming the bad field
in a permanent failure whose dead letter keeps the key whenever the payload names it.

The op tags its run ``sekali/key`` and, when it ends, ``sekali/outcome`` (effect, duplicate,
retried, dead_lettered, failed) and, for a duplicate, ``sekali/original_run``: the runs list
filters on them. Its output metadata names the business result with a link to the run that made
it.

Failures go through the one failure path (:mod:`engine.step`, signalled by
:mod:`pipelines.ops.failures`). Transient ->
``RetryRequested`` with our capped, jittered delay; permanent, or out of attempts/time/retry
budget -> ``Failure(allow_retries=False)``, and the request is marked failed for the DLQ. The
jobs carry ``dagster/retry_on_asset_or_op_failure:
"false"`` so the run-retry daemon does not retry what the op gave up on (the DLQ does).
"""

# No ``from __future__ import annotations`` here: Dagster reads the op's config annotation
# (the job type's config class) at definition time and cannot resolve it from a string.
import enum
from typing import Any, cast

import dagster as dg
import pydantic

from engine import tags as tag
from engine.attempts import Outcome
from engine.contract import JobType, PayloadField
from engine.requests import JobRequest, RequestStore
from engine.services import Services
from engine.validation import check_key, check_request
from pipelines.ops.failures import run_op_step, step_services, tag_cancelled, unready_signal
from resources.dagster_resources import PlainDocs, expected_failure
from resources.errors import ValidationError
from resources.storage.settings import InputLimits

BASE_RESOURCES = frozenset({"idempotency", "app_db", "retry"})
"""What every request op needs; a job type adds its own (``JobType.resource_keys``: its
downstream clients, the platform services it names, the concurrency limits)."""

RUN_OUTCOMES: dict[Outcome, tag.RunOutcome] = {
    Outcome.COMPLETED: tag.RunOutcome.EFFECT,
    Outcome.DUPLICATE_SUPPRESSED: tag.RunOutcome.DUPLICATE,
    Outcome.RETRIED: tag.RunOutcome.RETRIED,
    Outcome.DEAD_LETTERED: tag.RunOutcome.DEAD_LETTERED,
    Outcome.FAILED_PERMANENT: tag.RunOutcome.FAILED,
}


class RequestConfig(PlainDocs, dg.Config):
    """What every request carries besides its payload."""

    key: str | None = pydantic.Field(
        default=None, description="The idempotency key; default derived from the payload."
    )
    request_id: int | None = pydantic.Field(
        default=None, description="The intake's job_requests id (set by the intake sensor)."
    )
    correlation_id: str | None = pydantic.Field(
        default=None,
        description="Follows the request across services; default the sekali/correlation_id tag,"
        " else the run id.",
    )


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def _annotation(owner: str, spec: PayloadField) -> Any:
    if spec.choices:
        return enum.Enum(owner + _camel(spec.name), {c: c for c in spec.choices})
    if spec.type is list:
        return list[_model(owner + _camel(spec.name), spec.items)]  # type: ignore[misc]
    if spec.type is dict:
        return dict[str, str]
    return spec.type


def _model(name: str, fields: tuple[PayloadField, ...]) -> type[dg.Config]:
    definitions: dict[str, Any] = {}
    for spec in fields:
        if spec.required:
            info = pydantic.Field(description=spec.description)
        elif spec.type is dict and spec.default is None:
            info = pydantic.Field(default_factory=dict, description=spec.description)
        else:
            info = pydantic.Field(default=spec.default, description=spec.description)
        definitions[spec.name] = (_annotation(name, spec), info)
    return pydantic.create_model(name, __base__=dg.Config, **definitions)


def config_class(jt: JobType) -> type[RequestConfig]:
    """The typed run config of ``jt``'s op: ``payload`` with the job type's declared fields
    (none when the run serves a stored request), plus :class:`RequestConfig`'s optional key,
    request id and correlation id."""
    name = _camel(jt.name)
    payload: Any = _model(f"{name}Payload", jt.presentation.fields) | None
    return pydantic.create_model(
        f"{name}Config",
        __base__=RequestConfig,
        payload=(payload, pydantic.Field(
            default=None, description=f"The {jt.name} request, for a run launched by hand (a"
            f" run of a stored request names its request_id instead)."
            f" {jt.presentation.description}")),
    )


def payload_of(config: dg.Config) -> dict[str, Any] | None:
    """The payload of a typed config as the plain dict the job type validates (None: none)."""
    payload = cast(pydantic.BaseModel | None, getattr(config, "payload"))  # noqa: B009
    return None if payload is None else payload.model_dump(mode="json")


def job_tags(jt: JobType) -> dict[str, str]:
    return {
        tag.QUEUE: jt.queue.value,
        tag.JOB_TYPE: jt.name,
        tag.MAX_RUNTIME: tag.run_bound(jt.running.max_runtime_seconds),
        **tag.NO_RUN_RETRY,
    }


def _key_of(jt: JobType, config: RequestConfig, payload: dict[str, Any] | None) -> str | None:
    """The run's key when its config passes the same checks as an enqueue (so no refused
    value reaches a run tag or a request row); None when it does not: the step's admission
    then refuses it, naming the field."""
    try:
        return check_request(jt.name, payload, config.key or None).key
    except ValidationError:
        return None


def _named_key(jt: JobType, config: RequestConfig, payload: Any) -> str | None:
    """The key a refused payload still names (the fields of the key valid, another one not),
    so its dead letter keeps it and a replay's dry run can look its effect up; None when the
    payload names none a key may be."""
    try:
        key = config.key or jt.keying.key_for(dict(payload))
        check_key(key, InputLimits.from_env())
    except Exception:  # noqa: BLE001 - any failure: the payload names no usable key
        return None
    return str(key)


def run_link(run_id: str) -> dg.MetadataValue:
    """A link to a run's page, relative to the webserver the UI is served from."""
    return dg.MetadataValue.url(f"/runs/{run_id}")


def result_metadata(jt: JobType, result: Any) -> dict[str, Any]:
    """The result's fields that name the effect (``jt.result_fields``), as metadata."""
    if not isinstance(result, dict):
        return {}
    out: dict[str, Any] = {}
    for name in jt.presentation.result_fields:
        value = result.get(name)
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, int):
            out[name] = dg.MetadataValue.int(value)
        elif isinstance(value, (dict, list)):
            out[name] = dg.MetadataValue.json(value)
        else:
            out[name] = dg.MetadataValue.text(str(value))
    return out


def _launchpad_request(
    context: dg.OpExecutionContext,
    requests: RequestStore,
    jt: JobType,
    key: str,
    payload: dict[str, Any],
    correlation_id: str,
) -> int | None:
    """The request record of a run launched by hand (source ``launchpad``), or the request
    enqueued before under the same key and payload; the run is tagged with its id, so the DLQ
    and ``sekali requests`` find it. None when the key is stored with another payload."""
    recorded = requests.record_run(
        jt.name, key, jt.validate(dict(payload)), queue=jt.queue, source="launchpad",
        run_id=context.run_id, correlation_id=correlation_id,
    )
    if recorded is None:
        return None
    if context.run.tags.get(tag.REQUEST_ID) != str(recorded.id):
        context.instance.add_run_tags(context.run_id, {tag.REQUEST_ID: str(recorded.id)})
    return recorded.id


def _stored_request(
    context: dg.OpExecutionContext, services: Services, jt: JobType, request: RequestConfig
) -> JobRequest | None:
    """The stored request a run serves (its ``request_id``), or None for a run launched by
    hand (a payload and no stored request: it becomes one). A request of another job type, or
    none at all with no payload either, fails the step at once."""
    if request.request_id is None:
        return None
    request_id = request.request_id
    try:
        stored = RequestStore(services.db).get(request_id)  # nosec B113: a row, not HTTP
    except Exception as exc:  # noqa: BLE001 - the database is away: the one path decides
        raise unready_signal(context, jt.op_name, exc, services, jt.name) from exc
    if stored is None and payload_of(request) is not None:
        return None
    if stored is None or stored.job_type != jt.name:
        raise expected_failure(
            f"request_id: job request {request_id} does not exist"
            + ("" if stored is None else f" for {jt.name} (it is a {stored.job_type} request)"))
    return stored


def request_op(jt: JobType) -> dg.OpDefinition:
    config_cls = config_class(jt)

    @dg.op(
        name=jt.op_name,
        description=jt.presentation.description,
        required_resource_keys=set(BASE_RESOURCES | jt.resource_keys),
        tags={tag.QUEUE: jt.queue.value},
    )
    def _op(
        context: dg.OpExecutionContext,
        config: config_cls,  # type: ignore[valid-type]
    ) -> dict[str, Any]:
        request: RequestConfig = config
        services = step_services(context, jt.op_name)
        run_id = context.run_id
        stored = _stored_request(context, services, jt, request)
        if stored is not None:  # the intake's or a replay's run: the row is the request
            payload: Any = stored.payload
            key: str | None = stored.key
            request_id: int | None = stored.id
            correlation_id = tag.run_correlation_id(stored.correlation_id, context.run.tags,
                                                    run_id)
        else:  # launched by hand: the payload becomes a request first
            payload = payload_of(request)
            key = _key_of(jt, request, payload)
            correlation_id = tag.run_correlation_id(request.correlation_id, context.run.tags,
                                                    run_id)
            request_id = request.request_id  # a harness's own numbering, no row of ours
            if key is not None and request_id is None:
                request_id = _launchpad_request(
                    context, RequestStore(services.db), jt, key, payload or {}, correlation_id)
            elif payload is not None:
                key = _named_key(jt, request, payload)
        if key is not None and context.run.tags.get(tag.KEY) != key:
            context.instance.add_run_tags(run_id, {tag.KEY: key})

        def tag_failure(outcome: Outcome) -> None:
            context.instance.add_run_tags(run_id, {tag.OUTCOME: str(RUN_OUTCOMES[outcome])})

        outcome = run_op_step(
            context,
            services,
            job_type=jt.name,
            payload=payload,
            key=key,
            step=jt.op_name,
            request_id=request_id,
            correlation_id=correlation_id,
            on_failure=tag_failure,
        )
        if outcome.status == "cancelled":
            tag_cancelled(context, services, request_id, str(outcome.result["detail"]))
            context.add_output_metadata({"outcome": "cancelled", "key": outcome.key,
                                         "detail": str(outcome.result["detail"])})
            return {"status": outcome.status, "key": outcome.key, "result": outcome.result}
        duplicate = outcome.status == "duplicate"
        run_tags = {
            tag.OUTCOME: str(tag.RunOutcome.DUPLICATE if duplicate else tag.RunOutcome.EFFECT)
        }
        original = services.attempts.effect_run(outcome.key) if duplicate else None
        if duplicate and original is not None:
            run_tags[tag.ORIGINAL_RUN] = original
        context.instance.add_run_tags(run_id, run_tags)
        context.log.info(
            f"{jt.name} {outcome.status} key={outcome.key} fence={outcome.fence} "
            f"attempt_id={outcome.attempt_id} correlation_id={correlation_id}"
        )
        metadata: dict[str, Any] = {"outcome": run_tags[tag.OUTCOME]}
        if duplicate and original is not None:
            metadata["original_run"] = run_link(original)
        metadata.update(result_metadata(jt, outcome.result))
        metadata.update(
            {"key": outcome.key, "status": outcome.status, "fence": outcome.fence,
             "attempt_id": outcome.attempt_id}
        )
        context.add_output_metadata(metadata)
        return {"status": outcome.status, "key": outcome.key, "result": outcome.result}

    return _op


def request_job(jt: JobType) -> dg.JobDefinition:
    """The Dagster job ``jt.name``: one op, in-process executor, queue and runtime tags, and the
    job type's example as the launch form's default config."""
    op_def = request_op(jt)

    @dg.job(
        name=jt.name,
        description=f"{jt.presentation.description} {jt.intake_summary}".strip(),
        executor_def=dg.in_process_executor,
        tags=job_tags(jt),
        config={"ops": {jt.op_name: {"config": {"payload": dict(jt.presentation.example)}}}},
    )
    def _job() -> None:
        op_def()

    return _job
