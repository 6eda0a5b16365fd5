"""``--wait``: follow a request (``sekali enqueue``) or a replayed dead letter (``dlq replay``)
to its end, showing where it stands on stderr.

The probes and the polling are :mod:`engine.progress` (a canary replay waits with them too);
this module prints one line on stderr each time a state changes (with a spinner on a terminal)
and turns the last states into the CLI's answer (:func:`exit_code`): 0 every followed thing
completed, 1 one ended failed, was dead-lettered, or had not ended by ``--timeout``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext

from cli.commands.output import err_console, when
from engine.progress import (
    DEAD_LETTER_GRACE,
    Probe,
    Progress,
    record_progress,
    request_progress,
)
from engine.progress import follow as poll

__all__ = [
    "DEAD_LETTER_GRACE",
    "Progress",
    "add_wait_arguments",
    "exit_code",
    "follow",
    "record_progress",
    "request_progress",
    "seconds",
]

DEFAULT_TIMEOUT = 300.0


def follow(
    probes: Sequence[Probe],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    interval: float = 0.5,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[list[Progress], bool]:
    """Poll every probe until all are done or ``timeout`` seconds passed; print each change on
    stderr. Returns the last states and True when the deadline passed first."""
    console = err_console()
    spinner = console.status("") if console.is_terminal else nullcontext()
    with spinner as status:
        return poll(
            probes, timeout=timeout, interval=interval, clock=clock, sleep=sleep,
            on_change=lambda now: console.print(f"{when(time.time())}  {now.line()}"),
            on_wait=None if status is None else lambda states: status.update(
                " | ".join(p.line() for p in states if not p.done)),
        )


def exit_code(states: Sequence[Progress], timed_out: bool, timeout: float) -> int:
    """0 when everything completed; else 1, after one line on stderr saying where each unfinished
    or failed thing stood."""
    console = err_console()
    if timed_out:
        for p in states:
            if not p.done:
                console.print(f"timed out after {timeout:g}s: {p.subject} still {p.state} "
                              f"({p.where()})")
        return 1
    failed = [p for p in states if not p.ok]
    for p in failed:
        console.print(f"{p.subject} ended {p.state}" + (f": {p.detail}" if p.detail else ""))
    return 1 if failed else 0


def seconds(text: str) -> float:
    """argparse ``type=`` of ``--timeout``: a positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def add_wait_arguments(parser: argparse.ArgumentParser) -> None:
    """``--wait`` and ``--timeout`` for a command that starts work."""
    parser.add_argument("--wait", action="store_true",
                        help="follow the work to its end (exit 1 if it fails or times out)")
    parser.add_argument("--timeout", type=seconds, default=DEFAULT_TIMEOUT,
                        help=f"with --wait: give up after this many seconds ({DEFAULT_TIMEOUT:g})")
