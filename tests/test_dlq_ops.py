"""The ``dlq_operations`` job (the UI's way in) and the DLQ store under processes and threads."""

from __future__ import annotations

import multiprocessing
import threading
from typing import Any

import dagster as dg
from sqlalchemy import text

from pipelines.ops.dlq_ops import dlq_operations
from resources.dagster_resources import DlqResource
from resources.dlq import DlqStatus, DlqStore, FailureInfo
from resources.idempotency import IdempotencyStore
from resources.storage.db import Database


def _info(i: int, run: str, *, job_type: str = "send_email") -> FailureInfo:
    return FailureInfo(
        job_type=job_type,
        dedupe_key=f"request:{i}",
        error_type="SMTPDataError",
        message=f"550 mailbox {i} unavailable",
        run_id=run,
        request_id=i,
        idempotency_key=f"email:welcome:u{i}:2026-11-29",
    )


def run_ops(db_url: str, **config: Any) -> dg.ExecuteInProcessResult:
    return dlq_operations.execute_in_process(
        run_config={"ops": {"dlq_operation": {"config": config}}},
        resources={"dlq": DlqResource(database_url=db_url)},
        instance=dg.DagsterInstance.ephemeral(),
        raise_on_error=False,
    )


def test_dlq_operations_job_validates_and_replays_only_the_selection(
    db: Database, db_url: str
) -> None:
    """Catches: a UI job that replays everything by default, a discard without a reason, and a
    replay that resets idempotency keys of records that were not selected."""
    store = DlqStore(db)
    idem = IdempotencyStore(db)
    for i in range(4):
        key = f"email:welcome:u{i}:2026-11-29"
        idem.fail(idem.begin(key), "550", "permanent")
        store.record_failure(
            _info(i, f"r{i}", job_type="send_email" if i < 2 else "charge_payment")
        )

    assert not run_ops(db_url, action="replay").success  # no ids, no filter: refused
    bad = run_ops(db_url, action="discard", ids=[1])
    assert not bad.success and "reason" in str(bad.all_events)
    assert not run_ops(db_url, action="list", older_than="soon").success

    dry = run_ops(db_url, action="replay", job_type="send_email")  # dry_run defaults to true
    assert dry.success and dry.output_for_node("dlq_operation")["changed"] == [1, 2]
    assert store.counts()["open"] == 4

    guarded = run_ops(
        db_url, action="replay", job_type="send_email", dry_run=False, error_class="unknown"
    )  # no mail record to ask: the verdict is unknown, so the records must be named
    assert guarded.output_for_node("dlq_operation")["refused"] == [1, 2]
    assert store.counts()["open"] == 4
    done = run_ops(
        db_url, action="replay", job_type="send_email", dry_run=False, error_class="unknown",
        allow_repeat=[1, 2],
    )
    assert done.success and done.output_for_node("dlq_operation")["changed"] == [1, 2]
    assert [r.status for r in store.list_records()] == [DlqStatus.REPLAY_REQUESTED] * 2 + [
        DlqStatus.OPEN
    ] * 2
    statuses = [idem.get(f"email:welcome:u{i}:2026-11-29").status for i in range(4)]
    assert statuses == ["retryable", "retryable", "failed", "failed"]

    gone = run_ops(db_url, action="discard", ids=[3], reason="customer left", dry_run=False)
    assert gone.success and store.get(3).status is DlqStatus.DISCARDED
    assert store.audit(3)[-1]["detail"] == "customer left"


def _record_many(url: str, worker: int) -> int:
    store = DlqStore(Database.from_url(url))
    created = 0
    for i in range(30):
        created += store.record_failure(_info(i % 10, f"run-{i % 3}")).created
    return created


def test_processes_and_threads_recording_the_same_failures_make_one_record_each(
    db: Database, db_url: str
) -> None:
    """Catches: a run-failure sensor, the sweep and a replay settle racing into duplicate records
    or double-counted failures (one record per request, one failure per run)."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(3) as pool:
        async_result = pool.starmap_async(_record_many, [(db_url, w) for w in range(3)])
        counts: list[int] = []
        threads = [
            threading.Thread(target=lambda w=w: counts.append(_record_many(db_url, w)))
            for w in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        counts += async_result.get(timeout=120)
    assert sum(counts) == 10
    records = DlqStore(db).list_records()
    assert len(records) == 10
    assert all(r.failure_count == 3 for r in records)
    with db.statement() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM dlq_failures")).scalar() == 30
