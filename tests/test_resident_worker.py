"""Resident workers (:mod:`engine.worker`): requests claimed as they arrive and run through the
one step entry, by long-lived worker processes. Real SQLite and Postgres, a real Redis for the
wake-ups, a real SMTP sink counting what arrived, real processes and signals.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import bindparam, text

from engine import JobContext, JobType, Keying, Queue, Running
from engine.delivery import Delivery, DeliveryPolicy
from engine.intake import enqueue
from engine.registry import JOB_TYPES
from engine.requests import RequestStatus, RequestStore
from engine.tenants import TenantStore
from engine.worker import WorkerPolicy
from resources.dlq import DlqStore, FailureClass
from resources.errors import PermanentJobError, TransientJobError
from resources.idempotency import IdempotencyStore
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from resources.storage.settings import DEFAULT_SMTP_CONNECTIONS
from resources.wakeup import RedisWakeup
from sandbox.mailsink import MailSink
from tests.worker_procs import worker

ROOT = Path(__file__).resolve().parent.parent


def email(i: int, tag: str = "w") -> dict[str, Any]:
    return {"template": "welcome", "user_id": f"{tag}{i}", "date": "2026-12-01",
            "to": f"{tag}{i}@example.com"}


@pytest.fixture
def wake_env(monkeypatch: pytest.MonkeyPatch, redis_url: str, namespace: str) -> None:
    """Enqueues in this process wake the tests' workers (same Redis, same namespace)."""
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("SEKALI_WAKEUP_NAMESPACE", namespace)
    monkeypatch.delenv("SEKALI_INTAKE_MODE", raising=False)
    monkeypatch.delenv("SEKALI_INTAKE_MODES", raising=False)


def _spec(db_url: str, redis_url: str, namespace: str, sink: MailSink, owner: str,
          **more: Any) -> dict[str, Any]:
    return {"db_url": db_url, "redis_url": redis_url, "smtp_port": sink.port,
            "smtp_log_url": sink.db_url, "owner": owner,
            "namespace": namespace, "queue": "light", "batch": 10, "poll": 0.2, **more}


def _spawn(spec: dict[str, Any], **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.worker_procs", json.dumps(spec)], cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
    )


