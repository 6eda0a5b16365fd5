"""Canary replay: replay a few of the selected dead letters first, follow them to their end, and
request the rest only when every one of them resolved. The logic behind ``sekali dlq replay
--canary N [--canary-timeout S]`` and the ``dlq_operations`` job's ``canary``.

A bulk replay after a fix trusts the fix; the canaries test it on a few records before the
rest follow. Guarantees:

- The canaries are the first ``canary`` records (oldest id first) the guarded bulk replay
  (:func:`engine.replay.bulk_replay`) actually requested: a record its guard refuses or that is
  not open proves nothing and is not one. Until the canaries end, the rest stay ``open`` and
  untouched (their keys are not reset).
- Each canary is followed with the follower of ``--wait`` (:mod:`engine.progress`) until it
  resolves, is dead-lettered again, or ``canary_timeout`` seconds pass.
- Only when every canary resolved is the rest requested, through the same guarded bulk replay
  (with its ``allow_repeat`` and ``pace``). A canary that failed again, ended otherwise
  (discarded) or had not ended by the timeout stops the rest: each held record stays ``open``
  with an audit line ``replay_skipped`` saying which canary stopped it, and
  :attr:`CanaryReplay.stopped` says why (the CLI exits 1, the job's run fails).
- A dry run changes nothing and says which records would be the canaries.

Time and sleep are injected (the follower's poll and the pace both use them), so a test drives
the timeout without waiting.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from engine.progress import Progress, follow, record_progress
from engine.replay import BulkReplay, Selection, bulk_replay, refuses
from engine.requests import RequestStore
from resources.dlq import DlqStore, ReplayDecision
from resources.errors import ValidationError

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 600.0
"""How long the canaries may take to end by default: a replay sensor tick and a run or two."""

RESOLVED = "canary resolved"
FAILED_AGAIN = "canary failed again"
NOT_ENDED = "canary not ended"
HELD_FAILED = "not replayed: canary failed"
HELD_TIMED_OUT = "not replayed: canary timed out"
WOULD_BE_CANARY = "would be a canary"
WOULD_FOLLOW = "would replay after the canaries resolve"
REQUESTED = "replay requested"


@dataclass
class CanaryReplay:
    """What a canary replay did: ``replay`` holds every decision and verdict (the canaries',
    then the rest's or the held records'), ``outcomes`` one line per selected record,
    ``final`` the canaries' last states; ``stopped`` says why the rest was held ("" when it
    went on)."""

    replay: BulkReplay
    canaries: list[int]
    timeout: float
    outcomes: dict[int, str] = field(default_factory=dict)
    final: list[Progress] = field(default_factory=list)
    timed_out: bool = False
    held: list[int] = field(default_factory=list)
    stopped: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "ids": self.canaries,
            "timeout": self.timeout,
            "timed_out": self.timed_out,
            "stopped": self.stopped,
            "held": self.held,
            "final": [p.as_dict() for p in self.final],
        }


def check(canary: int, timeout: float) -> None:
    """Raise :class:`ValidationError` naming ``canary`` or ``canary_timeout`` when bad."""
    if isinstance(canary, bool) or not isinstance(canary, int) or canary < 1:
        raise ValidationError("canary", "a whole number of records, at least 1", canary)
    if not (isinstance(timeout, (int, float)) and timeout > 0 and math.isfinite(timeout)):
        raise ValidationError("canary_timeout", "a positive number of seconds", timeout)


def _not_replayed(result: BulkReplay, decision: ReplayDecision, *, dry_run: bool) -> str:
    judged = result.assessments.get(decision.record.id)
    if decision.record.id in result.refused and judged is not None:
        return f"refused: {judged.verdict}"
    return f"{'would not replay' if dry_run else 'not replayed'}: {decision.reason}"


def canary_replay(
    store: DlqStore,
    selection: Selection,
    *,
    canary: int,
    actor: str,
    canary_timeout: float = DEFAULT_TIMEOUT,
    reason: str = "",
    dry_run: bool = False,
    pace: float | None = None,
    client: Callable[[str], Any] | None = None,
    allow_repeat: Collection[int] | None = None,
    interval: float = 0.5,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    on_change: Callable[[Progress], None] | None = None,
) -> CanaryReplay:
    """Replay ``canary`` records of ``selection`` first, the rest only once they all resolved
    (module docstring). The other arguments are :func:`engine.replay.bulk_replay`'s;
    ``on_change`` hears each new state of a canary (polled every ``interval`` seconds). Bad
    settings raise :class:`ValidationError` naming ``canary`` or ``canary_timeout``."""
    check(canary, canary_timeout)
    common: dict[str, Any] = {
        "actor": actor, "reason": reason, "pace": pace, "client": client, "clock": clock,
        "sleep": sleep,
    }
    if dry_run:
        return _plan(store, selection, canary, canary_timeout, allow_repeat, common)
    first = bulk_replay(store, selection, allow_repeat=allow_repeat, stop_after=canary,
                        **common)
    out = CanaryReplay(first, [d.record.id for d in first.decisions if d.replay], canary_timeout)
    for d in first.decisions:
        out.outcomes[d.record.id] = "" if d.replay else _not_replayed(first, d, dry_run=False)
    if out.canaries:
        requests = RequestStore(store.db)
        out.final, out.timed_out = follow(
            [record_progress(store, requests, i) for i in out.canaries],
            timeout=canary_timeout, interval=interval, clock=clock, sleep=sleep,
            on_change=on_change,
        )
    failed: list[str] = []
    waiting: list[int] = []
    for record_id, state in zip(out.canaries, out.final, strict=True):
        if state.ok:
            out.outcomes[record_id] = RESOLVED
        elif not state.done:
            out.outcomes[record_id] = NOT_ENDED
            waiting.append(record_id)
        else:
            again = state.state == "dead-lettered"
            out.outcomes[record_id] = FAILED_AGAIN if again else f"canary ended {state.state}"
            what = "failed again" if again else f"ended {state.state}"
            failed.append(f"canary {record_id} {what}"
                          + (f" ({state.detail})" if state.detail else ""))
    why = [*failed]
    if waiting:
        why.append(f"canary {', '.join(map(str, waiting))} not ended after"
                   f" {canary_timeout:g}s")
    if why:
        out.stopped = "; ".join(why)
        _hold(store, out, actor, HELD_FAILED if failed else HELD_TIMED_OUT)
    elif first.rest:
        _replay_rest(store, out, allow_repeat, common)
    return out


def _hold(store: DlqStore, out: CanaryReplay, actor: str, label: str) -> None:
    """Keep the rest open, each with an audit line naming the canary that stopped it."""
    for record in out.replay.rest:
        store.note(record.id, "replay_skipped", actor=actor,
                   detail=f"{out.stopped}: not replayed")
        out.replay.decisions.append(ReplayDecision(record, False, label))
        out.outcomes[record.id] = label
        out.held.append(record.id)
    log.info("canary replay stopped: %s; not replayed: %s", out.stopped, out.held,
                extra={"sekali": {"canaries": out.canaries, "held": out.held}})


def _replay_rest(store: DlqStore, out: CanaryReplay, allow_repeat: Collection[int] | None,
                 common: dict[str, Any]) -> None:
    ids = [r.id for r in out.replay.rest]
    rest = bulk_replay(
        store, Selection(ids=ids),
        allow_repeat=None if allow_repeat is None else [i for i in allow_repeat if i in ids],
        **common,
    )
    out.replay.decisions += rest.decisions
    out.replay.assessments.update(rest.assessments)
    out.replay.refused += rest.refused
    out.replay.unregistered += rest.unregistered
    for d in rest.decisions:
        out.outcomes[d.record.id] = REQUESTED if d.replay else _not_replayed(rest, d,
                                                                            dry_run=False)


def _plan(store: DlqStore, selection: Selection, canary: int, timeout: float,
          allow_repeat: Collection[int] | None, common: dict[str, Any]) -> CanaryReplay:
    """The dry run: every record's decision and verdict, and which would be the canaries (the
    first ``canary`` a real replay would request, the guard applied)."""
    plan = bulk_replay(store, selection, dry_run=True, allow_repeat=allow_repeat, **common)
    out = CanaryReplay(plan, [], timeout)
    for d in plan.decisions:
        judged = plan.assessments[d.record.id]
        if not d.replay:
            out.outcomes[d.record.id] = _not_replayed(plan, d, dry_run=True)
        elif refuses(judged, allow_repeat):
            out.outcomes[d.record.id] = f"would be refused: {judged.verdict}"
        elif len(out.canaries) < canary:
            out.canaries.append(d.record.id)
            out.outcomes[d.record.id] = WOULD_BE_CANARY
        else:
            out.outcomes[d.record.id] = WOULD_FOLLOW
    return out
