"""The thin Dagster wrappers around the defences: configuration in, a plain object out.

This is the one module under ``resources/`` that imports Dagster. Each resource only holds
configuration and builds its object (a store, a lock factory, a cache, the retry policy and
budget, the flow limits) on first use, from :class:`resources.storage.settings.Settings` read at
that moment, so importing the definitions opens no socket and reads no environment. The work is
done by the plain classes, which a web app, a test or the chaos harness use without Dagster.

:func:`to_dagster` turns a retry decision into Dagster's signal (``RetryRequested`` or
``Failure(allow_retries=False)``); the job platform's one failure path calls it.

:class:`PlainDocs`: the docstrings are written for the code's readers in reST; Dagster shows a
config class's docstring and field descriptions in the Launchpad and the resource pages, so
every sekali config and resource class hands Dagster plain text (:func:`plain_text`).
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import re
import uuid
from typing import Any, Literal

from dagster import ConfigurableResource, Failure, RetryRequested
from dagster._config.pythonic_config import config as pythonic_config
from dagster._config.pythonic_config import resource as pythonic
from dagster._utils.error import USER_FACING_ERROR_ID_ATTR_NAME
from pydantic import PrivateAttr

from resources.cache import CachePolicy, StampedeCache
from resources.dlq import DlqStore
from resources.flow import ConcurrencyLimits, RateLimits
from resources.idempotency import IdempotencyStore
from resources.locks import DEFAULT_TTL_SECONDS, DbLock, LockFactory, NoLock, RedisLock
from resources.retry import ErrorClass, RetryBudget, RetryDecision, RetryPolicy
from resources.storage.db import Database, shared_database
from resources.storage.migrations import ensure_schema
from resources.storage.redis import RedisClient, redis_client
from resources.storage.settings import Settings

log = logging.getLogger(__name__)

_ROLE = re.compile(r":[a-z]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")
_LITERAL = re.compile(r"``(.+?)``|`([^`]+)`", re.S)


def plain_text(rest: str | None) -> str | None:
    """A reST docstring as plain text: indentation cleaned, ``x`` and `x` as x, a role
    (:class:`~a.B`, :func:`a.b`) as its target (the last part after ``~``), ``::`` as ``:``."""
    if not rest:
        return rest

    def role(match: re.Match[str]) -> str:
        target = match.group(1).strip()
        return target.rsplit(".", 1)[-1] if match.group(0).split("`", 1)[1].startswith("~") \
            else target

    text = _ROLE.sub(role, inspect.cleandoc(rest))
    text = _LITERAL.sub(lambda m: m.group(1) or m.group(2), text)
    return re.sub(r"(\S)::(\s|$)", r"\1:\2", text)


class PlainDocs:
    """Mixin for a Dagster config or resource class: at class creation its docstring and its
    fields' descriptions become :func:`plain_text`, which is what Dagster reads later."""

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)  # type: ignore[misc]
        cls.__doc__ = plain_text(cls.__doc__)
        for info in getattr(cls, "model_fields", {}).values():
            info.description = plain_text(info.description)


class SettingsResource(PlainDocs, ConfigurableResource):
    """The shared base: URLs left unset fall back to the environment, read when first used.

    Subclasses build their object in ``_build`` and hand it out through ``_get``; the object is
    built once per resource copy (Dagster copies resources per run, step or tick), from the
    settings that copy read first.
    """

    database_url: str | None = None
    redis_url: str | None = None

    _built: Any = PrivateAttr(default=None)
    _settings: Settings | None = PrivateAttr(default=None)

    def _build(self) -> Any:
        raise NotImplementedError

    def _get(self) -> Any:
        if self._built is None:
            self._built = self._build()
        return self._built

    def settings(self) -> Settings:
        """The environment's settings as this copy first read them (a copy lives one run, step
        or tick, as the object it builds)."""
        if self._settings is None:
            self._settings = Settings.from_env()
        return self._settings

    def database(self) -> Database:
        """The shared :class:`Database` of ``database_url`` (``DATABASE_URL`` if unset), its
        schema checked at this process's first use (:func:`ensure_schema`: applied where
        ``SEKALI_AUTO_MIGRATE`` allows, refused with the command to run if this release needs
        migrations the database lacks, one warning line if a newer release expanded it)."""
        db = shared_database(self.database_url or self.settings().database_url)
        ensure_schema(db)
        return db

    def redis(self) -> RedisClient:
        """A Redis client of ``redis_url`` (``REDIS_URL`` if unset), with explicit timeouts."""
        return redis_client(self.redis_url or self.settings().redis_url)


