"""``--wait``: follow a request (``sekali enqueue``) or a replayed dead letter (``dlq replay``)
to its end, showing where it stands on stderr.

Whatever drives the work (the intake and replay sensors of a Dagster daemon, ``sekali dev``, a
test executing runs in-process) only moves rows; this module reads them through their owner
stores, every ``interval`` seconds, and prints one line on stderr each time the state changes
(with a spinner on a terminal). It never changes anything.

States of a request: ``queued`` (pending) -> ``claimed`` (the intake sensor emitted its run) ->
``running`` -> ``completed`` | ``failed`` | ``dead-lettered`` (failed and kept in the DLQ).
States of a replayed record: ``replay requested`` -> ``replaying`` -> ``completed`` (resolved) |
``dead-lettered`` (the replay failed; the record is open again) | ``discarded``.

:func:`follow` returns the last states and whether the deadline passed; :func:`exit_code` turns
them into the CLI's answer: 0 every followed thing completed, 1 one ended failed, was
dead-lettered, or had not ended by ``--timeout``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from cli.commands.output import err_console, when
from engine.requests import JobRequest, RequestStatus, RequestStore
from resources.dlq import DlqRecordNotFound, DlqStore

DEFAULT_TIMEOUT = 300.0
DEAD_LETTER_GRACE = 60.0

_REQUEST_STATES = {
    RequestStatus.PENDING: "queued",
    RequestStatus.LAUNCHED: "claimed",
    RequestStatus.RUNNING: "running",
    RequestStatus.COMPLETED: "completed",
    RequestStatus.FAILED: "failed",
}
_RECORD_STATES = {
    "open": "dead-lettered",
    "replay_requested": "replay requested",
    "replaying": "replaying",
    "resolved": "completed",
    "discarded": "discarded",
}


@dataclass(frozen=True)
class Progress:
    """Where one followed thing stands. ``done``: it will not move again by itself; ``ok``: it
    ended completed."""

    subject: str
    state: str
    done: bool
    ok: bool
    attempts: int | None = None
    run_id: str | None = None
    detail: str = ""
    ids: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        """``request 3: running, attempts 1, run 5f0c...``: the progress line."""
        return f"{self.subject}: {self.state}, {self.where()}"

    def where(self) -> str:
        parts = [] if self.attempts is None else [f"attempts {self.attempts}"]
        parts.append(f"run {self.run_id}" if self.run_id else "no run yet")
        text = ", ".join(parts)
        return f"{text} ({self.detail})" if self.detail else text

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def request_progress(
    requests: RequestStore,
    dlq: DlqStore,
    request_id: int,
    *,
    grace: float = DEAD_LETTER_GRACE,
    clock: Callable[[], float] = time.monotonic,
) -> Callable[[], Progress]:
    """A probe of one request's state (and of the dead letter that keeps it, once failed).

    The request turns ``failed`` when its run fails; its dead letter is written a few sensor
    ticks later. A failed request without one is therefore not done until one appears or
    ``grace`` seconds passed, so ``--wait`` ends on ``dead-lettered`` with the record's id
    instead of ending before the record exists."""
    failed_since: list[float] = []

    def probe() -> Progress:
        request = requests.get(request_id)
        if request is None:
            return Progress(f"request {request_id}", "gone", True, False,
                            detail="no such request (purged?)")
        progress = _of_request(request, dlq)
        if progress.state != "failed":
            return progress
        if not failed_since:
            failed_since.append(clock())
        if clock() - failed_since[0] >= grace:
            return progress
        return replace(progress, done=False,
                       detail=f"{progress.detail}; waiting for its dead letter".lstrip("; "))

    return probe


def _of_request(request: JobRequest, dlq: DlqStore) -> Progress:
    state = _REQUEST_STATES[request.status]
    detail = ""
    ids: dict[str, Any] = {"request_id": request.id, "key": request.key}
    if request.status is RequestStatus.FAILED:
        records = [r for r in dlq.list_records(request_id=request.id) if r.status != "resolved"]
        if records:
            state = "dead-lettered"
            ids["dlq_record_id"] = records[-1].id
            detail = f"dead letter {records[-1].id}: sekali dlq show {records[-1].id}"
        else:
            detail = request.last_error or ""
    done = request.status in (RequestStatus.COMPLETED, RequestStatus.FAILED)
    return Progress(
        f"request {request.id}", state, done, request.status is RequestStatus.COMPLETED,
        attempts=request.attempts, run_id=request.run_id, detail=detail, ids=ids,
    )


def record_progress(
    dlq: DlqStore, requests: RequestStore, record_id: int
) -> Callable[[], Progress]:
    """A probe of one dead letter whose replay was requested (the run and attempts are its
    request's, when it has one)."""

    def probe() -> Progress:
        try:
            record = dlq.get(record_id)
        except DlqRecordNotFound:
            return Progress(f"dead letter {record_id}", "gone", True, False,
                            detail="no such record (purged?)")
        status = str(record.status)
        request = requests.get(record.request_id) if record.request_id is not None else None
        done = status in ("open", "resolved", "discarded")
        run_id = request.run_id if request is not None else None
        if not done and run_id == record.run_id:
            run_id = None  # still the run that failed before: the replay has not started
        detail = ""
        if status == "open":
            detail = f"replay failed: {' '.join((record.last_error or '').split())[:160]}"
        return Progress(
            f"dead letter {record.id}",
            _RECORD_STATES.get(status, status),
            done,
            status == "resolved",
            attempts=request.attempts if request is not None else None,
            run_id=run_id,
            detail=detail,
            ids={"dlq_record_id": record.id, "request_id": record.request_id,
                 "key": record.idempotency_key},
        )

    return probe


def follow(
    probes: Sequence[Callable[[], Progress]],
    *,
    timeout: float = DEFAULT_TIMEOUT,
    interval: float = 0.5,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[list[Progress], bool]:
    """Poll every probe until all are done or ``timeout`` seconds passed; print each change on
    stderr. Returns the last states and True when the deadline passed first."""
    console = err_console()
    deadline = clock() + timeout
    last: list[Progress | None] = [None] * len(probes)
    spinner = console.status("") if console.is_terminal else nullcontext()
    with spinner as status:
        while True:
            for i, probe in enumerate(probes):
                if last[i] is not None and last[i].done:  # type: ignore[union-attr]
                    continue
                now = probe()
                if now != last[i]:
                    console.print(f"{when(time.time())}  {now.line()}")
                last[i] = now
            states = [p for p in last if p is not None]
            if all(p.done for p in states):
                return states, False
            if clock() >= deadline:
                return states, True
            if status is not None:
                status.update(" | ".join(p.line() for p in states if not p.done))
            sleep(interval)


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