def _wait_for(predicate: Any, timeout: float = 120.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _mails(sink: MailSink) -> Counter[str]:
    return Counter(m["message_id"] for m in sink.messages())


def test_the_default_delivery_is_resident_and_a_job_type_may_ask_for_its_own_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Catches: built-in job types still launched one run each by default, an override that
    does not win, or a job type's own ``delivery`` ignored (the intake sensor and the workers
    would then both claim its requests, or neither)."""
    monkeypatch.delenv("SEKALI_INTAKE_MODE", raising=False)
    monkeypatch.delenv("SEKALI_INTAKE_MODES", raising=False)
    policy = DeliveryPolicy.from_env()
    assert policy.launched() == []
    assert set(policy.resident()) == set(JOB_TYPES)
    own = JobType(
        name="own_runs",
        queue=Queue.HEAVY,
        validate=dict,
        handler=lambda c, p: None,
        side_effect=False,
        keying=Keying(key_for=lambda p: "k", resource_id=lambda p: "r"),
        running=Running(max_runtime_seconds=60, delivery="per_request"),
    )
    monkeypatch.setitem(JOB_TYPES, "own_runs", own)
    policy = DeliveryPolicy.from_env({"SEKALI_INTAKE_MODES": "send_email=micro_batch"})
    assert policy.of("own_runs") is Delivery.PER_REQUEST
    assert policy.of("send_email") is Delivery.MICRO_BATCH
    assert "own_runs" not in policy.resident("heavy")
    assert set(policy.launched()) == {"own_runs", "send_email"}
    with pytest.raises(Exception, match="SEKALI_INTAKE_MODE"):
        DeliveryPolicy.from_env({"SEKALI_INTAKE_MODE": "sometimes"})


def test_worker_processes_drain_a_backlog_once_each(
    db_url: str, redis_url: str, namespace: str, sink: MailSink, wake_env: None
) -> None:
    """Catches: two workers claiming the same request (a mail twice), a request no worker
    takes, or a worker that stops at its first empty claim. Three processes, one backlog."""
    db = Database.from_url(db_url)
    upgrade(db)
    ids = [enqueue("send_email", email(i), db=db).id for i in range(300)]
    procs = [_spawn(_spec(db_url, redis_url, namespace, sink, f"worker-{n}", idle=3.0,
                          batch=5))
             for n in range(3)]
    outs = [json.loads(p.communicate(timeout=240)[0].strip().splitlines()[-1]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    requests = RequestStore(db)
    assert requests.counts()[RequestStatus.COMPLETED] == 300
    mails = _mails(sink)
    assert len(mails) == 300 and set(mails.values()) == {1}
    assert sum(o["requests"] for o in outs) == 300
    assert sum(1 for o in outs if o["requests"]) >= 2  # the backlog was shared
    assert all(o["reason"].startswith("idle") for o in outs)
    with db.statement() as conn:
        owners = {r[0] for r in conn.execute(
            text("SELECT DISTINCT run_id FROM job_requests WHERE id IN :ids").bindparams(
                bindparam("ids", expanding=True)), {"ids": ids})}
    assert owners <= {"worker-0", "worker-1", "worker-2"}  # the request names its worker
    db.dispose()


def _flaky_then_fine(ctx: JobContext, payload: dict[str, Any]) -> dict[str, Any]:
    if payload["n"] == "bad":
        raise PermanentJobError("the request is wrong for good")
    if payload["n"] == "flaky" and ctx.attempt.attempt < 2:
        raise TransientJobError("the downstream did not answer")
    return {"n": payload["n"]}


def test_failures_are_decided_in_the_worker_which_goes_on(
    db_url: str, redis_url: str, namespace: str, sink: MailSink, wake_env: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Catches: a transient failure that blocks the worker or fails its neighbours, a retry not
    given back to the queue with its delay, and a permanent one that reaches the DLQ only when a
    run fails: its record is written by the decision, with the request ``failed``, while the
    worker keeps claiming."""
    monkeypatch.setitem(JOB_TYPES, "flaky_probe", JobType(
        name="flaky_probe",
        queue=Queue.LIGHT,
        validate=dict,
        handler=_flaky_then_fine,
        side_effect=False,
        keying=Keying(key_for=lambda p: f"flaky:{p['n']}", resource_id=lambda p: p["n"]),
        running=Running(max_runtime_seconds=60),
    ))
    db = Database.from_url(db_url)
    upgrade(db)
    ids = {n: enqueue("flaky_probe", {"n": n}, db=db).id for n in ("ok", "flaky", "bad")}
    stop = threading.Event()
    spec = _spec(db_url, redis_url, namespace, sink, "worker-f", max_attempts=5)
    w = worker(spec, stop)
    reports: list[Any] = []
    w.on_progress = reports.append
    first, _ = w.run_once()
    by_id = {r.request.request_id: r for r in first if r.request is not None}
    assert by_id[ids["ok"]].outcome is not None
    assert by_id[ids["flaky"]].retry_at is not None  # given back, with its delay
    dead = by_id[ids["bad"]].dead_letter
    assert dead is not None  # written where it was decided
    requests, dlq = RequestStore(db), DlqStore(db)
    record = dlq.get(dead.record_id)
    assert record.request_id == ids["bad"] and record.error_class == FailureClass.PERMANENT
    assert record.run_id == "worker-f" and record.step == "worker[light]"
    bad = requests.get(ids["bad"])
    assert bad is not None and bad.status is RequestStatus.FAILED
    flaky = requests.get(ids["flaky"])
    assert flaky is not None and flaky.status is RequestStatus.PENDING
    assert flaky.available_at is not None and flaky.available_at > flaky.updated_at - 1
    assert flaky.last_error and "did not answer" in flaky.last_error
    # the worker goes on: the flaky request comes back after its delay, until it completes
    thread = threading.Thread(target=w.run)
    thread.start()
    _wait_for(lambda: requests.get(ids["flaky"]).status is RequestStatus.COMPLETED,  # type: ignore[union-attr]
              what="the flaky request to complete")
    stop.set()
    thread.join(timeout=30)
    done = requests.get(ids["flaky"])
    assert done is not None and done.attempts == 3
    assert len(dlq.list_records()) == 1
    assert any(r.total for r in reports)
    db.dispose()


