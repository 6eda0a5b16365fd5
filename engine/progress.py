"""Following work to its end: a request, or a dead letter whose replay was requested.

Whatever drives the work (the intake and replay sensors of a Dagster daemon, ``sekali dev``, a
test executing runs in-process) only moves rows; a probe reads them through their owner stores
and says where the thing stands, and :func:`follow` polls probes until each is done or a
deadline passes. Nothing here changes anything. The CLI's ``--wait`` prints the changes
(:mod:`cli.commands.follow`); a canary replay (:mod:`engine.canary`) waits on its canaries.

States of a request: ``queued`` (pending) -> ``claimed`` (the intake sensor emitted its run) ->
``running`` -> ``completed`` | ``failed`` | ``dead-lettered`` (failed and kept in the DLQ).
States of a replayed record: ``replay requested`` -> ``replaying`` -> ``completed`` (resolved) |
``dead-lettered`` (the replay failed; the record is open again) | ``discarded``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from engine.requests import JobRequest, RequestStatus, RequestStore
from resources.dlq import DlqRecordNotFound, DlqStore

DEAD_LETTER_GRACE = 60.0

_REQUEST_STATES = {
    RequestStatus.PENDING: "queued",
    RequestStatus.LAUNCHED: "claimed",
    RequestStatus.RUNNING: "running",
    RequestStatus.COMPLETED: "completed",
    RequestStatus.FAILED: "failed",
    RequestStatus.COALESCED: "coalesced",
    RequestStatus.CANCELLED: "cancelled",
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


Probe = Callable[[], Progress]


def request_progress(
    requests: RequestStore,
    dlq: DlqStore,
    request_id: int,
    *,
    grace: float = DEAD_LETTER_GRACE,
    clock: Callable[[], float] = time.monotonic,
) -> Probe:
    """A probe of one request's state (and of the dead letter that keeps it, once failed).

    The request turns ``failed`` when its run fails; its dead letter is written a few sensor
    ticks later. A failed request without one is therefore not done until one appears or
    ``grace`` seconds passed, so a follower ends on ``dead-lettered`` with the record's id
    instead of ending before the record exists."""
    failed_since: list[float] = []

    def probe() -> Progress:
        request = requests.get(request_id)  # nosec B113: the request store, not HTTP
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
    if request.status is RequestStatus.CANCELLED:
        detail = request.cancel_detail or ""
    done = request.status not in (RequestStatus.PENDING, RequestStatus.LAUNCHED,
                                  RequestStatus.RUNNING)
    return Progress(
        f"request {request.id}", state, done, request.status is RequestStatus.COMPLETED,
        attempts=request.attempts, run_id=request.run_id, detail=detail, ids=ids,
    )


def record_progress(dlq: DlqStore, requests: RequestStore, record_id: int) -> Probe:
    """A probe of one dead letter whose replay was requested (the run and attempts are its
    request's, when it has one)."""

    def probe() -> Progress:
        try:
            record = dlq.get(record_id)
        except DlqRecordNotFound:
            return Progress(f"dead letter {record_id}", "gone", True, False,
                            detail="no such record (purged?)")
        status = str(record.status)
        request = requests.get(record.request_id) if record.request_id is not None else None  # nosec B113: the request store, not HTTP
        done = status in ("open", "resolved", "discarded")
        run_id = request.run_id if request is not None else None
        if not done and run_id == record.run_id:
            run_id = None  # still the run that failed before: the replay has not started
        if done and run_id is None and status != "discarded":
            run_id = record.run_id  # no request (a run launched by hand): the record's last run
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
    probes: Sequence[Probe],
    *,
    timeout: float,
    interval: float = 0.5,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    on_change: Callable[[Progress], None] | None = None,
    on_wait: Callable[[list[Progress]], None] | None = None,
) -> tuple[list[Progress], bool]:
    """Poll every probe until all are done or ``timeout`` seconds passed (a probe done is not
    asked again). ``on_change`` hears each new state; ``on_wait`` the states before each
    sleep. Returns the last states and True when the deadline passed first."""
    deadline = clock() + timeout
    last: list[Progress | None] = [None] * len(probes)
    while True:
        for i, probe in enumerate(probes):
            before = last[i]
            if before is not None and before.done:
                continue
            now = probe()
            if now != before and on_change is not None:
                on_change(now)
            last[i] = now
        states = [p for p in last if p is not None]
        if all(p.done for p in states):
            return states, False
        if clock() >= deadline:
            return states, True
        if on_wait is not None:
            on_wait(states)
        sleep(interval)
