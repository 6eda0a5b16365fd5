"""Run the SPIN model of the ledger protocol: each check is one exhaustive verification.

A check compiles a model (``ledger.pml`` or ``redis_fence.pml``) with its switches
(``spin -a -D...``), builds the verifier (``gcc``), runs it (``./pan``) and reads what it
says: states stored, transitions, depth reached, memory, seconds, errors. A check expected to
verify passes with no error; a check expected to be refuted (a broken variant, or the code
before a finding was fixed) passes only when SPIN finds the counterexample, whose trail is replayed
(``spin -t``) and rendered as a timeline, one line per step, as the race timelines in the
code's docstrings::

    t=0   w1 begin: claims K with fence 1 (takeover 0), lease for 3 ticks
    t=1   w1 confirm_lease: heartbeat, lease for 3 ticks, send bound in 1
    ->    violated: P1 at most one effect per intent at the downstream

Safety checks run depth-first with lossless state compression (``-DCOLLAPSE``); refutations
run breadth-first (``-DBFS``) so the trail is the shortest one; the progress check searches
for acceptance cycles under weak fairness (``pan -a -f``). Nothing is approximated: no
bitstate hashing. README.md beside this file maps every model step to its code.
"""

from __future__ import annotations

import re
import shutil
import subprocess  # nosec B404: runs spin, gcc and the verifier it built, fixed argv
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MODEL_DIR = Path(__file__).resolve().parent
DEPTH = 3_000_000
"""pan's search depth bound (-m): far above any depth the checks reach, so none is cut."""
BFS_MEMORY_MB = 512
"""The breadth-first search for a short counterexample stops at this much memory."""
TIMEOUT = 900.0
"""Seconds one check may take in all (compile, verify, replay) before it counts as failed."""

# Each part of a check's configuration, once.
TAKEOVER = ("NO_CANCEL", "MAX_REPLAY=0", "MAX_KILLS=1", "NO_BATCH", "MAX_REDELIVER=1",
            "MAX_LOST=1", "L=3", "MAXA=1")
LONG_LEASE = ("NO_CANCEL", "MAX_REPLAY=0", "MAX_KILLS=1", "NO_BATCH", "MAX_REDELIVER=1",
              "MAX_LOST=1", "L=5", "B=2", "MAXA=1")
"""TAKEOVER with a lease of 5 ticks, so the send bound (2) is more than the model's one-tick
grain: a settle window of the provider's time plus one tick is then shorter than P + B."""
CANCEL = ("MAX_REPLAY=0", "MAX_KILLS=0", "NO_BATCH", "MAX_REDELIVER=1", "MAX_LOST=1", "L=3",
          "MAXA=1")
RETRY_REPLAY = ("NO_CANCEL", "MAX_REPLAY=1", "MAX_KILLS=1", "NO_BATCH", "MAX_REDELIVER=0",
                "MAX_LOST=1", "L=3", "MAXA=2")
BATCH = ("NO_CANCEL", "MAX_REPLAY=0", "MAX_KILLS=1", "MAX_REDELIVER=1", "MAX_LOST=0", "L=3",
         "MAXA=1", "BATCH_REDELIVERY")
PROGRESS = ("PROGRESS", "NO_CANCEL", "MAX_REPLAY=0", "MAX_KILLS=1", "NO_BATCH",
            "MAX_REDELIVER=0", "MAX_LOST=1", "L=3", "MAXA=1")

PROPERTIES = {
    "charges<=1": "P1 at most one effect per intent at the downstream",
    "assert(0)": "P2 no request ends without a decision",
    "w_fence[i]>=o_fence": "P3 no business write by a holder with a stale fence",
    "l_status==": "P4 no send after the holder's bound (its lease could be taken over)",
    "r_status!=": "P5 a cancelled request produces no effect",
    "mode==": "P6 a replay of a completed request produces none",
    "me>=last_writer": "P7 no write by a holder whose Redis fence is stale",
    "acceptance cycle": "P8 progress: every request ends once the faults stop",
}