def _class_facts_once() -> None:
    """Make each :class:`SettingsResource` class work out what Dagster reads from its fields once.

    Dagster makes three copies of a resource each time it initializes it (for a run, a step, a
    sensor tick), and every copy works out its class's facts again from the pydantic fields
    (Dagster 1.13): the config schema, which fields are nested resources, the field map each
    value is looked up in (once per value: a copy of a class of n fields builds n maps of n),
    and the schema with the copy's values as defaults (validated again each time). Measured
    on an empty micro-batch run, paid by every run and sensor tick: 83 ms of CPU with none
    shared, 48 with the schema, 37 with all four. They depend only on the class, the fields
    left out of the schema and the values, and Dagster never changes what it built (a default
    is applied to a copy), so the copies share them; every other call (another class, a schema
    with a description or a default) goes to Dagster as before.
    ``tests/test_resource_copies.py`` fails if a Dagster release moves a function this wraps."""
    infer = getattr(pythonic, "infer_schema_from_config_class")  # noqa: B009 - not exported
    if getattr(infer, "one_per_class", False):
        return
    param_fields = getattr(pythonic, "_get_resource_param_fields")  # noqa: B009
    field_map = getattr(pythonic_config, "model_fields")  # noqa: B009
    curry = getattr(pythonic, "_curry_config_schema")  # noqa: B009
    made: set[int] = set()  # ids of the schemas of_class made (its cache keeps them alive)
    curried: dict[tuple[int, str], Any] = {}

    def ours(cls: Any) -> bool:
        return isinstance(cls, type) and issubclass(cls, SettingsResource)

    @functools.cache
    def of_class(cls: type, omitted: frozenset[str]) -> Any:
        built = infer(cls, fields_to_omit=set(omitted))
        made.add(id(built))
        return built

    def schema(model_cls: Any, description: str | None = None,
               fields_to_omit: set[str] | None = None, default: Any | None = None) -> Any:
        if description is None and default is None and ours(model_cls):
            return of_class(model_cls, frozenset(fields_to_omit or ()))
        return infer(model_cls, description=description, fields_to_omit=fields_to_omit,
                     default=default)

    def with_defaults(field: Any, values: Any) -> Any:
        if id(field) not in made:
            return curry(field, values)
        try:
            key = (id(field), json.dumps(values, sort_keys=True))
        except (TypeError, ValueError):  # a value JSON cannot tell apart: not shared
            return curry(field, values)
        if key not in curried:
            if len(curried) >= _CURRIED_KEPT:
                curried.clear()
            curried[key] = curry(field, values)
        return curried[key]

    resource_fields = functools.cache(lambda cls: frozenset(param_fields(cls)))
    fields = functools.cache(field_map)

    schema.one_per_class = True  # type: ignore[attr-defined]
    setattr(pythonic, "infer_schema_from_config_class", schema)  # noqa: B010 - not exported
    setattr(pythonic, "_curry_config_schema", with_defaults)  # noqa: B010
    setattr(pythonic, "_get_resource_param_fields",  # noqa: B010
            lambda cls: resource_fields(cls) if ours(cls) else param_fields(cls))
    setattr(pythonic_config, "model_fields",  # noqa: B010
            lambda cls: fields(cls) if ours(cls) else field_map(cls))


