"""Keep Dagster's own output to what a user of ``sekali dev`` needs: warnings, errors, and one
line per expected failure.

``dagster dev --log-level warning`` quiets the webserver, the daemon (one INFO line per sensor
tick otherwise) and the code server, but not the run workers: their console logger prints every
event of every run at DEBUG (a dozen lines for a one-step run), and its level is the instance's
``python_log_level``, which would also drop ``context.log.info`` from the run logs in the UI. So
``sekali dev`` reads the children's output through a pipe and drops:

- Dagster log records at DEBUG or INFO (``<time> - <logger> - DEBUG - ...``, coloured or not);
  the UI keeps every one of them in the run's logs;
- Dagster's API-maturity notices (``BetaWarning``, ``PreviewWarning``, ``SupersessionWarning``),
  which every process repeats when it loads the code, with the source line after them;
- an expected failure's detail: a ``STEP_FAILURE`` or ``RUN_FAILURE`` record whose error is the
  failure path's ``Failure`` for a classified error (permanent, transient, data_bug), with its
  two tracebacks, and the attempt recorder's and retry policy's own lines about it. What stays
  is the op's one line (job type, key, class, what happens next) and the DLQ sensor's
  ``dead-lettered as 7: sekali dlq show 7``. An ``unknown`` failure keeps its tracebacks.

Everything else passes unchanged: WARNING and ERROR records, tracebacks, prints. ANSI colours
are removed when the output is not a terminal. ``sekali dev --verbose`` does not filter at all.
"""

from __future__ import annotations

import re
import threading
from typing import IO

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ANSI_BYTES = re.compile(rb"\x1b\[[0-9;]*m")
_RECORD = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:[.,]\d+)?(?: [+-]\d{4})? - [\w.\-]+ - "
    r"(?P<level>[A-Z]+) - (?P<message>.*)$"
)
_NOTICE = re.compile(r"^\S+\.py:\d+: (?:BetaWarning|PreviewWarning|SupersessionWarning): ")
_QUIET_LEVELS = frozenset({"DEBUG", "INFO"})
_FAILURE_EVENT = re.compile(r" - (?:STEP_FAILURE|RUN_FAILURE) - ")
_EXPECTED_ERROR = re.compile(
    r"^dagster\._core\.definitions\.events\.Failure: (?:permanent|transient|data_bug): "
)
"""The first line of a failure event's error when the failure path classified it
(``resources.dagster_resources.dagster_signal``'s ``Failure`` description)."""
_SAID_ELSEWHERE = re.compile(
    r"^(?:attempt \S+ [0-9a-f]{32} key=.* outcome=(?:retried|failed_permanent|dead_lettered) "
    r"|giving up after attempt \d+: )"
)
"""The attempt recorder's and the retry policy's lines for an attempt the op's line covers."""


class QuietFilter:
    """Decides line by line what to print; holds the state of a notice spanning lines and of a
    failure record whose error is not read yet (:meth:`feed` returns what to print now)."""

    def __init__(self) -> None:
        self._in_notice = False
        self._held: list[str] = []  # a failure record's header and the blank lines after it
        self._skipping = False  # inside an expected failure's error and tracebacks
        self._chained = False  # the next line is a chained error's "module.Error: message"

    def keep(self, line: str) -> bool:
        """Whether ``line`` alone is printed (lines held for a later decision count as not)."""
        return bool(self.feed(line))

    def feed(self, line: str) -> list[str]:
        plain = _ANSI.sub("", line).rstrip("\r\n")
        record = _RECORD.match(plain)
        if self._held:
            if plain == "":
                self._held.append(line)
                return []
            held, self._held = self._held, []
            if _EXPECTED_ERROR.match(plain):
                self._skipping = True
                return []
            return [*held, *self.feed(line)]
        if self._skipping:
            if self._in_error_block(plain):
                return []
            self._skipping = False
        if self._in_notice:
            # A notice is followed by its indented source line (and, logged, a blank line).
            if plain == "" or plain[:1].isspace():
                return []
            self._in_notice = False
        message = record.group("message") if record else plain
        if _NOTICE.match(message):
            self._in_notice = True
            return []
        if record is not None and record.group("level") in _QUIET_LEVELS:
            return []
        if record is None and _SAID_ELSEWHERE.match(plain):
            return []
        if record is not None and _FAILURE_EVENT.search(message):
            self._held = [line]
            return []
        return [line]

    def _in_error_block(self, plain: str) -> bool:
        """Whether ``plain`` still belongs to the error being skipped: Dagster prints blank
        lines, ``Stack Trace:``, indented frames, ``The above exception was ...`` followed by
        the chained error's line, and for an expected failure (no stack) ``Error ID ...``.
        Anything else is someone else's output."""
        chained, self._chained = self._chained, False
        if (plain == "" or plain[:1].isspace() or plain == "Stack Trace:"
                or plain.startswith("Error ID ")):
            self._chained = chained and plain == ""
            return True
        if plain.startswith("The above exception was "):
            self._chained = True
            return True
        return chained

    def flush(self) -> list[str]:
        """What is still held at the end of the output."""
        held, self._held = self._held, []
        return held


def pump(source: IO[bytes], sink: IO[bytes], *, colour: bool | None = None) -> threading.Thread:
    """Copy ``source`` to ``sink`` through a :class:`QuietFilter` on a daemon thread until EOF.

    ``colour``: keep ANSI colour codes (default: only when ``sink`` is a terminal). The pipe is
    drained to the end even if ``sink`` breaks, so a writer never blocks on it.
    """
    if colour is None:
        try:
            colour = sink.isatty()
        except (AttributeError, ValueError):
            colour = False

    def run() -> None:
        quiet = QuietFilter()
        broken = False

        def write(lines: list[str]) -> None:
            nonlocal broken
            for text in lines:
                raw = text.encode(errors="replace")
                try:
                    sink.write(raw if colour else _ANSI_BYTES.sub(b"", raw))
                    sink.flush()
                except (OSError, ValueError):
                    broken = True
                    return

        with source:
            for raw in source:
                lines = quiet.feed(raw.decode(errors="replace"))
                if lines and not broken:
                    write(lines)
            if not broken:
                write(quiet.flush())

    thread = threading.Thread(target=run, name="sekali-dev-output", daemon=True)
    thread.start()
    return thread
