"""The mail downstream as sekali sees it: a ``Mailer`` interface, an SMTP client, its errors.

SMTP has no idempotency key, so sekali derives the RFC 5322 ``Message-ID`` from the job's
idempotency key (:func:`message_id_for`): a retry of the same intent sends a message with the same
Message-ID, which receivers and the sandbox sink can deduplicate and tests can count.

Error mapping (one place): connection refused/reset, timeouts, disconnects and 4xx replies ->
:class:`MailUnavailable` (transient); 5xx replies (recipient or sender refused, message refused)
-> :class:`MailRejected` (permanent). Their messages never carry the recipient's address (it is
personal data, and the messages travel into run logs and the DLQ); ``MailRejected.recipient``
holds it for code that needs it.

Headers: every header value is checked where the message is built (:meth:`SmtpMailer.build`): a
control character (CR, LF...) is refused naming the field (it would end the headers early), a
value outside ASCII is written as an RFC 2047 encoded word, and the recipient is one address
(:func:`single_address`) given to the SMTP client explicitly, never read back from the ``To``
header (where a comma would make it several).

Bounds: each socket operation waits at most ``timeout`` (10 s), and a whole send (connect,
greeting, envelope, data, quit) at most ``deadline`` (30 s): per-read timeouts alone never end a
send to a server that drips one byte at a time. When the deadline passes, the socket is shut
down from a timer thread, which wakes the blocked read; the send raises :class:`MailUnavailable`.
A send cut at its deadline may still have been accepted by the server: the retry sends the same
Message-ID, which receivers (and the sandbox sink) deduplicate.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import smtplib
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from email.header import Header
from email.message import Message
from email.mime.text import MIMEText
from email.utils import formatdate
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from engine import ClientOptions, Downstream, Effect, Sandbox
from resources.errors import (
    PermanentJobError,
    SendDeadlinePassed,
    TransientJobError,
    ValidationError,
)
from resources.headers import refuse_control
from resources.send_bound import late_by, within
from resources.storage.settings import DEFAULT_SMTP_CONNECTIONS, Settings
from resources.telemetry.redact import redact
from sandbox.mailsink import MailSink

log = logging.getLogger(__name__)


class MailUnavailable(TransientJobError):
    """The mail server could not take the message now (unreachable, timeout, 4xx). Retry."""

    def __init__(self, message: str, *, smtp_code: int | None = None) -> None:
        super().__init__(message)
        self.smtp_code = smtp_code


class MailRejected(PermanentJobError):
    """The mail server refused the message for good (5xx). Fix the address or content, replay."""

    def __init__(self, message: str, *, smtp_code: int, recipient: str | None = None) -> None:
        super().__init__(message)
        self.smtp_code = smtp_code
        self.recipient = recipient


MAX_ADDRESS = 254  # RFC 5321: a path of 256 octets, less the angle brackets
MAX_LOCAL_PART = 64
_ATOM = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
_LOCAL_PART = re.compile(rf"{_ATOM}(?:\.{_ATOM})*")
_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def single_address(field: str, value: object) -> str:
    """Exactly one RFC 5322 address in its plain form, ``local@domain``: a dot-atom local part
    of at most 64 characters, a domain of dot-separated labels (letters, digits, inner hyphens;
    an international domain in its punycode form), at most 254 characters in all. Anything
    else (a second address after a comma, a display name, a quoted local part, a control
    character) raises :class:`ValidationError` naming ``field``, without quoting the address
    (personal data). The length is checked before any pattern runs, and the patterns cannot
    backtrack (each repetition starts with a character the one before cannot hold): the cost
    is linear in the length and bounded by 254."""
    what = (f"must be one e-mail address, local@domain (ASCII; at most {MAX_ADDRESS} "
            "characters; no display name, no second address)")
    if not isinstance(value, str):
        raise ValidationError(field, what)
    if len(value) > MAX_ADDRESS:
        raise ValidationError(field, f"{what}: got {len(value)} characters",
                              limit=f"address_length={MAX_ADDRESS}")
    local, at, domain = value.rpartition("@")
    labels = domain.split(".")
    if (
        not at
        or len(local) > MAX_LOCAL_PART
        or not _LOCAL_PART.fullmatch(local)
        or len(labels) < 2
        or not all(_LABEL.fullmatch(label) for label in labels)
    ):
        raise ValidationError(field, what)
    return value


def message_id_for(key: str) -> str:
    """A stable RFC 5322 Message-ID for an idempotency key: ``<sha256(key)[:32]@sekali>``."""
    return f"<{hashlib.sha256(key.encode()).hexdigest()[:32]}@sekali>"


def _cut(smtp: smtplib.SMTP, cut: threading.Event) -> None:
    """The deadline passed: shut the socket down, which wakes a read blocked on it."""
    cut.set()
    sock = getattr(smtp, "sock", None)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


class _BoundedSMTP(smtplib.SMTP):
    """``smtplib``'s client that writes nothing once its send bound has passed: every command and
    the message data check the bound right before they go out (:meth:`send`, which all of
    smtplib's writes go through; :func:`resources.send_bound.within`). A sender paused part-way
    through an exchange, or held up by a slow reply, so finishes no message after its bound.
    ``wrote``: a byte of the current message went out."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._what = ""
        self._send_by: float | None = None
        self.wrote = False

    def bound(self, what: str, send_by: float | None) -> None:
        """Check every write against ``send_by`` (monotonic; None: no bound) from now."""
        self._what, self._send_by, self.wrote = what, send_by, False

    def send(self, s: bytes | str) -> None:  # type: ignore[override]
        try:
            with within(self._send_by, self._what):
                self.wrote = True
                super().send(s)
        except SendDeadlinePassed:
            if self.wrote:  # cut part-way: the relay drops the exchange with the connection
                self.close()
            raise

    def _rset(self) -> None:
        """The RSET smtplib sends after a refusal (of the sender, every recipient, or the
        data), before it raises the refusal: past the bound, the connection is closed instead
        (which ends the transaction as well), so the refusal, not the bound, is what the caller
        learns."""
        if late_by(self._send_by) is not None:
            self.close()
            return
        super()._rset()  # type: ignore[misc]  # smtplib's own, not in its stubs


class _Cutter:
    """The deadline of each send of one session, kept by one thread for the whole session.

    ``arm`` before a send, ``disarm`` after it: a send still running when its deadline passes has
    its socket shut down (:func:`_cut`), which wakes the read blocked on it. A thread per send
    (``threading.Timer``) cost more than the send itself on a busy machine: starting one waits
    for the new thread to be scheduled. The thread starts on the first ``arm`` and ends with
    :meth:`close`.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._armed: tuple[float, smtplib.SMTP, threading.Event] | None = None
        self._closed = False
        self._thread: threading.Thread | None = None
        self._until: float | None = None  # when the thread wakes next (None: when notified)

    def arm(self, seconds: float, smtp: smtplib.SMTP, cut: threading.Event) -> None:
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="smtp-deadline", daemon=True
                )
                self._thread.start()
            at = time.monotonic() + seconds
            self._armed = (at, smtp, cut)
            if self._until is None or at < self._until:  # else it wakes in time on its own
                self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._armed = None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._armed = None
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                if self._armed is None:
                    self._until = None
                    self._cond.wait()
                    continue
                at, smtp, cut = self._armed
                left = at - time.monotonic()
                if left > 0:
                    self._until = at
                    self._cond.wait(left)
                    continue
                self._armed = None
                _cut(smtp, cut)


def _header(field: str, value: str) -> str:
    """A header value: a control character refused naming ``field``; non-ASCII as an RFC 2047
    encoded word (smtplib sends headers as ASCII)."""
    refuse_control(field, value)
    return value if value.isascii() else Header(value, "utf-8").encode()


def _text(reply: bytes | str) -> str:
    return reply.decode(errors="replace") if isinstance(reply, bytes) else str(reply)


@runtime_checkable
class Mailer(Protocol):
    """What a job type needs from a mail service."""

    def send(
        self,
        *,
        to: str,
        subject: str,
        body: str,
        message_id: str,
        correlation_id: str | None = None,
        send_by: float | None = None,
    ) -> None:
        """Send once; with ``send_by`` (``time.monotonic()`` scale), raise
        :class:`SendDeadlinePassed` instead of handing the message over once it has passed."""
        ...


class SmtpMailer:
    """:class:`Mailer` over SMTP with ``smtplib``: one connection per message (thread-safe), or
    one per :meth:`session` for a batch.

    ``timeout`` bounds each socket operation, ``deadline`` each whole send (see the module).
    ``connections``: how many sessions a batch of mails may hold at once
    (``SEKALI_SMTP_CONNECTIONS``, default 4; ``send_email``'s batch hook sends on that many
    lanes): a relay that limits connections per client is given at most that many.
    """

    def __init__(
        self,
        host: str,
        port: int,
        sender: str = "sekali@localhost",
        timeout: float = 10,
        deadline: float = 30,
        log_url: str | None = None,
        connections: int = DEFAULT_SMTP_CONNECTIONS,
    ) -> None:
        if timeout <= 0 or deadline <= 0:
            raise ValueError("SMTP timeout and deadline must be positive")
        if connections < 1:
            raise ValueError("SMTP connections must be at least 1")
        self.host = host
        self.port = port
        self.sender = sender
        self.timeout = timeout
        self.deadline = deadline
        self.log_url = log_url
        self.connections = connections
        self._log: MailSink | None = None

    def find_messages(self, message_id: str) -> list[dict[str, Any]]:
        """The messages the provider accepted under ``message_id`` (SMTP itself cannot be
        asked: this reads the provider's record, ``log_url``). Raises :class:`MailUnavailable`
        when there is no record to read."""
        return self._record().messages(message_id)

    def find_messages_many(self, message_ids: Sequence[str]) -> list[dict[str, Any]]:
        """:meth:`find_messages` for several Message-IDs in one read of the provider's record
        (a batch's lookup before its sends), oldest first."""
        return self._record().messages_many(message_ids)

    def _record(self) -> MailSink:
        if self.log_url is None:
            raise MailUnavailable(
                "the mail provider's record cannot be searched: set SEKALI_SMTP_LOG_URL "
                "(the sandbox sink's database) to look mails up by Message-ID"
            )
        if self._log is None:
            self._log = MailSink(self.log_url)
        return self._log

    def build(
        self, *, to: str, subject: str, body: str, message_id: str, correlation_id: str | None
    ) -> Message:
        """A text/plain message. Built with the compat32 classes: about thirty times cheaper to
        build and serialise than ``EmailMessage`` (which dominated a mail's cost in a batch);
        non-ASCII text is encoded (utf-8 body, RFC 2047 subject)."""
        msg = MIMEText(body, "plain", "us-ascii" if body.isascii() else "utf-8")
        msg["From"] = self.sender
        msg["To"] = single_address("to", to)
        msg["Subject"] = _header("subject", subject)
        msg["Date"] = formatdate(localtime=False)
        msg["Message-ID"] = _header("message_id", message_id)
        if correlation_id is not None:
            msg["X-Correlation-Id"] = _header("correlation_id", correlation_id)
        return msg

    def send(
        self,
        *,
        to: str,
        subject: str,
        body: str,
        message_id: str,
        correlation_id: str | None = None,
        send_by: float | None = None,
    ) -> None:
        with self.session() as session:
            session.send(
                to=to, subject=subject, body=body, message_id=message_id,
                correlation_id=correlation_id, send_by=send_by,
            )

    @contextlib.contextmanager
    def session(self) -> Iterator[SmtpSession]:
        """One SMTP connection for several messages (a micro-batch): the connect, greeting and
        QUIT are paid once. Not thread-safe; a broken connection is reopened for the next one.
        Each send keeps its own deadline."""
        session = SmtpSession(self)
        try:
            yield session
        finally:
            session.close()


class SmtpSession:
    """:class:`Mailer` over one SMTP connection, opened on the first message."""

    def __init__(self, mailer: SmtpMailer) -> None:
        self.mailer = mailer
        self._smtp: _BoundedSMTP | None = None
        self._cutter = _Cutter()

    def send(
        self,
        *,
        to: str,
        subject: str,
        body: str,
        message_id: str,
        correlation_id: str | None = None,
        send_by: float | None = None,
    ) -> None:
        """Send one message on this session's connection. ``send_by`` is checked after the
        connection is up and right before each write of the exchange (the envelope, the DATA
        command, the message with its final dot): once it has passed, :class:`SendDeadlinePassed`
        and no byte more leaves. Refused before the envelope, nothing of this message was sent;
        refused part-way (the sender was paused, or the relay slow, after MAIL FROM), the
        connection is closed with the message unfinished, which the relay drops."""
        m = self.mailer
        msg = m.build(
            to=to, subject=subject, body=body, message_id=message_id, correlation_id=correlation_id
        )
        smtp = self._smtp or _BoundedSMTP(timeout=min(m.timeout, m.deadline))  # connects below
        cut = threading.Event()
        self._cutter.arm(m.deadline, smtp, cut)
        try:
            if self._smtp is None:
                smtp.connect(m.host, m.port)
                self._smtp = smtp
            smtp.bound(f"mail {message_id}", send_by)
            smtp.send_message(msg, from_addr=m.sender, to_addrs=[to])  # never from the headers
        except smtplib.SMTPRecipientsRefused as exc:
            code, reply = next(iter(exc.recipients.values()))
            text = redact(_text(reply), [to])
            if code >= 500:
                raise MailRejected(
                    f"mail server refused the recipient: {code} {text}", smtp_code=code,
                    recipient=to,
                ) from exc
            raise MailUnavailable(
                f"mail server deferred the recipient: {code} {text}", smtp_code=code
            ) from exc
        except smtplib.SMTPResponseException as exc:
            text = redact(_text(exc.smtp_error), [to])
            if exc.smtp_code >= 500:
                raise MailRejected(
                    f"mail server refused the message: {exc.smtp_code} {text}",
                    smtp_code=exc.smtp_code,
                    recipient=to,
                ) from exc
            raise MailUnavailable(
                f"mail server deferred the message: {exc.smtp_code} {text}", smtp_code=exc.smtp_code
            ) from exc
        except (smtplib.SMTPException, OSError) as exc:
            self._drop(smtp)
            if cut.is_set():
                raise MailUnavailable(
                    f"mail server at {m.host}:{m.port} gave no complete answer within "
                    f"the {m.deadline}s deadline; retry later (the same Message-ID)"
                ) from exc
            raise MailUnavailable(f"mail server at {m.host}:{m.port} unavailable: {exc!r}") from exc
        finally:
            smtp.bound("", None)
            self._cutter.disarm()
            if smtp.sock is None:  # closed under it (a 421, a write or RSET past the bound)
                self._drop(smtp)
        log.info(
            "sent %s",
            message_id,
            extra={"message_id": message_id, "correlation_id": correlation_id},
        )

    def close(self) -> None:
        if self._smtp is not None:
            cut = threading.Event()
            self._cutter.arm(self.mailer.deadline, self._smtp, cut)  # QUIT has a deadline too
            with contextlib.suppress(smtplib.SMTPException, OSError):
                self._smtp.quit()
            if self._smtp is not None:
                self._drop(self._smtp)
        self._cutter.close()

    def _drop(self, smtp: smtplib.SMTP) -> None:
        with contextlib.suppress(OSError):
            smtp.close()
        if self._smtp is smtp:
            self._smtp = None


def mail_session(mailer: Mailer) -> AbstractContextManager[Mailer]:
    """One connection for a batch of messages when the mailer can hold one, else the mailer."""
    if isinstance(mailer, SmtpMailer):
        return mailer.session()
    return contextlib.nullcontext(mailer)


def _client(settings: Settings, options: ClientOptions) -> SmtpMailer:
    host, port = settings.smtp_host, settings.smtp_port
    if options.address:
        host, _, given = options.address.rpartition(":")
        port = int(given)
    return SmtpMailer(
        host, port, sender=str(options.extra.get("sender", "sekali@localhost")),
        timeout=options.timeout or 10.0, deadline=options.deadline or 30.0,
        log_url=str(options.extra.get("log_url") or settings.smtp_log_url or "") or None,
        connections=int(options.extra.get("connections") or settings.smtp_connections),
    )


def _address(settings: Settings) -> tuple[str, int, str]:
    return settings.smtp_host, settings.smtp_port, "SEKALI_SMTP_PORT"


def _start_sandbox(settings: Settings, state: Path) -> MailSink:
    return MailSink(
        f"sqlite:///{state / 'mailsink.db'}", host=settings.smtp_host, port=settings.smtp_port
    ).start()


def _recorded_mails(sink: MailSink, key: str, payload: Any) -> list[Effect]:
    """Every message the sandbox sink accepted under the intent's Message-ID, resends of the
    same Message-ID included, with the time it accepted each."""
    message_id = message_id_for(key)
    return [Effect(message_id, float(m["received_at"]), {"id": m["id"]})
            for m in sink.messages(message_id)]


SMTP = Downstream(
    name="smtp",
    build=_client,
    description="The SMTP relay (SEKALI_SMTP_HOST, SEKALI_SMTP_PORT).",
    calls=("send", "find_messages", "find_messages_many"),
    sandbox=Sandbox("sandbox mail sink", _address, _start_sandbox,
                    environment=lambda state: {"SEKALI_SMTP_LOG_URL":
                                               f"sqlite:///{state / 'mailsink.db'}"},
                    record=_recorded_mails),
)
"""The mail downstream: ``ctx.client("smtp")`` is a :class:`Mailer`; ``SEKALI_RATE_SMTP``
paces its sends; its retry budget is ``smtp``."""


__all__ = [
    "SMTP",
    "MailRejected",
    "MailUnavailable",
    "Mailer",
    "SmtpMailer",
    "SmtpSession",
    "mail_session",
    "message_id_for",
    "single_address",
]