@dataclass(frozen=True)
class Check:
    """One verification: a model, its switches, what kind of search, what must come out."""

    name: str
    model: str
    defines: tuple[str, ...]
    expect: str  # "verifies" | "refuted"
    role: str  # "real" | "broken" | "finding" (the code before a finding's fix)
    says: str
    liveness: bool = False
    shortest: bool = True
    """For a refutation: look breadth-first for the shortest counterexample first."""

    def spin_args(self) -> list[str]:
        return [f"-D{d}" for d in self.defines]


CHECKS: tuple[Check, ...] = (
    Check("takeover", "ledger.pml", TAKEOVER, "verifies", "real",
          "two deliveries of one request, takeover after a pause, a kill, a lost answer: "
          "P1-P4"),
    Check("takeover_long_lease", "ledger.pml", LONG_LEASE, "verifies", "real",
          "takeover with a lease of 5 ticks, send bound 2, the settle window P + B: P1-P4"),
    Check("retry_replay", "ledger.pml", RETRY_REPLAY, "verifies", "real",
          "retries after an unanswered charge, a kill, the operator's replay: P1-P4, P6"),
    Check("batch", "ledger.pml", BATCH, "verifies", "real",
          "a micro-batch member beside a per-request run: group claims, run_alone, crash "
          "counts: P1-P4"),
    Check("progress", "ledger.pml", PROGRESS, "verifies", "real",
          "every request ends under weak fairness once the faults stop: P8", liveness=True),
    Check("redis_fence", "redis_fence.pml", (), "verifies", "real",
          "the Redis fence with its monotonic floor, Redis losing recent writes: P7"),
    Check("no_fence_check", "ledger.pml", (*TAKEOVER, "NO_FENCE_CHECK"), "refuted", "broken",
          "fenced_update without its fence condition: a stale holder writes the order"),
    Check("no_send_bound", "ledger.pml", (*TAKEOVER, "NO_SEND_BOUND"), "refuted", "broken",
          "BoundedHttp without the send bound: a paused holder sends after a takeover"),
    Check("resend_no_lookup", "ledger.pml", (*TAKEOVER, "RESEND_NO_LOOKUP"), "refuted",
          "broken", "after an unanswered charge the retry charges again without a lookup",
          shortest=False),
    Check("no_settle_wait", "ledger.pml", (*TAKEOVER, "NO_SETTLE_WAIT"), "refuted", "broken",
          "the takeover looks up at once, before the settle window"),
    Check("settle_provider_only", "ledger.pml", (*LONG_LEASE, "W=2"), "refuted", "broken",
          "a settle window only longer than the provider's processing time (P + 1 < P + B): "
          "a send leaving within its bound is committed after the lookup"),
    Check("redis_no_floor", "redis_fence.pml", ("REDIS_NO_FLOOR",), "refuted", "broken",
          "the Redis fence as INCR alone: a Redis that lost writes hands out a lower fence"),
    Check("cancel", "ledger.pml", CANCEL, "verifies", "real",
          "a cancel beside a delivery and a redelivery that gives up on AlreadyInProgress, a "
          "lost answer: P1-P5"),
    Check("cancel_at_once", "ledger.pml", (*CANCEL, "OLD_CANCEL_AT_ONCE"), "refuted",
          "broken", "RequestStore.cancel ends a failed request at once though a live holder "
          "holds its key: the holder, past its cancel point, sends"),
    Check("cancel_point_skips_recovery", "ledger.pml", (*CANCEL, "OLD_CANCEL_POINT"),
          "refuted", "broken",
          "the cancel point before a downstream call skipped for an earlier attempt's "
          "recovery point: a delivery claiming the key after the cancel sends"),
    Check("finding_settle_window", "ledger.pml", (*TAKEOVER, "OLD_SEND_BOUND"),
          "refuted", "finding",
          "the code before the fix: the send bound counted from the confirmation alone, so "
          "a send leaves after charge_sent_at + 0.4 L and a lookup at sent_at + window misses"),
    Check("finding_cancel", "ledger.pml", (*CANCEL, "OLD_CANCEL_AT_ONCE", "OLD_CANCEL_POINT"),
          "refuted", "finding",
          "the code before the fix: a request cancelled at once from failed (a redelivery gave "
          "up on AlreadyInProgress) while another delivery holds its key and then sends"),
)


