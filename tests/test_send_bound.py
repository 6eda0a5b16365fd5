"""The send bound's last check (:mod:`resources.send_bound`) and the freeze that must not fall
between it and its write, in real processes and sockets."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resources.errors import SendDeadlinePassed
from resources.send_bound import within

ROOT = Path(__file__).resolve().parents[1]

# A "lane" thread writes to a socket in bounded sections, each check-to-write gap widened to
# 50 ms so a freeze lands in one unless the gate keeps it out; it notes "in" and "out" around
# each write in a file. The main thread then freezes the process at its own point, as a fault
# point does (engine.contract.freeze_here).
CHILD = """
import socket, sys, threading, time
from engine.contract import freeze_here
from resources.send_bound import within

log = open(sys.argv[1], "a", buffering=1)
sock = socket.create_connection(("127.0.0.1", int(sys.argv[2])))

def lane():
    while True:
        with within(time.monotonic() + 600, "probe"):
            log.write("in\\n")
            time.sleep(0.05)
            sock.sendall(b"x")
            log.write("out\\n")

threading.Thread(target=lane, daemon=True).start()
time.sleep(0.3)
log.write("freezing\\n")
freeze_here()
"""


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_freeze_never_catches_another_thread_between_a_bound_check_and_its_write(
    tmp_path: Path,
) -> None:
    """Catches a fault harness's freeze (``freeze_here``, a SIGSTOP of the whole process) that
    can fall in another thread's gap between its send bound's check and its write (a batch's
    other lanes): resumed past its bound, that thread would write without checking again. The
    freeze waits for the section under way to end: the process stops with its lane out of
    every section."""
    log = tmp_path / "lane.log"
    listener = socket.create_server(("127.0.0.1", 0))
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(log), str(listener.getsockname()[1])], cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    peer, _ = listener.accept()
    try:
        deadline = time.monotonic() + 60
        while _state(proc.pid) != "T":
            assert proc.poll() is None and time.monotonic() < deadline, "the child never froze"
            time.sleep(0.01)
        lines = log.read_text().split()
        assert "freezing" in lines and lines.count("in") >= 2, lines
        assert lines[-1] in ("out", "freezing"), lines[-6:]
        assert lines.count("in") == lines.count("out"), lines[-6:]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        peer.close()
        listener.close()


def test_a_passed_bound_refuses_the_write_and_names_it() -> None:
    """Catches a check that lets the write run once the bound passed, or a bound of None taken
    for a passed one."""
    wrote: list[str] = []
    with (pytest.raises(SendDeadlinePassed, match="charge c1 not sent"),
          within(time.monotonic() - 0.01, "charge c1")):
        wrote.append("late")
    with within(None, "unbounded"):
        wrote.append("unbounded")
    with within(time.monotonic() + 5, "in time"):
        wrote.append("in time")
    assert wrote == ["unbounded", "in time"]
