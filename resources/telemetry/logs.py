"""Structured (JSON) logs that carry the correlation fields.

One JSON object per line, so a log pipeline can join the producer's ``enqueue``, the run's
attempts and the downstream call on ``correlation_id`` without parsing prose. Fields come from
three places, later ones winning:

1. the ambient context set by :func:`correlation_context` (a ``contextvars`` scope, so threads
   and asyncio tasks each see their own);
2. ``extra={...}`` keys named in :data:`CORRELATION_FIELDS` (what ``pipelines/domain/payments.py``,
   ``pipelines/intake.py`` and others already pass);
3. the ``extra={"sekali": {...}}`` dict the attempt recorder logs (every attempt field).

Every line is written with its e-mail addresses masked (:mod:`resources.telemetry.redact`).

The chain the correlation id follows: ``enqueue(correlation_id=...)`` -> ``job_requests`` ->
run tag ``sekali/correlation_id`` and op config -> ``execute_request(correlation_id=...)`` ->
``job_attempts.correlation_id`` -> ``X-Correlation-Id`` on the gateway and mail requests.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
import time
from collections.abc import Iterator
from typing import IO, Any

from resources.telemetry.redact import RedactingFilter, redact

CORRELATION_FIELDS = (
    "correlation_id",
    "request_id",
    "job_type",
    "idempotency_key",
    "key",
    "run_id",
    "step",
    "attempt",
    "fence",
    "resource_id",
)

_EMPTY: dict[str, Any] = {}
_context: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar(
    "sekali_log_context", default=_EMPTY  # noqa: B039 - never mutated: scopes set a new dict
)


@contextlib.contextmanager
def correlation_context(**fields: Any) -> Iterator[dict[str, Any]]:
    """Attach fields (``correlation_id=...``, ``run_id=...``) to every log line in this scope."""
    merged = {**_context.get(), **{k: v for k, v in fields.items() if v is not None}}
    token = _context.set(merged)
    try:
        yield merged
    finally:
        _context.reset(token)


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON line: time, level, logger, message, correlation fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update(_context.get())
        for name in CORRELATION_FIELDS:
            value = record.__dict__.get(name)
            if value is not None:
                out[name] = value
        nested = record.__dict__.get("sekali")
        if isinstance(nested, dict):
            out.update({k: v for k, v in nested.items() if v is not None})
        if record.exc_info:
            out["exception"] = record.exc_text or self.formatException(record.exc_info)
        return redact(json.dumps(out, default=str, sort_keys=False))


def configure_json_logging(
    level: int = logging.INFO, *, stream: IO[str] | None = None, logger: str | None = None
) -> logging.Handler:
    """Send ``logger`` (the root by default) to ``stream`` as JSON lines, e-mail addresses
    masked (:class:`RedactingFilter`); returns the handler so a caller (or a test) can remove
    it again."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(RedactingFilter())
    target = logging.getLogger(logger)
    target.addHandler(handler)
    target.setLevel(level)
    return handler
