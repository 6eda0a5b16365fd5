"""The SMTP sink and the SMTP mailer, over real SMTP on loopback.

The sink counts mails for the ``send_email`` tests, so it must record each message with the
Message-ID the mailer derived from the idempotency key, and the mailer must classify a refused
recipient as permanent and a missing server as transient.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import smtplib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from email.parser import BytesParser
from email.policy import default as default_policy
from pathlib import Path

import pytest

from pipelines.domain.mail import Mailer, MailRejected, MailUnavailable, SmtpMailer, message_id_for
from pipelines.profile import DownstreamResource
from resources.errors import SendDeadlinePassed, ValidationError
from resources.retry import ErrorClass, classify
from resources.storage.settings import Settings
from sandbox.mailsink import MailSink
from sandbox.redis_server import free_port
from tests.relays import SlowRelay


def test_message_id_is_stable_and_rfc5322_shaped() -> None:
    a = message_id_for("email:welcome:42:2026-11-29")
    assert a == message_id_for("email:welcome:42:2026-11-29")
    assert a != message_id_for("email:welcome:43:2026-11-29")
    assert re.fullmatch(r"<[0-9a-f]{32}@sekali>", a)


def test_sink_records_message_with_its_message_id(sink: MailSink) -> None:
    mailer: Mailer = SmtpMailer("127.0.0.1", sink.port, sender="shop@example.com")
    mid = message_id_for("email:welcome:42:2026-11-29")
    mailer.send(to="ann@example.com", subject="Welcome", body="hello Ann", message_id=mid,
                correlation_id="corr-1")
    [msg] = sink.messages()
    assert msg["message_id"] == mid
    assert msg["mail_from"] == "shop@example.com"
    assert msg["rcpt_tos"] == ["ann@example.com"]
    assert msg["subject"] == "Welcome"
    assert msg["correlation_id"] == "corr-1"
    assert msg["size"] > len("hello Ann")
    assert msg["received_at"] > 0


def test_non_ascii_subject_and_body_arrive_intact_and_a_session_sends_several(
    sink: MailSink,
) -> None:
    """Catches a cheaper message builder that mangles non-ASCII text, and a session (one SMTP
    connection for a micro-batch) that drops or merges messages."""
    mailer = SmtpMailer("127.0.0.1", sink.port)
    with mailer.session() as session:
        for i in range(3):
            session.send(to=f"z{i}@example.com", subject=f"Wélcome, Zoë {i}",
                         body="Grüße, Zoë\n", message_id=message_id_for(f"k{i}"))
    messages = sink.messages()
    assert [m["subject"] for m in messages] == [f"Wélcome, Zoë {i}" for i in range(3)]
    assert [m["message_id"] for m in messages] == [message_id_for(f"k{i}") for i in range(3)]
    raw = mailer.build(to="z@example.com", subject="s", body="Grüße", message_id="<m@x>",
                       correlation_id=None).as_bytes()
    assert b"charset=\"utf-8\"" in raw


def test_the_sink_records_each_header_as_a_reader_of_the_message_reads_it(
    sink: MailSink,
) -> None:
    """Catches a cheaper header parse in the sink that keeps a fold, an encoded word, a tab or
    a commented Message-ID as raw text: whatever the sender wrote, each recorded header is what
    the standard library's default policy reads from the same bytes."""
    raws = [
        b"Message-ID: <a@x>\r\nSubject: one\r\n two\tthree\r\nX-Correlation-Id:  c1 \r\n\r\nb",
        b"Message-ID:\r\n <b@x>\r\nSubject: =?utf-8?b?w6TDtg==?= and plain\r\n\r\nb",
        b"Message-ID: <c@x> (a comment)\r\nSubject: two  spaces ok \r\n\r\nb",
        b"Message-ID: <d@x>\r\nSubject: =?utf-8?q?Gr=C3=BC=C3=9Fe?=\r\nX-Correlation-Id: "
        b"=?utf-8?q?k=C3=B6ln?=\r\n\r\nb",
    ]
    with smtplib.SMTP("127.0.0.1", sink.port, timeout=10) as smtp:
        for raw in raws:
            smtp.sendmail("s@example.com", ["r@example.com"], raw)
    recorded = sink.messages()
    assert len(recorded) == len(raws)
    for raw, row in zip(raws, recorded, strict=True):
        reader = BytesParser(policy=default_policy).parsebytes(raw, headersonly=True)
        for header, column, strip in (("Message-ID", "message_id", True),
                                      ("Subject", "subject", False),
                                      ("X-Correlation-Id", "correlation_id", True)):
            read = None if reader.get(header) is None else str(reader.get(header))
            expected = read.strip() if read is not None and strip else read
            assert row[column] == expected, (raw, header)
    assert [r["subject"] for r in recorded] == [
        "one two\tthree", "äö and plain", "two  spaces ok ", "Grüße"]


