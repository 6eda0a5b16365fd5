"""Children that start and stop as a whole: one process group each, a stop with a deadline.

``sekali dev`` runs ``dagster dev`` (which spawns the webserver, the daemon, a code server, and
run workers under it) and an embedded ``redis-server``. Each child starts in a new session, so it
and everything it spawns share one process group that a terminal's Ctrl-C does not reach
directly, and that :meth:`Supervisor.stop` ends with ``killpg``: SIGTERM, then SIGKILL once the
grace period is over. ``stop()`` returns within ``grace + KILL_WAIT`` seconds whatever the
children do with SIGTERM; ``sekali dev`` stops ``dagster dev`` first (4 s of grace), then the
embedded Redis (1 s), so it is done in about 5 s at worst and in 10 s even if a process sits in
uninterruptible sleep.

Why groups and not pids: ``dagster dev`` stops its webserver and daemon politely and waits up to
60 s for each; and when started from a non-interactive shell with ``&`` it ignores SIGINT and
SIGTERM altogether (the shell set SIG_IGN, children inherit it, Dagster maps SIGTERM onto the
SIGINT handler). ``sekali dev`` installs its own handlers before it spawns anything, so its
children start with the default disposition (exec resets caught signals, not ignored ones).

If the supervisor dies without stopping (SIGKILL, OOM), a watchdog ends the groups: a small
process in its own session that reads the list of groups on a pipe from the supervisor. The
pipe's write end lives only in the supervisor, so end-of-file means the supervisor is gone, and
the watchdog stops every group it was told about with the same SIGTERM-then-SIGKILL sequence.
``PR_SET_PDEATHSIG`` was not enough: it reaches direct children only, not the webserver and
daemon under ``dagster dev``.

On Linux the supervisor is also a child subreaper: processes orphaned while their group stops
are re-parented to it and reaped here, so none is left as a zombie whatever PID 1 does.

Run ``python -m cli.commands.supervisor`` only as the watchdog (it reads stdin).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any

PR_SET_CHILD_SUBREAPER = 36

# Between SIGTERM and SIGKILL. Dagster's webserver and daemon need 2-6 s here to stop politely;
# past 4 s they are killed, which costs nothing in dev (SQLite is journaled, runs are retried).
DEFAULT_GRACE = 4.0
# For what is left after the main children (the embedded Redis stops in milliseconds).
CLOSE_GRACE = 1.0
# After SIGKILL, how long to wait for the kernel to remove the group (only a process stuck in
# uninterruptible sleep takes that long).
KILL_WAIT = 2.0


def become_subreaper() -> bool:
    """Adopt orphaned descendants (Linux >= 3.4); ``False`` where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def group_alive(pgid: int) -> bool:
    """Whether any process is still in the group (zombies not yet reaped included)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def stop_groups(
    pgids: Sequence[int],
    *,
    grace: float = DEFAULT_GRACE,
    reap: Callable[[], None] = lambda: None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """SIGTERM every group, SIGKILL what is left after ``grace``; ``True`` if all are gone.

    ``reap`` is called while waiting so that exited children do not keep a group alive as
    zombies. Returns within ``grace + KILL_WAIT`` seconds plus one poll interval.
    """
    for pgid in pgids:
        signal_group(pgid, signal.SIGTERM)
    for signum, budget in ((signal.SIGKILL, grace), (None, KILL_WAIT)):
        deadline = clock() + budget
        while True:
            reap()
            alive = [pgid for pgid in pgids if group_alive(pgid)]
            if not alive:
                return True
            if clock() >= deadline:
                break
            sleep(0.05)
        if signum is not None:
            for pgid in alive:
                signal_group(pgid, signum)
    return False


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]

    @property
    def pgid(self) -> int:
        # start_new_session makes the child the leader of a group named by its pid.
        return self.process.pid


class Supervisor:
    """Starts children in their own process groups and stops them all, with a deadline.

    Use from the main thread: :meth:`spawn` for each child, :meth:`exited` to notice a child that
    ended on its own, :meth:`stop` once (idempotent). Install signal handlers before the first
    :meth:`spawn`, so that children do not inherit an ignored SIGINT.
    """

    def __init__(self, *, grace: float = DEFAULT_GRACE, watchdog: bool = True) -> None:
        self.grace = grace
        self.children: list[Child] = []
        self.subreaper = become_subreaper()
        self._watchdog: subprocess.Popen[bytes] | None = None
        if watchdog:
            self._watchdog = subprocess.Popen(
                [sys.executable, "-m", "cli.commands.supervisor", "--grace", str(grace)],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
            )

    def spawn(self, name: str, argv: Sequence[str], **popen: Any) -> subprocess.Popen[bytes]:
        process: subprocess.Popen[bytes] = subprocess.Popen(
            list(argv), start_new_session=True, **popen
        )
        self.children.append(Child(name, process))
        self._tell_watchdog(f"+{process.pid}")
        return process

    def exited(self) -> Child | None:
        """The first child that has ended (and reaps orphans meanwhile), else ``None``."""
        self.reap()
        for child in self.children:
            if child.process.poll() is not None:
                return child
        return None

    def reap(self) -> None:
        """Reap exited children: our own through Popen, adopted orphans (as subreaper) here.

        Any other child of this process is reaped too, so spawn nothing else meanwhile."""
        own = {child.process.pid: child.process for child in self.children}
        if self._watchdog is not None:
            own[self._watchdog.pid] = self._watchdog
        for process in own.values():
            process.poll()
        while self.subreaper:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return
            if info is None:
                return
            if info.si_pid in own:
                own.pop(info.si_pid).poll()
            else:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(info.si_pid, 0)

    def stop(self, names: Sequence[str] | None = None, *, grace: float | None = None) -> bool:
        """Stop the named children's groups (all, by default), newest first; ``True`` if gone."""
        chosen = [c for c in reversed(self.children) if names is None or c.name in names]
        done = stop_groups(
            [c.pgid for c in chosen],
            grace=self.grace if grace is None else grace,
            reap=self.reap,
        )
        for child in chosen:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(0.5)
            self._tell_watchdog(f"-{child.pgid}")
            self.children.remove(child)
        return done

    def kill(self) -> None:
        """SIGKILL every group at once: for a second interrupt while stopping."""
        for child in self.children:
            signal_group(child.pgid, signal.SIGKILL)

    def close(self) -> None:
        """Stop everything left (short grace), then let the watchdog go without killing."""
        self.stop(grace=CLOSE_GRACE)
        self._tell_watchdog("exit")
        if self._watchdog is not None:
            if self._watchdog.stdin is not None:
                with contextlib.suppress(OSError):
                    self._watchdog.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._watchdog.wait(2)
            self._watchdog = None

    def _tell_watchdog(self, line: str) -> None:
        if self._watchdog is None or self._watchdog.stdin is None:
            return
        with contextlib.suppress(OSError, ValueError):
            self._watchdog.stdin.write(line.encode() + b"\n")
            self._watchdog.stdin.flush()


def watch(stream: IO[bytes], *, grace: float) -> int:
    """The watchdog: track groups from ``stream``; at end-of-file stop those still listed.

    Lines are ``+PGID`` (a group started), ``-PGID`` (stopped and reaped: forget it, so a
    reused number is never signalled) and ``exit`` (a clean stop: end without killing).
    """
    pgids: list[int] = []
    for raw in stream:
        line = raw.decode().strip()
        if line == "exit":
            return 0
        if line[:1] == "+":
            pgids.append(int(line[1:]))
        elif line[:1] == "-" and int(line[1:]) in pgids:
            pgids.remove(int(line[1:]))
    stop_groups(pgids, grace=grace)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    import argparse  # noqa: PLC0415 - only the watchdog needs it

    parser = argparse.ArgumentParser(description="sekali dev watchdog (reads stdin)")
    parser.add_argument("--grace", type=float, default=DEFAULT_GRACE)
    args = parser.parse_args(argv)
    # A hangup or Ctrl-C aimed at the supervisor must not end the one process that cleans up.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    return watch(sys.stdin.buffer, grace=float(args.grace))


if __name__ == "__main__":
    sys.exit(main())
