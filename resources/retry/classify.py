"""One classifier for every failure: does a retry have a chance to help?

Retries (:class:`resources.retry.RetryPolicy`) and the dead letter queue both ask this one
function, with the exception object itself, so a failure is never classified twice in two ways.

- PERMANENT: sekali errors with ``permanent = True`` (validation, conflicts, rejected by a
  downstream), pydantic validation errors, errors that say themselves no retry may help
  (``allow_retries = False``, as Dagster's ``Failure`` does), SMTP 5xx replies.
- TRANSIENT: timeouts, connection errors, ``OSError``, Redis connection/timeouts,
  ``AlreadyInProgress``, ``LockNotAcquired`` and every other sekali error with
  ``permanent = False``.
- Database errors by what they mean, on both dialects (:func:`database_error_class`): bad data
  or a wrong schema is PERMANENT (a retry sends the same bytes to the same schema): SQLAlchemy
  ``DataError``, ``IntegrityError`` and ``ProgrammingError``, Postgres SQLSTATE classes 22 (data
  exception: NUL in text, value too long, out of range), 23 (constraint), 42 (undefined table or
  column, syntax) and 54 (program limit: an index row too large), SQLite's "no such
  table/column", constraint, mismatch and "too big". Only the connection level is TRANSIENT:
  refused, terminated, timed out, canceled, locked (SQLSTATE 08, 40, 53, 55P03, 57, 58;
  SQLite busy, locked, I/O, cannot open), and any other ``OperationalError``.
- UNKNOWN: everything else, including ``KeyError``/``ValueError``/``TypeError`` raised by our own
  code. These are most often bugs: retried a little, then dead-lettered so a person looks at
  them. Bad *input* must be raised as :class:`resources.errors.ValidationError` at the boundary,
  which is permanent.
"""

from __future__ import annotations

import enum
import smtplib
import sqlite3

import pydantic
import redis
from sqlalchemy import exc as sa_exc

from resources.errors import (
    AlreadyInProgress,
    LimitNotAcquired,
    LockNotAcquired,
    NotYetSettled,
    RateLimited,
    SekaliError,
)


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


# SQLSTATE classes (the first two characters) of Postgres errors.
_PERMANENT_SQLSTATE = frozenset({"22", "23", "42", "54"})
_TRANSIENT_SQLSTATE = frozenset({"08", "40", "53", "57", "58"})
_TRANSIENT_SQLSTATE_CODES = frozenset({"55P03", "55006"})  # lock not available, object in use

# SQLite primary result codes (``sqlite_errorcode & 0xFF``).
_SQLITE_PERMANENT = frozenset(
    {
        sqlite3.SQLITE_ERROR,  # no such table/column, syntax error
        sqlite3.SQLITE_TOOBIG,
        sqlite3.SQLITE_CONSTRAINT,
        sqlite3.SQLITE_MISMATCH,
        sqlite3.SQLITE_RANGE,
    }
)
_SQLITE_TRANSIENT = frozenset(
    {
        sqlite3.SQLITE_BUSY,
        sqlite3.SQLITE_LOCKED,
        sqlite3.SQLITE_IOERR,
        sqlite3.SQLITE_CANTOPEN,
        sqlite3.SQLITE_NOMEM,
        sqlite3.SQLITE_PROTOCOL,
        sqlite3.SQLITE_INTERRUPT,
        sqlite3.SQLITE_FULL,
    }
)


def database_error_class(exc: sa_exc.DBAPIError) -> ErrorClass:
    """A driver error by what it means, the same on SQLite and Postgres (module docstring)."""
    if exc.connection_invalidated:
        return ErrorClass.TRANSIENT
    orig = exc.orig
    sqlstate = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    if isinstance(sqlstate, str) and len(sqlstate) == 5:
        if sqlstate in _TRANSIENT_SQLSTATE_CODES or sqlstate[:2] in _TRANSIENT_SQLSTATE:
            return ErrorClass.TRANSIENT
        if sqlstate[:2] in _PERMANENT_SQLSTATE:
            return ErrorClass.PERMANENT
    code = getattr(orig, "sqlite_errorcode", None)
    if isinstance(orig, sqlite3.Error) and isinstance(code, int):
        if (code & 0xFF) in _SQLITE_PERMANENT:
            return ErrorClass.PERMANENT
        if (code & 0xFF) in _SQLITE_TRANSIENT:
            return ErrorClass.TRANSIENT
    if isinstance(exc, sa_exc.DataError | sa_exc.IntegrityError | sa_exc.ProgrammingError):
        return ErrorClass.PERMANENT
    if isinstance(exc, sa_exc.OperationalError | sa_exc.InterfaceError):
        return ErrorClass.TRANSIENT
    return ErrorClass.UNKNOWN


def classify(exc: BaseException) -> ErrorClass:
    """Say whether a retry may help. See the module docstring for the table."""
    if isinstance(exc, SekaliError):
        return ErrorClass.PERMANENT if exc.permanent else ErrorClass.TRANSIENT
    if isinstance(exc, sa_exc.DBAPIError):
        return database_error_class(exc)
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
    """Waiting for another worker (a live lease, a held lock, a full concurrency limit), for our
    own shared rate, or for an earlier call's outcome to settle says nothing about the
    downstream's health, so it spends no token of the downstream's retry budget."""
    return isinstance(
        exc, AlreadyInProgress | LockNotAcquired | LimitNotAcquired | RateLimited | NotYetSettled
    )
