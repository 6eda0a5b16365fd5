"""Worker functions that the idempotency tests run in other processes (spawn context).

They live at module level in an importable module so ``multiprocessing`` with ``spawn`` and plain
``subprocess`` can reach them. Each one opens its own store on the URL it is given.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import text

from resources.idempotency import AlreadyInProgress, Claim, Completed, IdempotencyStore
from resources.storage.db import Database

EFFECTS_DDL = "CREATE TABLE IF NOT EXISTS effects (key TEXT NOT NULL, worker TEXT NOT NULL)"
"""The side effect of the race: deliberately no unique constraint, so a duplicate would show."""

PHASE_EFFECTS_DDL = (
    "CREATE TABLE IF NOT EXISTS phase_effects"
    " (key TEXT NOT NULL, phase TEXT NOT NULL, fence INTEGER NOT NULL)"
)
PHASES = ("reserve", "charge", "notify")


def record_effect(db: Database, key: str, worker: str) -> None:
    with db.transaction() as conn:
        conn.execute(
            text("INSERT INTO effects (key, worker) VALUES (:k, :w)"), {"k": key, "w": worker}
        )


def race_worker(
    url: str, keys: list[str], threads: int, start_at: float, seed: int
) -> dict[str, Any]:
    """``threads`` threads call ``run_once`` on every key (each in its own shuffled order).

    Starts at wall-clock ``start_at`` so all processes hit the keys together. Returns how many
    calls ran the effect and whether every call got the right result back.
    """
    db = Database.from_url(url, pool_size=threads // 2, max_overflow=0)
    store = IdempotencyStore(db, lease_seconds=60.0)
    ran = 0
    wrong: list[str] = []
    errors: list[str] = []
    lock = threading.Lock()

    def one_thread(n: int) -> None:
        nonlocal ran
        order = list(keys)
        random.Random(seed * 1000 + n).shuffle(order)
        for key in order:

            def effect(key: str = key) -> dict[str, str]:
                nonlocal ran
                record_effect(db, key, f"{os.getpid()}:{n}")
                with lock:
                    ran += 1
                return {"key": key}

            try:
                result = store.run_once(key, effect, payload={"key": key}, wait=120.0)
            except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
                with lock:
                    errors.append(f"{key}: {exc!r}")
                continue
            if result != {"key": key}:
                with lock:
                    wrong.append(f"{key}: {result!r}")

    time.sleep(max(0.0, start_at - time.time()))
    workers = [threading.Thread(target=one_thread, args=(n,)) for n in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    db.dispose()
    return {"ran": ran, "wrong": wrong, "errors": errors}


def batch_race_worker(
    url: str, keys: list[str], threads: int, start_at: float, seed: int, batch: int
) -> dict[str, Any]:
    """Like :func:`race_worker`, but even threads claim and complete in batches of ``batch``
    keys (``begin_many`` / ``complete_many``) while odd threads call ``run_once`` per key, so
    batches race batches and single claims. A key found in progress is asked again later."""
    db = Database.from_url(url, pool_size=max(1, threads // 2), max_overflow=0)
    store = IdempotencyStore(db, lease_seconds=60.0)
    ran = 0
    wrong: list[str] = []
    errors: list[str] = []
    lock = threading.Lock()

    def note(bucket: list[str], line: str) -> None:
        with lock:
            bucket.append(line)

    def effect(key: str, n: int) -> dict[str, str]:
        nonlocal ran
        record_effect(db, key, f"{os.getpid()}:{n}")
        with lock:
            ran += 1
        return {"key": key}

    def batched(n: int, order: list[str]) -> None:
        deadline = time.monotonic() + 120
        while order and time.monotonic() < deadline:
            later: list[str] = []
            for i in range(0, len(order), batch):
                chunk = order[i : i + batch]
                outs = store.begin_many([(key, {"key": key}) for key in chunk])
                done: list[tuple[Claim, Any]] = []
                for key, out in zip(chunk, outs, strict=True):
                    if isinstance(out, Claim):
                        done.append((out, effect(key, n)))
                    elif isinstance(out, Completed):
                        if out.result != {"key": key}:
                            note(wrong, f"{key}: {out.result!r}")
                    elif isinstance(out, AlreadyInProgress):
                        later.append(key)
                    else:
                        note(errors, f"{key}: {out!r}")
                for (claim, _), lost in zip(done, store.complete_many(done), strict=True):
                    if lost is not None:
                        note(errors, f"{claim.key}: {lost!r}")
            order = later
            if order:
                time.sleep(0.01)
        for key in order:
            note(errors, f"{key}: still in progress after 120 s")

    def single(n: int, order: list[str]) -> None:
        for key in order:
            try:
                result = store.run_once(
                    key, lambda key=key: effect(key, n), payload={"key": key}, wait=120.0
                )
            except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
                note(errors, f"{key}: {exc!r}")
                continue
            if result != {"key": key}:
                note(wrong, f"{key}: {result!r}")

    def one_thread(n: int) -> None:
        order = list(keys)
        random.Random(seed * 1000 + n).shuffle(order)
        try:
            (batched if n % 2 == 0 else single)(n, order)
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
            note(errors, f"thread {n}: {exc!r}")

    time.sleep(max(0.0, start_at - time.time()))
    workers = [threading.Thread(target=one_thread, args=(n,)) for n in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    db.dispose()
    return {"ran": ran, "wrong": wrong, "errors": errors}


def claim_to_json(claim: Claim) -> str:
    return json.dumps(
        {
            "key": claim.key,
            "owner_token": claim.owner_token,
            "fence": claim.fence,
            "attempt": claim.attempt,
            "lease_expires_at": claim.lease_expires_at,
            "payload_hash": claim.payload_hash,
        }
    )


def claim_from_json(data: str) -> Claim:
    d = json.loads(data)
    return Claim(
        key=d["key"],
        owner_token=d["owner_token"],
        fence=d["fence"],
        attempt=d["attempt"],
        lease_expires_at=d["lease_expires_at"],
        recovery_point=None,
        recovery_data=None,
        takeover=False,
        payload_hash=d["payload_hash"],
    )


def run_phases(
    store: IdempotencyStore,
    key: str,
    *,
    after_begin: Callable[[Claim], None] | None = None,
    inside_phase: Callable[[Claim, str], None] | None = None,
    between_phases: Callable[[Claim, str], None] | None = None,
) -> Claim | Completed:
    """A multi-phase job: each phase's effect commits in one transaction with its checkpoint.

    Resumes after the claim's recovery point, so a takeover never repeats a committed phase.
    The hooks let a test stop the worker at a chosen moment.
    """
    outcome = store.begin(key, payload={"job": "phases", "key": key})
    if isinstance(outcome, Completed):
        return outcome
    claim = outcome
    if after_begin:
        after_begin(claim)
    start = PHASES.index(claim.recovery_point) + 1 if claim.recovery_point else 0
    for phase in PHASES[start:]:
        with store.db.transaction() as conn:
            conn.execute(
                text("INSERT INTO phase_effects (key, phase, fence) VALUES (:k, :p, :f)"),
                {"k": key, "p": phase, "f": claim.fence},
            )
            if inside_phase:
                inside_phase(claim, phase)
            store.checkpoint(claim, phase, {"done": phase, "fence": claim.fence}, conn=conn)
        if between_phases:
            between_phases(claim, phase)
    store.complete(claim, {"phases": list(PHASES), "fence": claim.fence})
    return claim


def phase_victim(url: str, key: str, stop_where: str, stop_phase: str, state_dir: str) -> None:
    """Run the phases with a 30 s lease and hang at the chosen moment until SIGKILLed.

    Writes the claim to ``claim.json`` right after ``begin`` and touches ``ready`` when it hangs,
    so the test knows when to kill it and can later play the dead owner's late ``complete``.
    """
    state = Path(state_dir)
    db = Database.from_url(url, pool_size=2, max_overflow=0)
    store = IdempotencyStore(db, lease_seconds=30.0)

    def hang(claim: Claim, phase: str) -> None:
        if phase == stop_phase:
            (state / "ready").write_text(phase)
            while True:
                time.sleep(1)

    def save(claim: Claim) -> None:
        (state / "claim.json").write_text(claim_to_json(claim))

    if stop_where == "between":
        run_phases(store, key, after_begin=save, between_phases=hang)
    else:
        run_phases(store, key, after_begin=save, inside_phase=hang)


def migrate_worker(url: str, start_at: float) -> list[str]:
    """Apply ``sql/`` on ``url`` from wall-clock ``start_at``; return what this one applied."""
    from resources.storage.migrations import upgrade  # noqa: PLC0415

    db = Database.from_url(url, pool_size=1, max_overflow=0)
    time.sleep(max(0.0, start_at - time.time()))
    try:
        return upgrade(db)
    finally:
        db.dispose()


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)
