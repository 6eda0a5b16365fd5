"""Checks ``sekali dev`` makes before it starts anything: one instance per folder, free ports.

Both fail with a :class:`DevPreflightError` whose message is one line a user can act on; the
command prints it and exits 2, having started nothing.

- :class:`InstanceLock`: an exclusive ``flock`` on ``dev.lock`` in the state folder and in the
  Dagster home (two folders may share a home; a home must have one daemon), held for the life
  of the process. The kernel drops it
  when the process ends, however it ends, so a stale file never blocks the next start. The file
  holds the owner's pid, only to name it in the message.
- :func:`check_ports`: each port must be bindable the way the servers bind it
  (``SO_REUSEADDR``, so a socket in TIME_WAIT does not count as busy). When one is taken the
  message names the process listening on it, found through ``/proc/net/tcp*`` and
  ``/proc/*/fd``, else ``ss -ltnp``; without either it says the holder is unknown.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Iterable
from pathlib import Path

from resources.errors import SekaliError
from resources.storage.files import private_folder

LOCK_NAME = "dev.lock"


class DevPreflightError(SekaliError):
    """``sekali dev`` cannot start; the message is the single line to print."""

    permanent = True


class AlreadyRunning(DevPreflightError):
    """Another ``sekali dev`` holds the lock on this folder; ``pid`` is its pid when known."""

    def __init__(self, folder: Path, pid: int | None) -> None:
        who = f"(pid {pid}) " if pid else ""
        super().__init__(
            f"another sekali dev {who}is running on {folder}; stop it first, or use another "
            "SEKALI_STATE_DIR and DAGSTER_HOME"
        )
        self.folder = folder
        self.pid = pid


class PortInUse(DevPreflightError):
    """``port`` is taken; ``holder`` describes the listening process when it can be found."""

    def __init__(self, what: str, port: int, holder: str | None, setting: str) -> None:
        by = holder or "a process this user cannot see"
        super().__init__(f"port {port} ({what}) is in use by {by}; stop it or change {setting}")
        self.what = what
        self.port = port
        self.holder = holder


class InstanceLock:
    """Exclusive, non-blocking ``flock`` on ``dev.lock`` in each folder, held until release.

    ``acquire()`` takes every lock or none and raises :class:`AlreadyRunning` naming the holder.
    The descriptors are not inheritable, so children never keep a lock after the owner exits.
    """

    def __init__(self, folders: Iterable[Path]) -> None:
        self.folders = list(dict.fromkeys(folder.resolve() for folder in folders))
        self._fds: list[int] = []

    def acquire(self) -> InstanceLock:
        try:
            for folder in self.folders:
                private_folder(folder)  # state and Dagster home: personal data, sockets
                fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = _read_pid(fd)
                    os.close(fd)
                    raise AlreadyRunning(folder, holder) from None
                self._fds.append(fd)
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            self.release()
            raise
        return self

    def release(self) -> None:
        # The file stays: removing it would let a third process lock a new inode meanwhile.
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
            os.close(fd)
        self._fds = []

    def __enter__(self) -> InstanceLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode().strip()
        return int(text) if text else None
    except (OSError, ValueError):
        return None


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return True
            raise
    return False


def check_ports(ports: Iterable[tuple[str, str, int, str]]) -> None:
    """Raise :class:`PortInUse` for the first ``(what, host, port, setting)`` that is taken.

    ``setting`` names the option or variable that moves the port, for the message."""
    for what, host, port, setting in ports:
        if port_in_use(host, port):
            raise PortInUse(what, port, port_holder(port), setting)


def port_holder(port: int) -> str | None:
    """``pid N (command line)`` of a process listening on TCP ``port``, or ``None``."""
    pid = _holder_from_proc(port)
    if pid is None:
        pid = _holder_from_ss(port)
    if pid is None:
        return None
    return f"pid {pid} ({describe_process(pid)})"


def describe_process(pid: int, limit: int = 80) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    text = " ".join(part.decode(errors="replace") for part in raw.split(b"\0") if part)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _listening_inodes(port: int) -> set[str]:
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            # sl local_address rem_address st(0A = LISTEN) tx:rx tr:when retrnsmt uid timeout inode
            if len(fields) < 10 or fields[3] != "0A":
                continue
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    inodes.discard("0")
    return inodes


def _holder_from_proc(port: int) -> int | None:
    targets = {f"socket:[{inode}]" for inode in _listening_inodes(port)}
    if not targets:
        return None
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{entry.name}/fd")
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry.name}/fd/{fd}") in targets:
                    return int(entry.name)
    return None


def _holder_from_ss(port: int) -> int | None:
    ss = shutil.which("ss")
    if ss is None:
        return None
    try:
        out = subprocess.run(
            [ss, "-Hltnp", f"sport = :{port}"], capture_output=True, text=True, timeout=5
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"pid=(\d+)", out)
    return int(match.group(1)) if match else None