_CURRIED_KEPT = 1024  # distinct (class, values) schemas kept; a deployment has a few dozen


_class_facts_once()


class DatabaseResource(SettingsResource):
    """The app database."""

    def _build(self) -> Database:
        return self.database()

    def get_database(self) -> Database:
        return self._get()  # type: ignore[no-any-return]


class IdempotencyResource(SettingsResource):
    """The idempotency store on the app database."""

    lease_seconds: float = 60.0
    retention_hours: float = 7 * 24.0

    def _build(self) -> IdempotencyStore:
        return IdempotencyStore(
            self.database(),
            lease_seconds=self.lease_seconds,
            retention_seconds=self.retention_hours * 3600,
        )

    def get_store(self) -> IdempotencyStore:
        return self._get()  # type: ignore[no-any-return]


class DlqResource(SettingsResource):
    """The DLQ store. ``retention_days`` bounds how long resolved/discarded records are kept (open
    ones never go); ``warn_days`` is how early the retention check warns."""

    retention_days: float = 30.0
    warn_days: float = 3.0

    def _build(self) -> DlqStore:
        return DlqStore(self.database())

    def get_store(self) -> DlqStore:
        return self._get()  # type: ignore[no-any-return]


class CacheResource(SettingsResource):
    """A :class:`StampedeCache` on Redis."""

    namespace: str = "sekali"
    ttl: float = 60.0
    stale_ttl: float = 0.0
    jitter: float = 0.1
    beta: float = 1.0
    spread_first_refresh: bool = True
    lock_ttl: float = 15.0
    wait_timeout: float = 20.0
    negative_ttl: float = 0.0

    def _build(self) -> StampedeCache:
        return StampedeCache(
            self.redis(),
            namespace=self.namespace,
            policy=CachePolicy(
                ttl=self.ttl,
                stale_ttl=self.stale_ttl,
                jitter=self.jitter,
                beta=self.beta,
                spread_first_refresh=self.spread_first_refresh,
                lock_ttl=self.lock_ttl,
                wait_timeout=self.wait_timeout,
                negative_ttl=self.negative_ttl,
            ),
        )

    def get_cache(self) -> StampedeCache:
        return self._get()  # type: ignore[no-any-return]

    def teardown_after_execution(self, context: Any) -> None:
        if self._built is not None:
            self._built.close()
            self._built = None


class LockResource(SettingsResource):
    """``lock(name)`` returns a lock of the configured backend.

    ``backend`` is ``redis`` (``redis_url``), ``db`` (``database_url``; apply ``sql/`` first) or
    ``none``. ``wait_seconds`` bounds the wait (``None``: forever); ``max_hold_seconds`` bounds
    renewal. No connection opens until the first ``lock()``.
    """

    backend: Literal["redis", "db", "none"] = "redis"
    ttl_seconds: float = DEFAULT_TTL_SECONDS
    auto_renew: bool = True
    wait_seconds: float | None = 10.0
    max_hold_seconds: float | None = None

    def _build(self) -> RedisClient | Database:
        return self.redis() if self.backend == "redis" else self.database()

    def lock(self, name: str) -> RedisLock | DbLock | NoLock:
        common: dict[str, Any] = {
            "ttl": self.ttl_seconds,
            "auto_renew": self.auto_renew,
            "blocking_timeout": self.wait_seconds,
            "max_hold": self.max_hold_seconds,
        }
        if self.backend == "none":
            return NoLock(name, ttl=self.ttl_seconds)
        if self.backend == "redis":
            return RedisLock(self._get(), name, **common)
        return DbLock(self._get(), name, **common)

    def get_factory(self) -> LockFactory | None:
        """What the engine takes an exclusive job type's lock from (``Services.locks``): this
        backend and TTL, the caller's wait and hold bounds; None for ``none``, which cannot
        exclude."""
        if self.backend == "none":
            return None
        cls = RedisLock if self.backend == "redis" else DbLock
        return functools.partial(cls, self._get(), ttl=self.ttl_seconds,
                                 auto_renew=self.auto_renew)