def test_sink_counts_duplicates_per_message_id(sink: MailSink) -> None:
    """The sink records every delivery, so a duplicate send is visible as a second row."""
    mailer = SmtpMailer("127.0.0.1", sink.port)
    mid = message_id_for("email:reset:7:2026-11-29")
    for _ in range(2):
        mailer.send(to="bob@example.com", subject="Reset", body="x", message_id=mid)
    mailer.send(to="bob@example.com", subject="Other", body="x", message_id=message_id_for("o"))
    assert len(sink.messages(mid)) == 2
    assert len(sink.messages()) == 3


def test_concurrent_senders_all_recorded(sink: MailSink) -> None:
    mailer = SmtpMailer("127.0.0.1", sink.port)

    def send(i: int) -> None:
        mailer.send(to=f"u{i}@example.com", subject=f"s{i}", body="b",
                    message_id=message_id_for(f"k{i}"))

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(send, range(40)))
    ids = {m["message_id"] for m in sink.messages()}
    assert ids == {message_id_for(f"k{i}") for i in range(40)}


def test_refused_recipient_is_permanent_and_not_recorded(sink: MailSink) -> None:
    mailer = SmtpMailer("127.0.0.1", sink.port)
    with pytest.raises(MailRejected) as info:
        mailer.send(to="nobody@reject.invalid", subject="x", body="x", message_id="<a@sekali>")
    assert info.value.smtp_code == 550
    assert info.value.recipient == "nobody@reject.invalid"
    assert classify(info.value) is ErrorClass.PERMANENT
    assert isinstance(info.value.__cause__, smtplib.SMTPRecipientsRefused)
    assert classify(info.value.__cause__) is ErrorClass.PERMANENT
    assert sink.messages() == []


def test_no_server_is_transient() -> None:
    mailer = SmtpMailer("127.0.0.1", free_port(), timeout=2)
    with pytest.raises(MailUnavailable) as info:
        mailer.send(to="a@example.com", subject="x", body="x", message_id="<b@sekali>")
    assert classify(info.value) is ErrorClass.TRANSIENT


@pytest.fixture
def dripping_server() -> Iterator[int]:
    """An SMTP server that drips its greeting one byte every 0.2 s (about 40 s in all): each
    read gets a byte well within any per-read timeout, so only a total deadline ends a send."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def drip(conn: socket.socket) -> None:
        with contextlib.suppress(OSError), conn:
            for byte in b"220 " + b"x" * 200 + b"\r\n":
                if stop.wait(0.2):
                    return
                conn.sendall(bytes([byte]))

    def serve() -> None:
        with contextlib.suppress(OSError):
            while not stop.is_set():  # every connection drips, each on its own thread
                conn, _ = listener.accept()
                threading.Thread(target=drip, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield int(listener.getsockname()[1])
    finally:
        stop.set()
        with contextlib.suppress(OSError):  # wake the accept so the server sees the stop
            socket.create_connection(listener.getsockname(), timeout=1).close()
        listener.close()
        thread.join(5)


def test_a_dripping_server_is_cut_at_the_total_deadline(dripping_server: int) -> None:
    """Catches per-read timeouts only: a server that answers one byte at a time would hold the
    job for as long as it drips (here ~40 s). The send must end, as a transient MailUnavailable,
    at its total deadline; the test waits 8 x that before calling it unbounded."""
    mailer = SmtpMailer("127.0.0.1", dripping_server, timeout=1.0, deadline=1.5)
    outcome: list[BaseException] = []

    def send() -> None:
        try:
            mailer.send(to="a@example.com", subject="x", body="x", message_id="<d@sekali>")
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    sender.join(8 * mailer.deadline)
    assert not sender.is_alive(), "the send outlived 8 x its deadline"
    assert len(outcome) == 1 and isinstance(outcome[0], MailUnavailable), outcome
    assert "deadline" in str(outcome[0]) and classify(outcome[0]) is ErrorClass.TRANSIENT


def test_every_send_of_a_session_is_cut_at_its_own_deadline(dripping_server: int) -> None:
    """Catches a session whose one deadline keeper guards only its first send: after the first
    send was cut, the next one (a new connection, the same session) must be cut at its own
    deadline too, and closing the session ends the keeper's thread."""
    mailer = SmtpMailer("127.0.0.1", dripping_server, timeout=1.0, deadline=1.5)
    outcome: list[BaseException] = []

    def send_twice() -> None:
        with mailer.session() as session:
            for n in range(2):
                try:
                    session.send(to="a@example.com", subject="x", body="x",
                                 message_id=f"<s{n}@sekali>")
                except BaseException as exc:  # noqa: BLE001 - handed to the test
                    outcome.append(exc)

    sender = threading.Thread(target=send_twice, daemon=True)
    sender.start()
    sender.join(8 * 2 * mailer.deadline)
    assert not sender.is_alive(), "a send of the session outlived 8 x its deadline"
    assert len(outcome) == 2 and all(isinstance(e, MailUnavailable) for e in outcome), outcome
    assert all("deadline" in str(e) for e in outcome)
    keepers = [t for t in threading.enumerate() if t.name == "smtp-deadline"]
    for keeper in keepers:
        keeper.join(5)
    assert not any(t.is_alive() for t in keepers)