@dataclass
class Result:
    """What one check found: SPIN's numbers, and the counterexample if there was one."""

    name: str
    role: str
    expect: str
    says: str
    command: str
    outcome: str = "error"  # "verified" | "refuted" | "error"
    passed: bool = False
    states_stored: int | None = None
    states_visited: int | None = None
    transitions: int | None = None
    depth: int | None = None
    state_vector_bytes: int | None = None
    memory_mb: float | None = None
    seconds: float | None = None
    wall_seconds: float | None = None
    violated: str | None = None
    property: str | None = None
    timeline: list[str] = field(default_factory=list)
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class ToolMissing(RuntimeError):
    """spin or gcc is not installed: ``apt-get install spin gcc`` (Debian), then run again."""


def find_check(name: str) -> Check:
    for check in CHECKS:
        if check.name == name:
            return check
    known = ", ".join(c.name for c in CHECKS)
    raise KeyError(f"no check named {name!r}; the checks are: {known}")


def require_tools() -> None:
    missing = [tool for tool in ("spin", "gcc") if shutil.which(tool) is None]
    if missing:
        raise ToolMissing(
            f"{' and '.join(missing)} not found: install with `apt-get install spin gcc`"
        )


def _run(argv: Sequence[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # nosec B603: fixed tools, arguments from the check table
        list(argv), cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False
    )


def _number(pattern: str, text: str) -> float | None:
    found = re.search(pattern, text)
    return float(found.group(1)) if found else None


def parse_pan(output: str, result: Result) -> None:
    """Fill ``result`` from the verifier's report."""
    vector = re.search(r"State-vector (\d+) byte, depth reached (\d+), errors: (\d+)", output)
    if vector is None:
        result.error = "no report from the verifier: " + output.strip()[-400:]
        return
    result.state_vector_bytes, result.depth = int(vector.group(1)), int(vector.group(2))
    errors = int(vector.group(3))
    stored = re.search(r"([\d.e+]+) states, stored(?: \(([\d.e+]+) visited\))?", output)
    if stored:
        result.states_stored = int(float(stored.group(1)))
        if stored.group(2):
            result.states_visited = int(float(stored.group(2)))
    transitions = _number(r"([\d.e+]+) transitions", output)
    result.transitions = int(transitions) if transitions is not None else None
    result.memory_mb = _number(r"([\d.]+)\s+total actual memory usage", output)
    result.seconds = _number(r"pan: elapsed time ([\d.e+]+) seconds", output)
    if "max search depth too small" in output or "Search not completed" in output and not errors:
        result.error = "the search was cut short (depth or memory): not exhaustive"
        return
    first = re.search(r"pan:1: (.*)", output)
    if errors:
        result.outcome = "refuted"
        result.violated = first.group(1).strip() if first else "an error"
        result.property = describe(result.violated)
    else:
        result.outcome = "verified"


def describe(violated: str) -> str:
    """The property a violation message names (the assertion's text, or a cycle)."""
    squeezed = violated.replace(" ", "")
    for needle, name in PROPERTIES.items():
        if needle.replace(" ", "") in squeezed:
            return name
    return violated


def render(trail: str) -> list[str]:
    """The replayed trail as a timeline: the model's ``EV`` lines with their tick, the ticks
    counted from ``TICK`` lines, and the violation last."""
    out: list[str] = []
    tick = 0
    violation = None
    for raw in trail.splitlines():
        line = raw.strip()
        if line == "TICK":
            tick += 1
        elif line.startswith("EV ") and violation is None:
            out.append(f"t={tick:<3} {_words(line[3:])}")
        elif "START OF CYCLE" in line:
            out.append(f"t={tick:<3} ... from here on the run repeats forever, undecided")
        elif line.startswith("spin: text of failed assertion:") and violation is None:
            text = line.split(":", 2)[2].strip()
            violation = f"->    violated: {describe(text)}  [{text}]"
    if violation is not None:
        out.append(violation)
    return out


_NAMES = {
    "R_PENDING": "pending", "R_RUNNING": "running", "R_COMPLETED": "completed",
    "R_FAILED": "failed", "R_CANCELLED": "cancelled", "D_NONE": "none", "D_OPEN": "open",
    "D_REPLAY": "replay requested", "D_RESOLVED": "resolved", "D_CLOSED": "closed",
    "O_PENDING": "payment_pending", "O_CNC": "charged_not_confirmed", "O_PAID": "paid",
    "O_ABSENT": "absent", "RETRYABLE": "retryable", "FAILED": "failed", "INP": "in_progress",
    "COMPLETED": "completed", "ABSENT": "absent", "E_TRANSIENT": "transient",
    "E_PERMANENT": "permanent", "E_LEASE_LOST": "LeaseLost", "E_FENCED": "FencedWriteRejected",
    "E_CANCELLED": "RequestCancelled", "E_DONE": "done", "E_NONE": "ok", "SOLO": "per-request",
    "BATCH": "micro-batch", "REPLAY": "replay", "E_DUPLICATE": "duplicate",
}


def _words(text: str) -> str:
    return re.sub(r"\b[A-Z][A-Z_]+\b", lambda m: _NAMES.get(m.group(0), m.group(0)), text)


def run_check(check: Check, *, timeout: float = TIMEOUT) -> Result:
    """Verify one check in a scratch folder; never raises for what SPIN finds."""
    require_tools()
    if check.liveness:
        searches = [(["-DCOLLAPSE", "-DNFAIR=4"], ["-a", "-f", f"-m{DEPTH}"])]
    elif check.expect == "refuted" and check.shortest:
        # breadth-first within a memory cap gives the shortest counterexample; a deep one
        # that does not fit is found depth-first
        searches = [(["-DSAFETY", "-DBFS", f"-DMEMLIM={BFS_MEMORY_MB}"], []),
                    (["-DSAFETY", "-DCOLLAPSE"], [f"-m{DEPTH}"])]
    else:
        searches = [(["-DSAFETY", "-DCOLLAPSE"], [f"-m{DEPTH}"])]
    result = Result(check.name, check.role, check.expect, check.says, "")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"sekali-model-{check.name}-") as scratch:
        work = Path(scratch)
        shutil.copy(MODEL_DIR / check.model, work / check.model)
        try:
            for cflags, flags in searches:
                result = _search(check, work, cflags, flags, timeout)
                if result.error is not None or result.outcome == "refuted":
                    break
        except subprocess.TimeoutExpired:
            result.error = f"took longer than {timeout:.0f} s"
    return _finish(result, started)


