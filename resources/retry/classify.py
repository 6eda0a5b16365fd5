"""One classifier for every failure: does a retry have a chance to help?

Retries (:class:`resources.retry.RetryPolicy`) and the dead letter queue both ask this one
function, with the exception object itself, so a failure is never classified twice in two ways.

- PERMANENT: sekali errors with ``permanent = True`` (validation, conflicts, rejected by a
  downstream), pydantic validation errors, errors that say themselves no retry may help
  (``allow_retries = False``, as Dagster's ``Failure`` does), SMTP 5xx replies.
- TRANSIENT: timeouts, connection errors, ``OSError``, SQLAlchemy ``OperationalError``, Redis
  connection/timeouts, ``AlreadyInProgress``, ``LockNotAcquired`` and every other sekali error
  with ``permanent = False``.
- UNKNOWN: everything else, including ``KeyError``/``ValueError``/``TypeError`` raised by our own
  code. These are most often bugs: retried a little, then dead-lettered so a person looks at
  them. Bad *input* must be raised as :class:`resources.errors.ValidationError` at the boundary,
  which is permanent.
"""

from __future__ import annotations

import enum
import smtplib

import pydantic
import redis
from sqlalchemy import exc as sa_exc

from resources.errors import AlreadyInProgress, LockNotAcquired, NotYetSettled, SekaliError


class ErrorClass(enum.StrEnum):
    """Whether a retry may help: what the retry decision reads."""

    PERMANENT = "permanent"
    TRANSIENT = "transient"
    UNKNOWN = "unknown"


class FailureClass(enum.StrEnum):
    """Why it failed, as the DLQ reports it: the retry classes, with ``data_bug`` split out of
    ``unknown`` (our own code met data it did not expect: fix and deploy, then replay)."""

    PERMANENT = "permanent"
    TRANSIENT = "transient"
    DATA_BUG = "data_bug"
    UNKNOWN = "unknown"

    @classmethod
    def parse(cls, value: object) -> FailureClass:
        """A class stored or declared earlier; anything unrecognised is ``unknown``."""
        try:
            return cls(str(value))
        except ValueError:
            return cls.UNKNOWN


_TRANSIENT_TYPES: tuple[type[BaseException], ...] = (
    TimeoutError,
    ConnectionError,
    sa_exc.OperationalError,
    sa_exc.InterfaceError,
    sa_exc.DisconnectionError,
    redis.ConnectionError,
    redis.TimeoutError,
    OSError,
)


def classify(exc: BaseException) -> ErrorClass:
    """Say whether a retry may help. See the module docstring for the table."""
    if isinstance(exc, SekaliError):
        return ErrorClass.PERMANENT if exc.permanent else ErrorClass.TRANSIENT
    allow_retries = getattr(exc, "allow_retries", None)
    if isinstance(allow_retries, bool):
        return ErrorClass.UNKNOWN if allow_retries else ErrorClass.PERMANENT
    if isinstance(exc, smtplib.SMTPResponseException):
        return ErrorClass.PERMANENT if exc.smtp_code >= 500 else ErrorClass.TRANSIENT
    if isinstance(exc, smtplib.SMTPRecipientsRefused):
        codes = [code for code, _msg in exc.recipients.values()]
        return ErrorClass.PERMANENT if codes and min(codes) >= 500 else ErrorClass.TRANSIENT
    if isinstance(exc, pydantic.ValidationError):
        return ErrorClass.PERMANENT
    if isinstance(exc, _TRANSIENT_TYPES):
        return ErrorClass.TRANSIENT
    return ErrorClass.UNKNOWN


_DATA_BUG_TYPES: tuple[type[BaseException], ...] = (
    KeyError,
    TypeError,
    ValueError,
    AttributeError,
    IndexError,
    ZeroDivisionError,
    UnicodeError,
    AssertionError,
)


def failure_class(exc: BaseException) -> FailureClass:
    """The class a failure is recorded with (attempts, the request, the DLQ): :func:`classify`,
    with an unknown error that is one of Python's data errors (``KeyError``, ``ValueError``,
    ...) reported as ``data_bug``."""
    error_class = classify(exc)
    if error_class is ErrorClass.UNKNOWN and isinstance(exc, _DATA_BUG_TYPES):
        return FailureClass.DATA_BUG
    return FailureClass(str(error_class))


def is_contention(exc: BaseException) -> bool:
    """Waiting for another worker (a live lease, a held lock) or for an earlier call's outcome to
    settle says nothing about the downstream's health, so it spends no token of the downstream's
    retry budget."""
    return isinstance(exc, AlreadyInProgress | LockNotAcquired | NotYetSettled)