class ConcurrencyResource(SettingsResource):
    """Per-key concurrency limits (:class:`resources.flow.ConcurrencyLimits`) on ``redis_url``.

    A job type declares its key and limit; this says how long a slot's lease lasts without
    renewal (keep it at or below the idempotency lease) and how long a job waits for a slot
    before :class:`resources.errors.LimitNotAcquired` (``None``: as long as it takes).
    """

    lease_seconds: float = 30.0
    wait_seconds: float | None = 30.0
    prefix: str = "sekali:flow:limit:"

    def _build(self) -> ConcurrencyLimits:
        return ConcurrencyLimits(
            self.redis(), lease=self.lease_seconds, wait=self.wait_seconds, prefix=self.prefix
        )

    def get_limits(self) -> ConcurrencyLimits:
        return self._get()  # type: ignore[no-any-return]


class RateLimitResource(SettingsResource):
    """Shared rates per downstream (:class:`resources.flow.RateLimits`) on ``redis_url``.

    The rates come from ``SEKALI_RATE_<DOWNSTREAM>`` (``50/s,burst=20``), read when first used;
    ``rates`` here overrides them by downstream name. A downstream with no rate is unlimited.
    """

    rates: dict[str, str] = {}
    prefix: str = "sekali:flow:rate:"

    def _build(self) -> RateLimits:
        return RateLimits(
            self.redis(), {**self.settings().rates, **self.rates}, prefix=self.prefix
        )

    def get_limits(self) -> RateLimits:
        return self._get()  # type: ignore[no-any-return]


class RetryResource(SettingsResource):
    """The retry policy and the shared retry budget (``budget_enabled: false`` to go without)."""

    max_attempts: int = 5
    base_delay: float = 1.0
    max_delay: float = 60.0
    jitter: str = "full"
    total_budget_seconds: float = 600.0
    max_unknown_attempts: int = 2
    budget_enabled: bool = True
    budget_capacity: float = 100.0
    budget_refill_per_success: float = 0.1
    budget_namespace: str = "sekali"

    def _build(self) -> RetryBudget:
        return RetryBudget(
            self.redis(),
            capacity=self.budget_capacity,
            refill_per_success=self.budget_refill_per_success,
            namespace=self.budget_namespace,
        )

    def get_policy(self) -> RetryPolicy:
        return RetryPolicy(
            max_attempts=self.max_attempts,
            base_delay=self.base_delay,
            max_delay=self.max_delay,
            jitter=self.jitter,
            total_budget_seconds=self.total_budget_seconds,
            max_unknown_attempts=self.max_unknown_attempts,
        )

    def get_budget(self) -> RetryBudget | None:
        return self._get() if self.budget_enabled else None

    def record_success(self, downstream: str) -> None:
        """Call after each clean success against ``downstream``: refunds the shared budget."""
        budget = self.get_budget()
        if budget is not None:
            budget.refund(downstream)

    def to_dagster(
        self,
        exc: BaseException,
        *,
        attempt: int,
        elapsed: float = 0.0,
        downstream: str | None = None,
    ) -> BaseException:
        """:func:`to_dagster` with this resource's policy and budget."""
        return to_dagster(
            exc,
            attempt=attempt,
            policy=self.get_policy(),
            elapsed=elapsed,
            budget=self.get_budget() if downstream else None,
            downstream=downstream,
        )