def _search(
    check: Check, work: Path, cflags: list[str], flags: list[str], timeout: float
) -> Result:
    """One search: build the verifier with ``cflags``, run it with ``flags``, replay a trail."""
    defines = check.spin_args()
    cflags = ["-w", "-O2", *cflags]
    command = (f"spin -a {' '.join([*defines, check.model])} && gcc {' '.join(cflags)} "
               f"-o pan pan.c && {' '.join(['./pan', *flags])}")
    result = Result(check.name, check.role, check.expect, check.says, command)
    for argv in (["spin", "-a", *defines, check.model], ["gcc", *cflags, "-o", "pan", "pan.c"]):
        done = _run(argv, work, timeout)
        if done.returncode != 0:
            result.error = f"{argv[0]} failed: {(done.stderr or done.stdout)[-600:]}"
            return result
    verified = _run(["./pan", *flags], work, timeout)
    parse_pan(verified.stdout + verified.stderr, result)
    if result.outcome == "refuted":
        trail = _run(["spin", "-t", *defines, check.model], work, timeout)
        result.timeline = render(trail.stdout)
    elif "-DBFS" in cflags and result.error is not None:
        result.error = None  # the breadth-first search ran out of its memory: go depth-first
        result.outcome = "incomplete"
    return result


def _finish(result: Result, started: float) -> Result:
    result.wall_seconds = round(time.monotonic() - started, 2)
    wanted = "verified" if result.expect == "verifies" else "refuted"
    result.passed = result.error is None and result.outcome == wanted
    return result


def run_checks(names: Iterable[str] | None = None, *, progress: Any = None) -> list[Result]:
    """Run the named checks (all by default), in the table's order; ``progress(result)`` hears
    each result as it comes."""
    chosen = list(CHECKS) if not names else [find_check(n) for n in names]
    results = []
    for check in chosen:
        result = run_check(check)
        if progress is not None:
            progress(result)
        results.append(result)
    return results
