"""Traces through OpenTelemetry: one trace per request, carried across processes as W3C context.

sekali is a library to the application around it: its spans go to whatever ``TracerProvider``
the application set globally (``trace.set_tracer_provider``, what the OpenTelemetry docs tell an
application to do), through ``trace.get_tracer`` at call time; nothing else is needed. Then
sekali's own database engines report their statements as child spans; the application's Redis
and HTTP clients are its own business (it instruments them if it wants).

Off by default, and then free: while the global provider is the API's proxy or no-op one (no
SDK set up) and :func:`configure_tracing` found no ``OTEL_*`` variable, :func:`span` hands out
one shared no-op context manager and no instrumentation is installed. sekali's own processes
(``sekali dev``'s runs, the CLI, the chaos workers) call :func:`configure_tracing`: when the
standard variables ask for it (``OTEL_EXPORTER_OTLP_ENDPOINT``,
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_TRACES_EXPORTER``) it sets up the SDK with the
OTLP exporter they describe (Jaeger, Tempo, any collector), in batches from a background thread,
and SQLAlchemy, Redis and urllib3 calls become child spans by themselves (urllib3 also sends
``traceparent`` downstream).

A trace crosses process boundaries as a ``traceparent`` string (W3C Trace Context): stored with
the job request, set as a run tag, kept on the outbox row, sent to providers. :func:`inject` and
:func:`extract` turn the current context into that string and back.

:func:`use_provider` sets a provider and instruments the Redis and urllib3 clients too (tests
use it with the SDK's in-memory exporter).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ParamSpec, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = [
    "SpanKind",
    "configure_tracing",
    "extract",
    "inject",
    "set_attributes",
    "span",
    "trace_id_of",
    "traced",
    "tracer",
    "tracing_enabled",
    "use_provider",
]

TRACER_NAME = "sekali"
_PROPAGATOR = TraceContextTextMapPropagator()
_NULL = contextlib.nullcontext()
_lock = threading.Lock()
_enabled = False
_engines: weakref.WeakSet[Any] = weakref.WeakSet()


def tracing_enabled() -> bool:
    """Whether spans are recorded: sekali set up a provider, or the application set one globally.

    The check is cheap while off (a global read and an ``isinstance``), and once a real provider
    is seen it is remembered: OpenTelemetry lets the global provider be set only once.
    """
    return not _off()


_API = vars(trace)
"""The API module's globals: its ``_TRACER_PROVIDER`` is what its own ProxyTracer reads.
``get_tracer_provider()`` also looks the environment up on every call, which made the off path
cost several microseconds a call here."""


def _off() -> bool:
    """True while neither sekali nor the application set a provider (the fast path)."""
    return not _enabled and (_API.get("_TRACER_PROVIDER") is None or not _adopt_global_provider())


def _adopt_global_provider() -> bool:
    global _enabled
    provider = _API.get("_TRACER_PROVIDER")
    if provider is None or isinstance(provider, trace.NoOpTracerProvider):
        return False
    with _lock:
        _enabled = True
        for engine in list(_engines):
            _instrument_engine(engine)
    return True


def _wanted(env: Mapping[str, str]) -> bool:
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none" or env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    return bool(
        exporter
        or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def configure_tracing(service_name: str = "sekali", env: Mapping[str, str] | None = None) -> bool:
    """Turn tracing on in this process when the ``OTEL_*`` variables ask for it; idempotent.

    Returns whether tracing is on. Opens no connection: the exporter sends in the background.
    """
    global _enabled
    if tracing_enabled() or not _wanted(os.environ if env is None else env):
        return _enabled
    with _lock:
        if _enabled:
            return True
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # noqa: PLC0415
            OTLPSpanExporter,
        )
        from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
        from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
        from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415

        provider = TracerProvider(
            resource=Resource.create({"service.name": os.environ.get(
                "OTEL_SERVICE_NAME", service_name)})
        )
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        _install(provider)
    return True


def use_provider(provider: Any) -> None:
    """Route spans to ``provider`` (an SDK ``TracerProvider``) and instrument the clients."""
    global _enabled
    with _lock:
        _install(provider)


def _install(provider: Any) -> None:
    global _enabled
    trace.set_tracer_provider(provider)
    _instrument_clients(provider)
    _enabled = True
    for engine in list(_engines):
        _instrument_engine(engine)


def trace_engine(engine: Any) -> None:
    """Make ``engine``'s statements spans: now if tracing is on, else when it is turned on."""
    _engines.add(engine)
    if tracing_enabled():
        _instrument_engine(engine)


