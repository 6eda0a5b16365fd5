"""Keep Dagster's own output to what a user of ``sekali dev`` needs: warnings and errors.

``dagster dev --log-level warning`` quiets the webserver, the daemon (one INFO line per sensor
tick otherwise) and the code server, but not the run workers: their console logger prints every
event of every run at DEBUG (a dozen lines for a one-step run), and its level is the instance's
``python_log_level``, which would also drop ``context.log.info`` from the run logs in the UI. So
``sekali dev`` reads the children's output through a pipe and drops:

- Dagster log records at DEBUG or INFO (``<time> - <logger> - DEBUG - ...``, coloured or not);
  the UI keeps every one of them in the run's logs;
- Dagster's API-maturity notices (``BetaWarning``, ``PreviewWarning``, ``SupersessionWarning``),
  which every process repeats when it loads the code, with the source line after them.

Everything else passes unchanged: WARNING and ERROR records, tracebacks, prints.
"""

from __future__ import annotations

import re
import threading
from typing import IO

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_RECORD = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:[.,]\d+)?(?: [+-]\d{4})? - [\w.\-]+ - "
    r"(?P<level>[A-Z]+) - (?P<message>.*)$"
)
_NOTICE = re.compile(r"^\S+\.py:\d+: (?:BetaWarning|PreviewWarning|SupersessionWarning): ")
_QUIET_LEVELS = frozenset({"DEBUG", "INFO"})


class QuietFilter:
    """Decides line by line what to keep; holds the state of a notice spanning lines."""

    def __init__(self) -> None:
        self._in_notice = False

    def keep(self, line: str) -> bool:
        plain = _ANSI.sub("", line).rstrip("\r\n")
        if self._in_notice:
            # A notice is followed by its indented source line (and, logged, a blank line).
            if plain == "" or plain[:1].isspace():
                return False
            self._in_notice = False
        record = _RECORD.match(plain)
        message = record.group("message") if record else plain
        if _NOTICE.match(message):
            self._in_notice = True
            return False
        return not (record is not None and record.group("level") in _QUIET_LEVELS)


def pump(source: IO[bytes], sink: IO[bytes]) -> threading.Thread:
    """Copy ``source`` to ``sink`` through a :class:`QuietFilter` on a daemon thread until EOF.

    The pipe is drained to the end even if ``sink`` breaks, so a writer never blocks on it.
    """

    def run() -> None:
        quiet = QuietFilter()
        broken = False
        with source:
            for raw in source:
                if broken or not quiet.keep(raw.decode(errors="replace")):
                    continue
                try:
                    sink.write(raw)
                    sink.flush()
                except (OSError, ValueError):
                    broken = True

    thread = threading.Thread(target=run, name="sekali-dev-output", daemon=True)
    thread.start()
    return thread
