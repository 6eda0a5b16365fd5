"""One classifier for every failure: does a retry have a chance to help?

Retries (:class:`resources.retry.RetryPolicy`) and the dead letter queue both ask this one
function, with the exception object itself, so a failure is never classified twice in two ways.

- PERMANENT: sekali errors with ``permanent = True`` (validation, conflicts, rejected by a
  downstream), pydantic validation errors, errors that say themselves no retry may help
  (``allow_retries = False``, as Dagster's ``Failure`` does), SMTP 5xx replies.
- TRANSIENT: timeouts, connection errors, ``OSError``, Redis connection/timeouts,
  ``AlreadyInProgress``, ``LockNotAcquired`` and every other sekali error with
  ``permanent = False``.
- Database errors by what they mean, on both dialects, raw from the driver or wrapped by
  SQLAlchemy (:func:`database_error_class`): bad data or a wrong schema is PERMANENT (a retry
  sends the same bytes to the same schema): ``DataError``, ``IntegrityError`` and
  ``ProgrammingError``, Postgres SQLSTATE classes 22 (data exception: NUL in text, value too
  long, out of range), 23 (constraint), 42 (undefined table or column, syntax) and 54 (program
  limit: an index row too large), SQLite's "no such table/column", constraint, mismatch and
  "too big". The connection and the store's state are TRANSIENT: refused, terminated, timed
  out, canceled, locked, disk full, read-only, I/O (SQLSTATE 08, 25006, 40, 53, 55P03, 57, 58;
  SQLite busy, locked, full, read-only, I/O, cannot open), and any other ``OperationalError``.
  :mod:`resources.storage.driver` turns the store's state into :class:`StoreFull`,
  :class:`StoreReadOnly` or :class:`StoreUnavailable` with what to do.
- Redis errors (:func:`redis_error_class`): TRANSIENT when the server or the cluster is not
  ready for this command now: connection and timeout, ``OOM`` (``maxmemory`` reached under
  ``noeviction``), ``READONLY`` (a replica), ``MASTERDOWN``, ``LOADING``, ``BUSY``,
  ``CLUSTERDOWN``, ``TRYAGAIN``, a ``MOVED``/``ASK`` redirection the client did not follow, and
  the cluster client's own errors; also when one of those comes back from inside a script.
  ``CROSSSLOT`` is PERMANENT (the keys' layout, not the moment: a retry sends the same keys);
  any other reply error (``WRONGTYPE``, a script's own error) is UNKNOWN.
- UNKNOWN: everything else, including ``KeyError``/``ValueError``/``TypeError`` raised by our own
  code. These are most often bugs: retried a little, then dead-lettered so a person looks at
  them. Bad *input* must be raised as :class:`resources.errors.ValidationError` at the boundary,
  which is permanent.
- CRASH_LOOP (a DLQ class, permanent for the retry decision): :class:`resources.errors.CrashLoop`,
  a key whose worker died mid-run more than the crash-loop limit.
- TIMED_OUT (a DLQ class, permanent for the retry decision when the handler ran alone):
  :class:`resources.errors.HandlerTimedOut`, a handler abandoned at its job type's
  ``max_runtime_seconds``.
"""

from __future__ import annotations

import enum
import smtplib
import sqlite3

import pydantic
import redis
from redis import exceptions as redis_exc
from sqlalchemy import exc as sa_exc

from resources.errors import (
    AlreadyInProgress,
    CrashLoop,
    HandlerTimedOut,
    LimitNotAcquired,
    LockNotAcquired,
    NotYetSettled,
    RateLimited,
    SekaliError,
    StoredFailure,
)
from resources.storage.redis import reply_code


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
    CRASH_LOOP = "crash_loop"
    """Permanent: the key's worker died mid-run more than the crash-loop limit allows
    (:class:`resources.errors.CrashLoop`). Read the dead runs' logs, fix, then replay."""
    TIMED_OUT = "timed_out"
    """The handler ran past its job type's ``max_runtime_seconds`` and was abandoned
    (:class:`resources.errors.HandlerTimedOut`): a downstream that never answered, a client
    without a timeout. Fix that, then replay (the replay takes the key over)."""

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
    OSError,
)