def test_resource_reads_settings_at_use(monkeypatch: pytest.MonkeyPatch, sink: MailSink) -> None:
    # built before the env is set: nothing read at construction
    resource = DownstreamResource(downstream="smtp")
    monkeypatch.setenv("SEKALI_SMTP_HOST", "127.0.0.1")
    monkeypatch.setenv("SEKALI_SMTP_PORT", str(sink.port))
    resource.get_client().send(to="c@example.com", subject="r", body="b", message_id="<r@sekali>")
    assert [m["message_id"] for m in sink.messages()] == ["<r@sekali>"]


def test_cli_process_records_into_its_database(tmp_path: Path) -> None:
    port = free_port()
    db_url = f"sqlite:///{tmp_path / 'cli-mail.db'}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandbox.mailsink", "--port", str(port), "--db-url", db_url],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ},
    )
    try:
        mailer = SmtpMailer("127.0.0.1", port, timeout=5)
        deadline = time.monotonic() + 60
        while True:
            try:
                mailer.send(to="d@example.com", subject="cli", body="b", message_id="<cli@sekali>")
                break
            except MailUnavailable:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    reopened = MailSink(db_url)
    try:
        assert [m["message_id"] for m in reopened.messages()] == ["<cli@sekali>"]
    finally:
        reopened.stop()


def test_a_mail_whose_send_bound_passed_is_not_handed_over(sink: MailSink) -> None:
    """The send bound is checked with the connection up, right before the envelope: once it
    has passed, SendDeadlinePassed (transient, nothing sent) and the sink has no message; the
    same session then sends within a new bound."""
    mailer = SmtpMailer("127.0.0.1", sink.port)
    message_id = message_id_for("email:welcome:u-late:2026-01-01")
    with mailer.session() as session:
        with pytest.raises(SendDeadlinePassed) as late:
            session.send(to="late@example.com", subject="hi", body="b", message_id=message_id,
                         send_by=time.monotonic() - 0.2)
        assert "not sent" in str(late.value)
        assert sink.messages() == []
        session.send(to="late@example.com", subject="hi", body="b", message_id=message_id,
                     send_by=time.monotonic() + 30)
    assert [m["message_id"] for m in sink.messages()] == [message_id]


@pytest.mark.parametrize(
    ("to", "expected"),
    [("slow@example.com", SendDeadlinePassed), ("gone@reject.invalid", MailRejected)],
    ids=["held-up", "refused-late"],
)
def test_a_send_held_up_past_its_bound_part_way_hands_no_message_over(
    to: str, expected: type[Exception]
) -> None:
    """Catches a client that checks the send bound only before the envelope: a relay that takes
    longer than the bound to answer the recipient (as if the sender paused after MAIL FROM)
    must get no DATA after it, so no message leaves after the bound (SendDeadlinePassed). And
    catches the bound hiding the relay's answer: a recipient refused (550) after the bound is
    MailRejected (permanent: dead-lettered, never retried), not a "bound passed" retried in
    vain (smtplib's RSET after a refusal is a write the bound would refuse). Either way the
    session's next send, within a new bound, goes out on a fresh connection."""
    with SlowRelay(rcpt_delay=0.5) as relay:
        mailer = SmtpMailer("127.0.0.1", relay.port)
        with mailer.session() as session:
            with pytest.raises(expected) as late:
                session.send(to=to, subject="hi", body="b", message_id="<held@sekali>",
                             send_by=time.monotonic() + 0.2)
            if expected is MailRejected:
                assert getattr(late.value, "smtp_code", None) == 550
            else:
                assert "not sent" in str(late.value)
            session.send(to="ok@example.com", subject="hi", body="b",
                         message_id="<next@sekali>", send_by=time.monotonic() + 30)
        time.sleep(0.2)  # a DATA the client wrongly sent would be taken by now
        assert [mid for mid, _ in relay.accepted] == ["<next@sekali>"]


def test_smtp_connections_come_from_the_environment_and_a_bad_value_names_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Catches ``SEKALI_SMTP_CONNECTIONS`` ignored, or a bad value turned into a default."""
    monkeypatch.setenv("SEKALI_SMTP_CONNECTIONS", "7")
    assert DownstreamResource(downstream="smtp").get_client().connections == 7
    monkeypatch.setenv("SEKALI_SMTP_CONNECTIONS", "0")
    with pytest.raises(ValidationError, match="SEKALI_SMTP_CONNECTIONS"):
        Settings.from_env()
    monkeypatch.delenv("SEKALI_SMTP_CONNECTIONS")
    assert DownstreamResource(downstream="smtp").get_client().connections == 4

