"""An SMTP sink on loopback that records every message it accepts, so tests can count mails.

Built on aiosmtpd's ``Controller`` (a real SMTP server on its own thread). Each accepted message
becomes a row of ``mail_messages`` in the sink's own database (any SQLAlchemy URL, default a
SQLite file under the state folder): Message-ID, envelope sender and recipients, subject, time,
raw size. The sink records duplicates too: counting rows per Message-ID is how a test proves
"one mail per intent".

Recipients whose domain is in ``reject_domains`` (default ``reject.invalid``) are refused with
``550``, so the permanent-error path of a mailer can be exercised against a real server.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import threading
import time
from collections.abc import Iterable
from email.message import Message
from email.parser import BytesHeaderParser
from email.policy import compat32
from email.policy import default as default_policy
from typing import Any

from aiosmtpd.controller import Controller
from sqlalchemy import Column, Float, Integer, MetaData, Table, Text, insert, select

from resources.storage.db import make_engine
from resources.storage.settings import state_dir
from sandbox.redis_server import free_port

log = logging.getLogger(__name__)

READ_CHUNK = 500
"""Message-IDs per statement of :meth:`MailSink.messages_many` (under SQLite's bound on a
statement's parameters)."""

mailsink_metadata = MetaData()
mail_messages = Table(
    "mail_messages",
    mailsink_metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("message_id", Text),
    Column("mail_from", Text, nullable=False),
    Column("rcpt_tos", Text, nullable=False),
    Column("subject", Text),
    Column("correlation_id", Text),
    Column("received_at", Float, nullable=False),
    Column("size", Integer, nullable=False),
)

_RECORD = insert(mail_messages)


def _header(headers: Message, name: str) -> str | None:
    """A header's text as a reader sees it: an encoded word decoded, folding undone. Parsed with
    the compat32 classes (a fifth of the default policy's cost), and read through the default
    policy when the raw text may differ from what it reads (non-ASCII, an encoded word, a fold
    or a tab, a space in a Message-ID)."""
    raw = headers.get(name)
    if raw is None:
        return None
    raw = str(raw)
    if raw.isascii() and "=?" not in raw and not any(c in raw for c in "\t\r\n") \
            and (name.lower() != "message-id" or " " not in raw):
        return raw
    return str(default_policy.header_fetch_parse(name, raw))


class _Handler:
    def __init__(self, sink: MailSink) -> None:
        self.sink = sink

    async def handle_RCPT(  # noqa: N802 - aiosmtpd hook name
        self, server: Any, session: Any, envelope: Any, address: str, rcpt_options: list[str]
    ) -> str:
        domain = address.rpartition("@")[2].lower()
        if domain in self.sink.reject_domains:
            return f"550 5.1.1 <{address}>: recipient rejected by the sandbox"
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:  # noqa: N802
        raw: bytes = envelope.original_content or envelope.content
        headers = BytesHeaderParser(policy=compat32).parsebytes(raw)
        self.sink.record(
            message_id=_header(headers, "Message-ID"),
            mail_from=envelope.mail_from,
            rcpt_tos=list(envelope.rcpt_tos),
            subject=_header(headers, "Subject"),
            correlation_id=_header(headers, "X-Correlation-Id"),
            size=len(raw),
        )
        return "250 Message accepted for delivery"


class MailSink:
    """The sink in-process: ``start()`` serves on aiosmtpd's thread; ``messages()`` reads back."""

    def __init__(
        self,
        db_url: str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        reject_domains: tuple[str, ...] = ("reject.invalid",),
    ) -> None:
        if db_url is None:

            db_url = f"sqlite:///{state_dir() / 'mailsink.db'}"
        self.db_url = db_url
        self.host = host
        self.port = port or free_port()
        self.reject_domains = frozenset(d.lower() for d in reject_domains)
        self.engine = make_engine(db_url)
        mailsink_metadata.create_all(self.engine, checkfirst=True)
        self._controller: Controller | None = None
        self._lock = threading.Lock()

    def record(
        self,
        *,
        message_id: str | None,
        mail_from: str,
        rcpt_tos: list[str],
        subject: str | None,
        correlation_id: str | None,
        size: int,
    ) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                _RECORD,
                {
                    "message_id": str(message_id).strip() if message_id else None,
                    "mail_from": mail_from,
                    "rcpt_tos": json.dumps(rcpt_tos),
                    "subject": str(subject) if subject is not None else None,
                    # folding whitespace around an encoded value is not part of it
                    "correlation_id": str(correlation_id).strip() if correlation_id else None,
                    "received_at": time.time(),
                    "size": size,
                },
            )
        log.info("mail sink: %s to %s", message_id, rcpt_tos)

    def messages(self, message_id: str | None = None) -> list[dict[str, Any]]:
        query = select(mail_messages).order_by(mail_messages.c.id)
        if message_id is not None:
            query = query.where(mail_messages.c.message_id == message_id)
        with self.engine.connect() as conn:
            rows = conn.execute(query).all()
        out = []
        for row in rows:
            item = dict(row._mapping)
            item["rcpt_tos"] = json.loads(item["rcpt_tos"])
            out.append(item)
        return out

    def messages_many(self, message_ids: Iterable[str]) -> list[dict[str, Any]]:
        """The messages recorded under any of ``message_ids``, oldest first: one read per
        :data:`READ_CHUNK` ids (a batch's lookup)."""
        wanted = sorted(set(message_ids))
        out: list[dict[str, Any]] = []
        with self.engine.connect() as conn:
            for start in range(0, len(wanted), READ_CHUNK):
                chunk = wanted[start:start + READ_CHUNK]
                query = (select(mail_messages).where(mail_messages.c.message_id.in_(chunk))
                         .order_by(mail_messages.c.id))
                out += [{**row._mapping, "rcpt_tos": json.loads(row.rcpt_tos)}
                        for row in conn.execute(query).all()]
        return sorted(out, key=lambda m: int(m["id"]))

    def reset(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(mail_messages.delete())

    def start(self) -> MailSink:
        self._controller = Controller(_Handler(self), hostname=self.host, port=self.port)
        self._controller.start()
        log.info("mail sink on %s:%d (db %s)", self.host, self.port, self.db_url)
        return self

    def stop(self) -> None:
        if self._controller is not None:
            self._controller.stop()
            self._controller = None
        self.engine.dispose()

    def __enter__(self) -> MailSink:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="sekali sandbox SMTP sink")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8025)
    parser.add_argument("--db-url", default=None, help="SQLAlchemy URL (default: state folder)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    sink = MailSink(args.db_url, host=args.host, port=args.port).start()
    print(f"sandbox mail sink listening on {args.host}:{sink.port}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        threading.Event().wait()
    sink.stop()


if __name__ == "__main__":
    main()