def test_an_idle_worker_is_woken_by_the_enqueue(
    db_url: str, redis_url: str, namespace: str, sink: MailSink, wake_env: None
) -> None:
    """Catches: a worker that only polls (the request waits a whole poll interval): the enqueue
    pushes a wake-up the waiting worker receives. The worker's poll is a minute here, so only a
    wake-up can run the request before the test's own bound."""
    db = Database.from_url(db_url)
    upgrade(db)
    wakeup = RedisWakeup(redis_url, namespace=namespace)
    woken: list[bool] = []
    waits = threading.Event()

    class Recording:
        def notify(self, channel: str) -> None:
            wakeup.notify(channel)

        def wait(self, channel: str, timeout: float) -> bool:
            waits.set()
            woken.append(wakeup.wait(channel, timeout))
            return woken[-1]

    stop = threading.Event()
    w = worker(_spec(db_url, redis_url, namespace, sink, "worker-w", poll=60.0), stop)
    w.wakeup = Recording()
    thread = threading.Thread(target=w.run)
    thread.start()
    assert waits.wait(30)  # idle: waiting
    request = enqueue("send_email", email(1, "wake"), db=db)
    requests = RequestStore(db)
    _wait_for(lambda: requests.get(request.id).status is RequestStatus.COMPLETED,  # type: ignore[union-attr]
              timeout=30, what="the request to complete")
    stop.set()
    wakeup.notify("light")  # end the current wait
    thread.join(timeout=30)
    assert woken[0] is True
    assert len(_mails(sink)) == 1
    db.dispose()


def test_one_wake_up_answers_every_wake_up_pushed_before_it(
    redis_url: str, namespace: str
) -> None:
    """Catches: a consumer that pays a claim per stale wake-up. Requests that arrived while it
    was busy were taken by the claims it made meanwhile; one wait consumes all their tokens,
    so the next wait blocks (here: returns False at its timeout) instead of waking at once."""
    wakeup = RedisWakeup(redis_url, namespace=namespace)
    for _ in range(5):
        wakeup.notify("light")
    assert wakeup.wait("light", 5.0) is True
    assert wakeup.wait("light", 0.2) is False
    wakeup.notify("light")  # one pushed after the wait is kept for the next
    assert wakeup.wait("light", 5.0) is True
    wakeup.close()


def test_a_worker_whose_claim_came_back_full_wakes_another(
    db_url: str, redis_url: str, namespace: str, sink: MailSink, wake_env: None
) -> None:
    """Catches: a backlog drained by the one worker that was woken while the others sleep
    until their poll (one wake-up answers all those before it, so the backlog's own are
    gone): a claim that took a full batch pushes a wake-up for another worker; one that took
    less (the queue is empty behind it) pushes none."""
    db = Database.from_url(db_url)
    upgrade(db)
    for i in range(7):
        enqueue("send_email", email(i, "full"), db=db)
    wakeup = RedisWakeup(redis_url, namespace=namespace)
    assert wakeup.wait("light", 5.0) is True  # the enqueues' own wake-ups, consumed
    w = worker(_spec(db_url, redis_url, namespace, sink, "worker-full", batch=5))
    results, _ = w.run_once()
    assert len(results) == 5
    assert wakeup.wait("light", 5.0) is True  # a full batch: another worker is woken
    results, _ = w.run_once()
    assert len(results) == 2
    assert wakeup.wait("light", 0.2) is False  # the rest fitted: nobody else to wake
    assert len(_mails(sink)) == 7
    wakeup.close()
    db.dispose()


def test_a_claim_says_whether_it_left_anything_claimable(db: Database) -> None:
    """Catches: a page called drained while requests it could have taken wait (a full page,
    or one the scheduler cut because a tenant is held at its maximum share: the worker would
    then wait a poll instead of claiming them), or one never called drained (the worker pays
    an empty claim after every batch). Plain claim order and fair share alike."""
    for fair in (False, True):
        requests = RequestStore(db, fair=fair)
        for i in range(7):
            requests.enqueue("send_email", f"email:welcome:d{fair}{i}:2026-12-01",
                             email(i, f"d{fair}"), queue="light")
        full = requests.claim_for_worker(4, owner="w", job_types=["send_email"])
        assert (len(full), full.drained) == (4, False)
        rest = requests.claim_for_worker(4, owner="w", job_types=["send_email"])
        assert (len(rest), rest.drained) == (3, True)
        nothing = requests.claim_for_worker(4, owner="w", job_types=["send_email"])
        assert (len(nothing), nothing.drained) == (0, True)
    TenantStore(db).set("capped", weight=1.0, max_share=0.5)
    requests = RequestStore(db)
    for i in range(6):
        requests.enqueue("send_email", f"email:welcome:cap{i}:2026-12-01", email(i, "cap"),
                         queue="light", tenant="capped")
    cut = requests.claim_for_worker(4, owner="w", job_types=["send_email"])
    assert (len(cut), cut.drained) == (2, False)  # held at half of the page: more wait