def _instrument_engine(engine: Any) -> None:
    if getattr(engine, "_sekali_traced", False):
        return
    from opentelemetry.instrumentation.sqlalchemy.engine import EngineTracer  # noqa: PLC0415
    from opentelemetry.metrics import get_meter  # noqa: PLC0415

    usage = get_meter(TRACER_NAME).create_up_down_counter("db.client.connections.usage")
    EngineTracer(  # type: ignore[no-untyped-call]
        trace.get_tracer("opentelemetry.instrumentation.sqlalchemy"), engine, usage
    )
    engine._sekali_traced = True


def _instrument_clients(provider: Any) -> None:
    from opentelemetry.instrumentation.redis import RedisInstrumentor  # noqa: PLC0415
    from opentelemetry.instrumentation.urllib3 import URLLib3Instrumentor  # noqa: PLC0415

    for instrumentor in (RedisInstrumentor(), URLLib3Instrumentor()):
        if not instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.instrument(tracer_provider=provider)


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def span(
    name: str,
    *,
    parent: str | None = None,
    links: list[str] | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    **attributes: Any,
) -> Any:
    """A span around a block (``with span("lock.acquire", lock=name) as s:``).

    ``parent``: a ``traceparent`` to continue (another process's trace); ``links``: traceparents
    this span relates to without being their child (a duplicate and the run that made the
    effect). Attribute names get the ``sekali.`` prefix; ``None`` values are left out. When
    tracing is off this is one shared no-op context manager.
    """
    if _off():
        return _NULL
    return _span(name, parent, links, kind, attributes)


@contextlib.contextmanager
def _span(
    name: str, parent: str | None, links: list[str] | None, kind: SpanKind,
    attributes: dict[str, Any],
) -> Iterator[Span]:
    ctx = extract(parent) if parent else None
    span_links = [Link(sc) for sc in (_span_context(tp) for tp in links or []) if sc is not None]
    with tracer().start_as_current_span(
        name, context=ctx, kind=kind, links=span_links, attributes=_attributes(attributes)
    ) as current:
        try:
            yield current
        except BaseException as exc:
            current.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}"))
            current.set_attribute("sekali.error_type", type(exc).__name__)
            raise


P = ParamSpec("P")
R = TypeVar("R")


def traced(
    name: str,
    *,
    attributes: Mapping[str, str] | None = None,
    parent: str | None = None,
    fixed: Callable[[], Mapping[str, Any]] | None = None,
    returned: Callable[[Any], Mapping[str, Any]] | None = None,
    before: Callable[[], object] | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """The decorated function runs as the span ``name``: one function, no twin that only opens
    the span.

    ``attributes`` maps span attribute names to the function's parameter names (defaults
    included); ``parent`` names the parameter holding a ``traceparent`` to continue; ``fixed``
    gives attributes that depend on no argument (the worker); ``returned`` adds attributes from
    the result; ``before`` runs first, on every call (setting tracing up from the
    environment). With tracing off the function is called straight, arguments unread.
    """
    names = dict(attributes or {})

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            if before is not None:
                before()
            if _off():
                return fn(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            given = bound.arguments
            values = {attr: given[param] for attr, param in names.items()}
            with span(name, parent=given[parent] if parent else None,
                      **values, **(fixed() if fixed else {})):
                result = fn(*args, **kwargs)
                if returned is not None:
                    set_attributes(**returned(result))
                return result

        return wrapper

    return decorate


def set_attributes(**attributes: Any) -> None:
    """Add attributes to the current span (nothing when tracing is off)."""
    if not _off():
        trace.get_current_span().set_attributes(_attributes(attributes))


MAX_ATTRIBUTE_CHARS = 256
"""Attribute values are cut to this: a hostile key must not become a 10 MB span."""


def _attributes(attributes: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in attributes.items():
        if value is None:
            continue
        if not isinstance(value, bool | int | float):
            value = str(value)[:MAX_ATTRIBUTE_CHARS]
        out[key if "." in key else f"sekali.{key}"] = value
    return out


def inject() -> str | None:
    """The current span's context as a ``traceparent`` string, or None (tracing off, no span)."""
    if _off():
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier.get("traceparent")


def extract(traceparent: str | None) -> otel_context.Context | None:
    """The context a ``traceparent`` string names (None for a missing or malformed one)."""
    if not traceparent:
        return None
    ctx = _PROPAGATOR.extract({"traceparent": traceparent})
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def _span_context(traceparent: str) -> trace.SpanContext | None:
    ctx = extract(traceparent)
    return None if ctx is None else trace.get_current_span(ctx).get_span_context()


def trace_id_of(traceparent: str | None) -> str | None:
    """The 32-hex trace id inside a ``traceparent`` (what a trace UI searches for)."""
    if not traceparent:
        return None
    parts = traceparent.split("-")
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else None