# SQLSTATE classes (the first two characters) of Postgres errors.
_PERMANENT_SQLSTATE = frozenset({"22", "23", "42", "54"})
_TRANSIENT_SQLSTATE = frozenset({"08", "40", "53", "57", "58"})
# lock not available, object in use, a read-only transaction (a standby, a failover under way)
_TRANSIENT_SQLSTATE_CODES = frozenset({"55P03", "55006", "25006"})

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
        sqlite3.SQLITE_READONLY,
    }
)


def database_error_class(exc: BaseException) -> ErrorClass:
    """A driver error by what it means, the same on SQLite and Postgres, raw from the driver or
    wrapped by SQLAlchemy (module docstring)."""
    if isinstance(exc, sa_exc.DBAPIError):
        if exc.connection_invalidated:
            return ErrorClass.TRANSIENT
        orig: BaseException = exc.orig or exc
    else:
        orig = exc
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
    kinds = {kind.__name__ for kind in type(exc).__mro__} | {
        kind.__name__ for kind in type(orig).__mro__
    }  # PEP 249 names every driver's classes alike
    if kinds & {"DataError", "IntegrityError", "ProgrammingError"}:
        return ErrorClass.PERMANENT
    if kinds & {"OperationalError", "InterfaceError"}:
        return ErrorClass.TRANSIENT
    return ErrorClass.UNKNOWN


def is_database_error(exc: BaseException) -> bool:
    """A driver's error (PEP 249 ``Error``, raw or wrapped by SQLAlchemy)."""
    if isinstance(exc, sa_exc.DBAPIError | sqlite3.Error):
        return True
    return isinstance(getattr(exc, "sqlstate", None), str) or any(
        kind.__name__ == "Error" and kind.__module__.startswith(("psycopg", "psycopg2"))
        for kind in type(exc).__mro__
    )


_REDIS_TRANSIENT_TYPES: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis_exc.OutOfMemoryError,
    redis_exc.ReadOnlyError,
    redis_exc.ClusterDownError,  # MASTERDOWN too
    redis_exc.TryAgainError,
    redis_exc.AskError,  # MOVED too
    redis_exc.NoScriptError,
    redis_exc.ClusterError,
    redis_exc.RedisClusterException,  # a slot not covered, no node answering
)


def redis_error_class(exc: BaseException) -> ErrorClass:
    """A Redis error by what it means (module docstring)."""
    if isinstance(exc, redis_exc.ClusterCrossSlotError):
        return ErrorClass.PERMANENT
    if isinstance(exc, _REDIS_TRANSIENT_TYPES):
        return ErrorClass.TRANSIENT
    if isinstance(exc, redis.ResponseError) and reply_code(exc) is not None:
        return ErrorClass.TRANSIENT
    return ErrorClass.UNKNOWN


def classify(exc: BaseException) -> ErrorClass:
    """Say whether a retry may help. See the module docstring for the table."""
    if isinstance(exc, SekaliError):
        return ErrorClass.PERMANENT if exc.permanent else ErrorClass.TRANSIENT
    if is_database_error(exc):
        return database_error_class(exc)
    if isinstance(exc, redis.RedisError | redis_exc.RedisClusterException):
        return redis_error_class(exc)
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
    ...) reported as ``data_bug``. A key's stored failure keeps the class of the failure that
    was stored: a crash loop whose dead letter was not written when it was decided (the
    database away) is written by the next delivery, still as ``crash_loop``."""
    if isinstance(exc, CrashLoop) or (
        isinstance(exc, StoredFailure) and exc.error_class == CrashLoop.__name__
    ):
        return FailureClass.CRASH_LOOP
    if isinstance(exc, HandlerTimedOut):
        return FailureClass.TIMED_OUT
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