def test_a_worker_that_keeps_up_makes_one_claim_per_request(
    db_url: str, redis_url: str, namespace: str, sink: MailSink, wake_env: None
) -> None:
    """Catches: a worker that claims again after every batch although its claim left nothing
    behind (an empty claim, with the scheduler's lock and a commit, per request) when requests
    arrive one at a time: here each after the last completed, each claimed by one claim."""
    db = Database.from_url(db_url)
    upgrade(db)
    wakeup = RedisWakeup(redis_url, namespace=namespace)
    waiting = threading.Event()

    class Recording:
        def notify(self, channel: str) -> None:
            wakeup.notify(channel)

        def wait(self, channel: str, timeout: float) -> bool:
            waiting.set()
            return wakeup.wait(channel, timeout)

    stop = threading.Event()
    w = worker(_spec(db_url, redis_url, namespace, sink, "worker-one", poll=60.0), stop)
    w.wakeup = Recording()
    pages: list[int] = []
    claim = w.requests.claim_for_worker

    def counted(*args: Any, **kwargs: Any) -> Any:
        page = claim(*args, **kwargs)
        pages.append(len(page))
        return page

    w.requests.claim_for_worker = counted  # type: ignore[method-assign]
    thread = threading.Thread(target=w.run)
    thread.start()
    assert waiting.wait(30)  # idle: its first claim found nothing
    requests = RequestStore(db)
    for i in range(4):
        request_id = enqueue("send_email", email(i, "one"), db=db).id
        _wait_for(lambda rid=request_id: requests.get(rid).status  # type: ignore[misc,union-attr]
                  is RequestStatus.COMPLETED, timeout=30, what="the request to complete")
    stop.set()
    wakeup.notify("light")  # end the current wait
    thread.join(timeout=30)
    assert pages == [0, 1, 1, 1, 1]
    assert len(_mails(sink)) == 4
    wakeup.close()
    db.dispose()


@contextlib.contextmanager
def _telling_worker(db_url: str, redis_url: str, namespace: str, sink: MailSink, owner: str,
                    progress: float) -> Iterator[list[Any]]:
    """A worker running in a thread (poll a minute: only wake-ups move it) whose tellings are
    the yielded list; stopped, and its wait ended, on the way out."""
    wakeup = RedisWakeup(redis_url, namespace=namespace)
    stop = threading.Event()
    w = worker(_spec(db_url, redis_url, namespace, sink, owner, poll=60.0, progress=progress),
               stop)
    told: list[Any] = []
    w.on_progress = told.append
    thread = threading.Thread(target=w.run)
    thread.start()
    try:
        yield told
    finally:
        stop.set()
        wakeup.notify("light")  # end the current wait
        thread.join(timeout=30)
        wakeup.close()


def test_a_worker_tells_its_progress_with_time_not_with_each_request(
    db_url: str, redis_url: str, namespace: str, sink: MailSink, wake_env: None
) -> None:
    """Catches a worker that tells its run (a Dagster event each) after every batch that left
    it idle: with requests arriving one at a time, each its own batch, that is an event per
    request, so the run's event log and the worker's time between requests grew with traffic.
    Within one progress period the batches are told once, merged, and nothing is left untold:
    here the last telling, at the worker's end, counts every request."""
    db = Database.from_url(db_url)
    upgrade(db)
    requests = RequestStore(db)
    with _telling_worker(db_url, redis_url, namespace, sink, "worker-told", 120.0) as told:
        for i in range(4):
            request_id = enqueue("send_email", email(i, "told"), db=db).id
            _wait_for(lambda rid=request_id: requests.get(rid).status  # type: ignore[misc,union-attr]
                      is RequestStatus.COMPLETED, timeout=30, what="the request to complete")
        assert told == [], [t.line() for t in told]  # four batches, none told yet
    assert len(told) == 1 and told[0].total == 4, [t.line() for t in told]
    db.dispose()


def test_a_worker_tells_what_it_did_once_its_progress_period_passed_while_idle(
    db_url: str, redis_url: str, namespace: str, sink: MailSink, wake_env: None
) -> None:
    """Catches batches never told while the worker waits for work: a worker that went idle
    with untold batches tells them once its progress period has passed, without new work and
    well before its poll interval (a minute here)."""
    db = Database.from_url(db_url)
    upgrade(db)
    with _telling_worker(db_url, redis_url, namespace, sink, "worker-idle-told", 1.0) as told:
        for i in range(2):
            enqueue("send_email", email(i, "idle-told"), db=db)
        _wait_for(lambda: sum(t.total for t in told) == 2, timeout=30,
                  what="the two requests to be told while the worker is idle")
    assert sum(t.total for t in told) == 2
    db.dispose()


