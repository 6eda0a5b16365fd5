"""The peers benchmark counts at the mail sink, from the sink's own rows: a second mail of one
intent is a duplicate, an intent without a mail is lost, whoever sent them."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import peer_handler
from benchmarks.intake import payloads
from benchmarks.peers import SinkRecords, watch
from sandbox.mailsink import MailSink


def test_duplicates_and_lost_are_counted_per_intent_at_the_sink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches a count taken from what workers reported, or one that takes a resend (same
    Message-ID) for a new intent: three intents, the first sent twice, the third never."""
    sink = MailSink(f"sqlite:///{tmp_path / 'sink.db'}").start()
    try:
        items = payloads("count", 3)
        w = watch(SinkRecords(tmp_path / "sink.db"), items)
        monkeypatch.setenv("SEKALI_SMTP_PORT", str(sink.port))
        peer_handler.mailer.cache_clear()
        send = peer_handler.send_email
        ids = [send(items[0]), send(items[0]), send(items[1])]
        w.poll()
    finally:
        sink.stop()
    assert ids[0] == ids[1] != ids[2]
    assert w.mails == 3 and len(w.first) == 2
    assert w.mails - len(w.first) == 1  # duplicates
    assert len(w.wanted) - len(w.first) == 1  # lost
    assert not w.done()
