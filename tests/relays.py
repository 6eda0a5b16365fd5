"""A real SMTP relay for the tests that need one slower than the sandbox sink: aiosmtpd on its
own thread, answering RCPT and DATA after set delays, keeping what it saw."""

from __future__ import annotations

import asyncio
import threading
from email.parser import BytesHeaderParser
from typing import Any

from aiosmtpd.controller import Controller

from sandbox.redis_server import free_port


class SlowRelay:
    """Answers each RCPT after ``rcpt_delay`` and each DATA after ``data_delay`` seconds; a
    recipient at ``reject.invalid`` is refused (550), after the same delay. ``accepted``:
    (Message-ID, the connection's peer) of each message taken, in order; ``most_at_once``: the
    most DATA exchanges under way together."""

    def __init__(self, *, rcpt_delay: float = 0.0, data_delay: float = 0.0) -> None:
        self.rcpt_delay = rcpt_delay
        self.data_delay = data_delay
        self.port = free_port()
        self.accepted: list[tuple[str, tuple[str, int]]] = []
        self.most_at_once = 0
        self._now = 0
        self._lock = threading.Lock()
        self._controller = Controller(self, hostname="127.0.0.1", port=self.port)

    def __enter__(self) -> SlowRelay:
        self._controller.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._controller.stop()

    async def handle_RCPT(  # noqa: N802 - aiosmtpd hook name
        self, server: Any, session: Any, envelope: Any, address: str, options: list[str]
    ) -> str:
        await asyncio.sleep(self.rcpt_delay)
        if address.endswith("@reject.invalid"):
            return f"550 5.1.1 <{address}>: recipient rejected"
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:  # noqa: N802
        with self._lock:
            self._now += 1
            self.most_at_once = max(self.most_at_once, self._now)
        try:
            await asyncio.sleep(self.data_delay)
        finally:
            with self._lock:
                self._now -= 1
        headers = BytesHeaderParser().parsebytes(envelope.original_content or envelope.content)
        with self._lock:
            self.accepted.append((str(headers["Message-ID"]).strip(), tuple(session.peer)))
        return "250 Message accepted for delivery"