def test_a_killed_worker_leaves_leases_that_expire_and_its_requests_are_taken_back(
    db_url: str, redis_url: str, namespace: str, sink: MailSink, wake_env: None
) -> None:
    """Catches: the requests a dead worker held lost (``running`` for ever), given back before
    the ledger's lease on their keys ran out (the next worker would find them in progress and
    burn attempts), or run twice. One worker is SIGKILLed mid-batch; its requests are taken
    back and a second worker finishes them: one mail each. The worker SIGKILLs itself right
    after its first mail was accepted (``SEKALI_CRASH_AT=after_send``): mid-batch, whatever
    the speed of its sends (its other lanes may have had theirs accepted too)."""
    db = Database.from_url(db_url)
    upgrade(db)
    ids = [enqueue("send_email", email(i, "k"), db=db).id for i in range(40)]
    spec = _spec(db_url, redis_url, namespace, sink, "worker-k", lease=3.0, batch=40)
    proc = _spawn(spec, SEKALI_CRASH_AT="after_send")
    requests = RequestStore(db)
    assert proc.wait(timeout=120) == -signal.SIGKILL
    assert 1 <= len(_mails(sink)) <= DEFAULT_SMTP_CONNECTIONS
    held = [r for r in requests.get_many(ids) if r.status is RequestStatus.RUNNING]
    assert held and all(r.run_id == "worker-k" for r in held)
    ledger = IdempotencyStore(db)
    taken = requests.take_back(
        ["worker-k"], available=lambda key: getattr(ledger.get(key), "lease_expires_at", None))
    assert {r.id for r in taken} == {r.id for r in held}
    waiting = requests.get_many([r.id for r in held])
    assert all(r.status is RequestStatus.PENDING for r in waiting)
    assert any(r.available_at is not None for r in waiting)  # those whose key was leased
    second = _spawn({**spec, "owner": "worker-k2", "idle": 8.0})  # past the 3 s leases
    out = json.loads(second.communicate(timeout=240)[0].strip().splitlines()[-1])
    assert out["counts"].get("retrying", 0) == 0  # nothing met a live lease: it had run out
    assert requests.counts()[RequestStatus.COMPLETED] == 40
    mails = _mails(sink)  # the taken-over keys looked their mail up before sending again
    assert len(mails) == 40 and set(mails.values()) == {1}
    db.dispose()


def test_a_worker_that_lost_its_requests_moves_none_of_them(
    db_url: str, redis_url: str, namespace: str, sink: MailSink, wake_env: None
) -> None:
    """Catches: a worker declared dead that comes back (a long pause) settling requests another
    worker now holds: every move it makes names its owner. Its claim is taken back under it
    mid-batch (SIGSTOP, take back, SIGCONT); its completions and failures then move nothing."""
    db = Database.from_url(db_url)
    upgrade(db)
    ids = [enqueue("send_email", email(i, "p"), db=db).id for i in range(3)]
    requests = RequestStore(db)
    claimed = requests.claim_for_worker(3, owner="paused", job_types=["send_email"])
    assert {r.id for r in claimed} == set(ids)
    taken = requests.take_back(["paused"], available=lambda key: None)
    assert len(taken) == 3
    again = requests.claim_for_worker(3, owner="successor", job_types=["send_email"])
    assert {r.run_id for r in again} == {"successor"}
    assert requests.mark_completed_many(ids, run_id="paused", owner="paused") == set()
    assert not requests.mark_failed(ids[0], "late", owner="paused")
    assert not requests.retry_later(ids[1], owner="paused", at=time.time(), error="e",
                                    error_class="transient")
    assert {r.status for r in requests.get_many(ids)} == {RequestStatus.RUNNING}
    assert requests.mark_completed_many(ids, owner="successor") == set(ids)
    db.dispose()


def test_a_worker_ends_itself_when_idle_and_at_its_lifetime(
    db_url: str, redis_url: str, namespace: str, sink: MailSink, wake_env: None
) -> None:
    """Catches: a worker that runs for ever (code and configuration never roll), or that ends
    while work keeps coming before its lifetime."""
    db = Database.from_url(db_url)
    upgrade(db)
    idle = worker(_spec(db_url, redis_url, namespace, sink, "idle", idle=0.5, poll=0.1))
    assert idle.run().reason.startswith("idle")
    old = worker(_spec(db_url, redis_url, namespace, sink, "old", lifetime=0.5, poll=0.1))
    assert old.run().reason.startswith("lifetime")
    with pytest.raises(ValueError):
        WorkerPolicy(queue="light", batch_size=0)
    db.dispose()
