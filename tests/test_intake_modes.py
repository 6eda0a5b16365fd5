"""The intake end to end inside one Dagster instance: 1,000 requests, 30% duplicates, 700 effects.

Producers enqueue from threads and spawned processes; the real ``intake_sensor`` is evaluated
with ``build_sensor_context`` on a real (ephemeral) instance; the runs it asks for are executed
with ``execute_in_process`` against the real app database, Redis and the SMTP sink, and effects
are counted where they land (the sink's messages).
"""

from __future__ import annotations

import multiprocessing
import random
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from engine import tags as tag
from engine.requests import RequestStatus, RequestStore
from pipelines.definitions import intake_sensor
from pipelines.domain.mail import message_id_for
from pipelines.ops import send_email_job
from pipelines.ops.batch import FAN_OUT_JOB, MICRO_BATCH_JOB, intake_fan_out, intake_micro_batch
from resources.dagster_resources import DatabaseResource, IdempotencyResource
from resources.storage.db import Database
from sandbox.mailsink import MailSink
from sandbox.redis_server import free_port
from sensors.intake import RequestsResource
from tests.job_workers import dagster_resources

pytestmark = pytest.mark.dagster

DISTINCT = 700
TOTAL = 1000


def email(i: int) -> dict[str, Any]:
    return {
        "template": "welcome",
        "user_id": f"u{i}",
        "date": "2026-11-29",
        "to": f"u{i}@example.com",
    }


def producer_payloads(seed: int = 5) -> list[dict[str, Any]]:
    """700 intents, 300 of them sent a second time (same payload), shuffled."""
    rng = random.Random(seed)
    payloads = [email(i) for i in range(DISTINCT)]
    payloads += [email(i) for i in rng.sample(range(DISTINCT), TOTAL - DISTINCT)]
    rng.shuffle(payloads)
    return payloads


def enqueue_chunk(db_url: str, payloads: list[dict[str, Any]]) -> list[bool]:
    """Module-level producer (spawn-safe): ``enqueue`` each payload; returns ``created`` flags."""
    from engine.intake import enqueue

    database = Database.from_url(db_url)
    try:
        return [enqueue("send_email", p, db=database).created for p in payloads]
    finally:
        database.dispose()


def produce(db_url: str) -> int:
    """Enqueue the 1,000 requests from 2 processes and 2 threads; returns how many were new."""
    payloads = producer_payloads()
    chunks = [payloads[i::4] for i in range(4)]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        procs = pool.starmap_async(enqueue_chunk, [(db_url, chunks[0]), (db_url, chunks[1])])
        with ThreadPoolExecutor(2) as threads:
            local = list(threads.map(lambda c: enqueue_chunk(db_url, c), chunks[2:]))
        flags = [f for res in procs.get(timeout=240) + local for f in res]
    assert len(flags) == TOTAL
    return sum(flags)


@dataclass
class World:
    db: Database
    db_url: str
    sink: MailSink
    instance: dg.DagsterInstance
    resources: dict[str, Any]

    @property
    def store(self) -> RequestStore:
        return RequestStore(self.db)

    def tick(self, cursor: str | None = None) -> dg.SensorResult:
        context = dg.build_sensor_context(
            instance=self.instance,
            cursor=cursor,
            resources={"requests": self.resources["requests"]},
        )
        result = intake_sensor(context)
        assert isinstance(result, dg.SensorResult)
        return result

    def drain(self) -> tuple[list[dg.RunRequest], str | None]:
        """Tick until a tick claims nothing; every tick's page is bounded."""
        out: list[dg.RunRequest] = []
        cursor = None
        for _ in range(50):
            result = self.tick(cursor)
            cursor = result.cursor
            if not result.run_requests:
                return out, cursor
            assert len(result.run_requests) <= 300
            out.extend(result.run_requests)
        raise AssertionError("the intake never drained")

    def execute(self, job: dg.JobDefinition, request: dg.RunRequest) -> dg.ExecuteInProcessResult:
        return job.execute_in_process(
            # the tags the daemon would give it, run key included
            run_config=request.run_config,
            instance=self.instance,
            tags={**request.tags, "dagster/run_key": request.run_key or ""},
            resources=self.resources,
            raise_on_error=False,
        )

    def mails(self) -> list[str]:
        return [m["message_id"] for m in self.sink.messages()]


@pytest.fixture
def instance() -> Iterator[dg.DagsterInstance]:
    """One instance per app database, as in a deployment (run keys name keys, ids are local)."""
    with dg.DagsterInstance.ephemeral() as inst:
        yield inst


