"""Processes started inside a host's namespace, recorded so they can be found and ended by pid.

A process is started as ``ip netns exec NS unshare --uts -- sh -c 'hostname H && exec "$@"' ...``:
every step ``exec``s, so the pid ``Popen`` returns is the process itself; it runs in the host's
network namespace and in a UTS namespace of its own whose hostname is the host's
(``sekali-w1``), so ``socket.gethostname()`` inside it (which ``job_attempts.host`` records)
names the host. Each process leads a session of its own (``start_new_session``): it outlives the
command that started it, and a signal to its group reaches its children too.

A record keeps the pid and the process's start time (``/proc/PID/stat`` field 22): a pid the
kernel has since given to someone else never matches, so ``down`` never signals a stranger.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sandbox.hosts import cgroups

_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}
"""Processes started by this Python process: polled so an ended one does not stay a zombie."""


@dataclass
class ProcessRecord:
    """One long-running process of a host (``postgres``, ``code_server``, ``webserver`` ...)."""

    host: str
    name: str
    argv: list[str]
    log: str
    pid: int = 0
    start_time: int = 0
    user: str | None = None
    stop_signal: int = int(signal.SIGTERM)
    extra_env: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ProcessRecord:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def start_time_of(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None if there is no such process
    or it is a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ')'
    rest = stat[stat.rindex(")") + 2 :].split()
    if rest[0] in ("Z", "X"):
        return None
    return int(rest[19])


def reap() -> None:
    """Collect the exit status of ended children of this process (no zombies left)."""
    for pid, child in list(_CHILDREN.items()):
        if child.poll() is not None:
            del _CHILDREN[pid]


def is_alive(record: ProcessRecord) -> bool:
    reap()
    return record.pid > 0 and start_time_of(record.pid) == record.start_time


@dataclass(frozen=True)
class Reveal:
    """Folders a service user may not search (``/root``, 0700, holding the Python interpreter),
    and the names under each it needs: ``folder -> names``, mounted through ``holder`` (an empty
    folder root owns)."""

    folders: Mapping[str, Sequence[str]] = field(default_factory=dict)
    holder: str = ""

    def script(self) -> str:
        """Shell commands, run as root in the process's own mount namespace (``ip netns exec``
        gives every process one; nothing propagates back to the machine), that cover each folder
        with an empty 0711 tmpfs holding only the names needed, bind-mounted from the original:
        the service reaches its interpreter and sees nothing else of the folder."""
        steps = []
        for folder, names in sorted(self.folders.items()):
            f, h = shlex.quote(folder), shlex.quote(self.holder)
            steps += [f"mount --bind {f} {h}",
                      f"mount -t tmpfs -o mode=0711,size=64k sekali-reveal {f}"]
            for name in names:
                inside, kept = shlex.quote(f"{folder}/{name}"), shlex.quote(f"{self.holder}/{name}")
                steps += [f"mkdir {inside}", f"mount --bind {kept} {inside}"]
            steps.append(f"umount {h}")
        return "".join(f"{step} && " for step in steps)


def namespace_argv(
    namespace: str, hostname: str, argv: Sequence[str], user: str | None,
    reveal: Reveal | None = None,
) -> list[str]:
    """The command line that runs ``argv`` in ``namespace`` under ``hostname`` (as ``user``,
    with ``reveal``'s folders made reachable for it first)."""
    inner = list(argv)
    prepare = ""
    if user is not None:
        inner = ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", "--", *inner]
        prepare = reveal.script() if reveal is not None else ""
    return [
        "ip", "netns", "exec", namespace,
        "unshare", "--uts", "--",
        "sh", "-c", f'hostname "$0" && {prepare}exec "$@"', hostname,
        *inner,
    ]  # fmt: skip


def spawn(
    record: ProcessRecord,
    *,
    namespace: str,
    hostname: str,
    env: Mapping[str, str],
    cwd: Path,
    cgroup: Path | str | None = None,
    reveal: Reveal | None = None,
) -> ProcessRecord:
    """Start ``record.argv`` in ``namespace`` (and the CPU-accounting ``cgroup``, before it can
    fork); fill in its pid and start time."""
    Path(record.log).parent.mkdir(parents=True, exist_ok=True)
    with open(record.log, "ab") as log_file:
        child = subprocess.Popen(
            namespace_argv(namespace, hostname, record.argv, record.user, reveal),
            env=dict(env),
            cwd=str(cwd),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    cgroups.add(cgroup, child.pid)
    _CHILDREN[child.pid] = child
    record.pid = child.pid
    started = None
    for _ in range(50):  # the kernel shows the new process at once; be patient anyway
        started = start_time_of(child.pid)
        if started is not None or child.poll() is not None:
            break
        time.sleep(0.01)
    record.start_time = started or 0
    return record


def send(record: ProcessRecord, sig: int, *, group: bool = False) -> bool:
    """Signal the process (its whole session's group with ``group``); False if it is gone."""
    if not is_alive(record):
        return False
    try:
        if group:
            os.killpg(record.pid, sig)  # the session leader's pgid is its pid
        else:
            os.kill(record.pid, sig)
    except ProcessLookupError:
        return False
    return True


def wait_gone(records: Iterable[ProcessRecord], timeout: float) -> list[ProcessRecord]:
    """Wait up to ``timeout`` s for the processes to end; return those still alive."""
    pending = list(records)
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        pending = [r for r in pending if is_alive(r)]
        if pending:
            time.sleep(0.1)
    return [r for r in pending if is_alive(r)]


def end(records: Sequence[ProcessRecord], *, timeout: float = 15.0) -> list[ProcessRecord]:
    """Each process's own stop signal, then SIGKILL to its group after ``timeout``; returns the
    ones that would not die (none, unless the kernel is stuck)."""
    for record in records:
        send(record, record.stop_signal)
    left = wait_gone(records, timeout)
    for record in left:
        send(record, signal.SIGKILL, group=True)
        send(record, signal.SIGKILL)
    return wait_gone(left, 5.0)


def kill_pids(pids: Iterable[int], *, timeout: float = 5.0) -> list[int]:
    """SIGKILL pids found in one of our namespaces; return those still there after ``timeout``."""
    targets = {pid: start_time_of(pid) for pid in pids if pid != os.getpid()}
    for pid, started in targets.items():
        if started is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reap()
        left = [p for p, s in targets.items() if s is not None and start_time_of(p) == s]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p, s in targets.items() if s is not None and start_time_of(p) == s]