def dagster_signal(exc: BaseException, decision: RetryDecision, policy: RetryPolicy) -> Exception:
    """What Dagster should see for ``decision``: raise the result ``from exc``.

    Retry -> ``RetryRequested(max_retries=policy.max_attempts - 1, seconds_to_wait=delay)``.
    Give up -> ``Failure(allow_retries=False)`` with metadata ``error_class``, ``reason``,
    ``attempt``, ``error_type``; for a classified error (permanent, transient) an
    :func:`expected_failure`, whose failure events read one line; an ``unknown`` one keeps its
    stack traces (a bug to read). The run-retry daemon ignores ``allow_retries``: jobs that use
    run retries must also set ``dagster/retry_on_asset_or_op_failure: false``.
    """
    if decision.retry:
        log.info(
            "retrying after attempt %d in %.3fs (%s: %s)%s",
            decision.attempt,
            decision.delay,
            decision.error_class,
            type(exc).__name__,
            f"; {decision.reason}" if decision.reason else "",
            extra={"attempt": decision.attempt, "error_class": str(decision.error_class)},
        )
        return RetryRequested(max_retries=policy.max_attempts - 1, seconds_to_wait=decision.delay)
    metadata: dict[str, Any] = {
        "error_class": str(decision.error_class),
        "reason": decision.reason or "",
        "attempt": decision.attempt,
        "error_type": type(exc).__name__,
    }
    expected = decision.error_class is not ErrorClass.UNKNOWN
    lines = str(exc).strip().splitlines()
    why = "" if decision.reason == str(decision.error_class) else f": {decision.reason}"
    description = (f"{decision.error_class}: {type(exc).__name__}: "
                   f"{lines[0] if expected and lines else exc} "
                   f"(given up at attempt {decision.attempt + 1}{why})")
    if expected:
        failure = expected_failure(description, metadata=metadata)
        said = f"; error id {error_id(failure)}"
    else:
        failure = Failure(description=description, allow_retries=False, metadata=metadata)
        said = ""
    log.warning(
        "giving up after attempt %d: %s (%s: %s)%s",
        decision.attempt,
        decision.reason,
        decision.error_class,
        type(exc).__name__,
        said,
        extra={"attempt": decision.attempt, "error_class": str(decision.error_class)},
    )
    return failure


def expected_failure(description: str, *, metadata: dict[str, Any] | None = None) -> Failure:
    """``Failure(description, allow_retries=False)`` for an outcome the code expected (a
    classified business error, a refused input): Dagster's ``STEP_FAILURE`` and
    ``RUN_FAILURE`` events carry its description with no stack trace and no chained error, so
    the run page reads one line where a raised error shows Dagster's frames and the cause's.

    How (Dagster 1.13.27, ``dagster._utils.error.serializable_error_info_from_exc_info``): an
    exception that carries ``USER_FACING_ERROR_ID_ATTR_NAME`` (what
    ``DAGSTER_REDACT_USER_CODE_ERRORS`` sets on every error) is stored with an empty stack and
    no cause, its message followed by ``Error ID <id>. ... Search in logs for this error ID``
    (:func:`error_id`; :func:`dagster_signal` logs it in its giving-up line). The one failure
    path keeps the full error where it belongs (the attempt row, the dead letter's
    ``--trace``). ``tests/test_failure_events.py`` fails if an upgrade changes this.
    """
    failure = Failure(description=description, allow_retries=False, metadata=metadata)
    setattr(failure, USER_FACING_ERROR_ID_ATTR_NAME, uuid.uuid4().hex[:12])
    return failure


def error_id(failure: Failure) -> str:
    """The id an :func:`expected_failure`'s events name ("Error ID ...")."""
    return str(getattr(failure, USER_FACING_ERROR_ID_ATTR_NAME, ""))


def to_dagster(
    exc: BaseException,
    *,
    attempt: int,
    policy: RetryPolicy,
    elapsed: float = 0.0,
    budget: RetryBudget | None = None,
    downstream: str | None = None,
    previous_delay: float | None = None,
) -> Exception:
    """Decide with ``policy`` (and ``budget``) and return Dagster's signal for it."""
    decision = policy.decide(
        exc,
        attempt=attempt,
        elapsed=elapsed,
        previous_delay=previous_delay,
        budget=budget,
        downstream=downstream,
    )
    return dagster_signal(exc, decision, policy)