@pytest.fixture
def world(
    db: Database,
    db_url: str,
    tmp_path: Path,
    redis_url: str,
    namespace: str,
    redis_client: Any,
    instance: dg.DagsterInstance,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[World]:
    monkeypatch.setenv("SEKALI_INTAKE_MAX_PER_TICK", "300")
    monkeypatch.setenv("SEKALI_INTAKE_BATCH_SIZE", "50")
    sink = MailSink(f"sqlite:///{tmp_path / 'sink.db'}").start()
    resources = dagster_resources(
        db_url=db_url, redis_url=redis_url, namespace=namespace, smtp_port=sink.port
    )
    resources["requests"] = RequestsResource(database_url=db_url)
    try:
        yield World(db, db_url, sink, instance, resources)
    finally:
        sink.stop()


def test_per_request_mode_emits_one_run_per_intent(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches: duplicates becoming runs, run keys that are not deterministic, a missing tag."""
    monkeypatch.setenv("SEKALI_INTAKE_MODE", "per_request")
    assert produce(world.db_url) == DISTINCT
    runs, cursor = world.drain()
    assert len(runs) == DISTINCT, (world.store.counts(), len({r.run_key for r in runs}))
    keys = {f"email:welcome:u{i}:2026-11-29" for i in range(DISTINCT)}
    assert {r.run_key for r in runs} == {f"intake:{k}" for k in keys}
    assert {r.job_name for r in runs} == {"send_email"}
    assert {r.tags[tag.KEY] for r in runs} == keys
    assert {r.tags[tag.QUEUE] for r in runs} == {"light"}
    assert world.store.counts()["launched"] == DISTINCT

    # Execute a sample for real; a second run of the same request adds no effect.
    sample = runs[:4]
    for request in [*sample, sample[0]]:
        assert world.execute(send_email_job, request).success
    assert sorted(world.mails()) == sorted(message_id_for(r.tags[tag.KEY]) for r in sample)

    # The next tick reconciles the finished runs: their requests are completed.
    world.tick(cursor)
    for request in sample:
        done = world.store.get(int(request.tags[tag.REQUEST_ID]))
        assert done is not None and done.status is RequestStatus.COMPLETED


def test_micro_batch_mode_executes_every_intent_once(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches: a batch that drops, repeats or double-sends requests; duplicates executed."""
    monkeypatch.setenv("SEKALI_INTAKE_MODE", "micro_batch")
    assert produce(world.db_url) == DISTINCT
    runs, _ = world.drain()
    assert {r.job_name for r in runs} == {MICRO_BATCH_JOB}
    assert len(runs) == DISTINCT // 50 and len({r.run_key for r in runs}) == len(runs)
    assert all(int(r.tags["dagster/max_runtime"]) > 0 for r in runs)
    for request in runs:
        result = world.execute(intake_micro_batch, request)
        assert result.success
        summary = result.output_for_node("execute_request_batch")
        assert summary["completed"] == 50 and summary["failed"] == 0
    mails = world.mails()
    assert len(mails) == DISTINCT and len(set(mails)) == DISTINCT
    counts = world.store.counts()
    assert counts["completed"] == DISTINCT and sum(counts.values()) == DISTINCT
    # A batch run re-emitted after a crash has no new effect.
    again = world.execute(intake_micro_batch, runs[0])
    assert again.success and again.output_for_node("execute_request_batch")["skipped"] == 50
    assert len(world.mails()) == DISTINCT


def test_one_bad_request_never_fails_its_micro_batch_neighbours(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches: a batch step that stops (or fails) at its first bad request."""
    monkeypatch.setenv("SEKALI_INTAKE_MODE", "micro_batch")
    store = world.store
    for i in range(3):
        store.enqueue("send_email", f"email:welcome:g{i}:2026-11-29", email(i), queue="light")
    # Written past enqueue's validation (as an old producer or a hand-edited row would).
    bad = store.enqueue("send_email", "email:bad", {"template": "nope"}, queue="light")
    for i in range(3, 6):
        store.enqueue("send_email", f"email:welcome:g{i}:2026-11-29", email(i), queue="light")
    runs, _ = world.drain()
    assert len(runs) == 1
    result = world.execute(intake_micro_batch, runs[0])
    assert result.success
    summary = result.output_for_node("execute_request_batch")
    assert (summary["completed"], summary["failed"]) == (6, 1)
    failed = store.get(bad.id)
    assert failed is not None and failed.status is RequestStatus.FAILED
    error = failed.last_error or ""
    assert "ValidationError" in error and "template" in error
    assert len(world.mails()) == 6


def test_fan_out_mode_a_step_per_request(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """Catches: fan-out losing siblings of a failed step, or a failed run leaving requests
    launched forever (the next tick marks them failed for the DLQ)."""
    monkeypatch.setenv("SEKALI_INTAKE_MODES", "send_email=fan_out")
    store = world.store
    for i in range(4):
        store.enqueue("send_email", f"email:welcome:f{i}:2026-11-29", email(i), queue="light")
    bad = store.enqueue("send_email", "email:bad", {"template": "nope"}, queue="light")
    runs, cursor = world.drain()
    assert [r.job_name for r in runs] == [FAN_OUT_JOB]
    result = world.execute(intake_fan_out, runs[0])
    assert not result.success  # the bad step failed; its siblings ran
    assert len(world.mails()) == 4
    world.tick(cursor)
    counts = store.counts()
    assert (counts["completed"], counts["failed"]) == (4, 1)
    assert store.get(bad.id).status is RequestStatus.FAILED  # type: ignore[union-attr]


def _run_with_its_database_away(
    world: World, job: dg.JobDefinition, away: Callable[[str], dict[str, Any]]
) -> list[Any]:
    """Drain the intake into one run and execute it with the resources ``away(url)`` names
    pointing at a Postgres address nothing listens on; returns each step failure's declared
    metadata after asserting the steps were retried (3 attempts each) and sent nothing."""
    (run,), _ = world.drain()
    gone = f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/gone"
    result = job.execute_in_process(
        run_config=run.run_config, instance=world.instance, raise_on_error=False,
        tags={**run.tags, "dagster/run_key": run.run_key or ""},
        resources={**world.resources, **away(gone)},
    )
    assert not result.success
    kinds = [e.event_type_value for e in result.all_events]
    failed = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    assert kinds.count("STEP_UP_FOR_RETRY") == 2 * len(failed), kinds
    assert world.mails() == []
    declared = [e.step_failure_data.user_failure_data for e in failed]
    assert None not in declared, [e.step_failure_data.error for e in failed]
    return [d.metadata for d in declared]


def test_a_fanned_step_that_cannot_read_its_request_is_retried_not_failed_raw(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches a fan-out step whose own reads (its request row, taking it ``running``) fail
    while the database is away raising that error raw: the step failed at once, unclassified
    and never retried (the jobs turn Dagster's run retry off for step failures), and the
    request was dead-lettered as ``unknown``. The one failure path decides instead: transient,
    retried with the policy's delay, and given up as transient when the outage outlasts it."""
    monkeypatch.setenv("SEKALI_INTAKE_MODES", "send_email=fan_out")
    for i in range(2):
        world.store.enqueue("send_email", f"email:welcome:o{i}:2026-11-29", email(i),
                            queue="light")
    failures = _run_with_its_database_away(
        world, intake_fan_out, lambda gone: {"requests": RequestsResource(database_url=gone)})
    assert [m["error_class"].value for m in failures] == ["transient", "transient"]


def test_a_request_op_whose_database_is_away_at_its_start_is_retried_not_failed_raw(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches a per-request op that cannot get its services (a process checks the schema at
    its first use, and the database is away) raising that error raw: the step failed
    unclassified and unretried, and its request was dead-lettered as ``unknown``."""
    monkeypatch.setenv("SEKALI_INTAKE_MODE", "per_request")
    world.store.enqueue("send_email", "email:welcome:a0:2026-11-29", email(0), queue="light")
    failures = _run_with_its_database_away(
        world, send_email_job, lambda gone: {"app_db": DatabaseResource(database_url=gone),
                                             "idempotency": IdempotencyResource(database_url=gone)})
    assert [m["error_class"].value for m in failures] == ["transient"]


def test_a_tick_that_failed_after_claiming_is_healed_with_the_same_run_keys(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches: requests stuck in ``launched`` after a failed tick, or a re-emission under a
    new run key (which would let Dagster launch the same request twice)."""
    monkeypatch.setenv("SEKALI_INTAKE_MODE", "per_request")
    for i in range(5):
        world.store.enqueue("send_email", f"email:welcome:h{i}:2026-11-29", email(i), queue="light")
    first = world.tick().run_requests  # imagine the tick dies now: no run was launched
    assert world.tick().run_requests == []
    monkeypatch.setenv("SEKALI_INTAKE_RELAUNCH_AFTER", "0")
    second = world.tick().run_requests
    assert [r.run_key for r in second] == [r.run_key for r in first]
    assert len(first) == 5
