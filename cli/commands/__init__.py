"""Subcommands of the sekali CLI, one module each."""

from __future__ import annotations

from resources.errors import SekaliError


class CommandRefused(SekaliError):
    """The command cannot run as things stand (no database yet, a schema this release cannot
    use, a job type this process does not know): ``sekali`` prints the message as one line on
    stderr and exits 2. The message says what to run or set."""

    permanent = True
