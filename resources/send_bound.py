"""The send bound's last check, right before a write to a downstream's socket: one place for
every client that carries a bound (:mod:`resources.http`, the SMTP client).

A bound is a monotonic time after which no byte of a request may leave (``JobContext.
confirm_lease`` grants it). :func:`within` checks it and holds the write that follows as one
section of :data:`WRITES`. What is left between the check and the socket call is a few
instructions (docs/design.md, "The send bound"); a pause of the whole process there would let
the write out late. A real pause can fall there. A fault harness that freezes a process
(``engine.contract.freeze_here``) must not pick that gap for it, or a thread other than the
one it stops (a batch's other lanes) would be caught in it: it freezes inside
:meth:`SectionGate.quiesced`, which lets the sections under way end first and holds new ones
back until the process resumes.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from resources.errors import SendDeadlinePassed


class SectionGate:
    """Sections of code under way in this process that a freeze must not fall inside (here,
    the bounded writes between their check and their socket call): :meth:`section` around
    one; :meth:`quiesced` waits for none to be under way and keeps new ones waiting while its
    block runs."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = 0
        self._closed = False

    @contextlib.contextmanager
    def section(self) -> Iterator[None]:
        with self._cond:
            while self._closed:
                self._cond.wait()
            self._open += 1
        try:
            yield
        finally:
            with self._cond:
                self._open -= 1
                if self._closed:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def quiesced(self) -> Iterator[None]:
        with self._cond:
            self._closed = True
            while self._open:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._closed = False
                self._cond.notify_all()


WRITES = SectionGate()


def late_by(send_by: float | None) -> float | None:
    """How long ago ``send_by`` passed (seconds, >= 0), or None while it has not (or there is
    no bound)."""
    if send_by is None:
        return None
    late = time.monotonic() - send_by
    return late if late >= 0 else None


@contextlib.contextmanager
def within(send_by: float | None, what: str) -> Iterator[None]:
    """Check ``send_by`` and hold the write the block makes as a section of :data:`WRITES`:
    :class:`SendDeadlinePassed` (naming ``what``), and the block does not run, once it passed."""
    with WRITES.section():
        late = late_by(send_by)
        if late is not None:
            raise SendDeadlinePassed(what, late)
        yield
