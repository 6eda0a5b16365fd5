"""Fair share across tenants at intake (engine/tenants.py, docs/flow.md): weights, a guaranteed
minimum, a burst maximum, set at runtime; several claimer processes on SQLite and Postgres.

Shares are checked page by page: every page a claimer takes while a tenant has work gives it
its share of the page, within the scheduler's bound, whatever order the claimers ran in.
"""

from __future__ import annotations

import json
import multiprocessing
from collections import Counter
from typing import Any

import dagster as dg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import event, text

from cli.main import main as cli
from engine import FlowControl
from engine import tags as tag
from engine.health.diagnosis import DiagnosisSetup, check_tenant_starvation
from engine.health.metrics import TOP_TENANTS, MetricsCollector
from engine.registry import get_job_type
from engine.requests import Debounced, RequestStore
from engine.tenants import (
    DEFAULT_TENANT,
    OTHER,
    TenantSetting,
    TenantStore,
    allocate,
    charged_passes,
    effective_shares,
)
from pipelines.ops.tenant_ops import tenant_operations
from resources.errors import ValidationError
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from sensors.intake import IntakeMode, IntakePolicy, RequestsResource, run_requests_for
from tests import fairness_workers as workers

PAGE = 20
CLAIMERS = 4


def _backlog(db: Database, tenant: str, count: int, *, start: int = 0, priority: int = 0) -> None:
    """``count`` pending requests of ``tenant``, written in one transaction."""
    store = RequestStore(db)
    with db.transaction() as conn:
        for i in range(start, start + count):
            store.enqueue("fair_test", f"fair:{tenant}:{i}", {"n": i}, queue="light",
                          conn=conn, tenant=tenant, priority=priority)


def _claim_in_parallel(url: str, watched: str) -> list[list[tuple[int, str]]]:
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Manager().Barrier(CLAIMERS)
    with ctx.Pool(CLAIMERS) as pool:
        runs = pool.starmap(workers.claim_pages, [(url, PAGE, watched, barrier)] * CLAIMERS)
    return [page for run in runs for page in run if page]


def _check_pages(
    pages: list[list[tuple[int, str]]], watched: str, share: float, total: int, tenants: int
) -> None:
    ids = [i for page in pages for i, _ in page]
    assert len(ids) == len(set(ids)), "a request was claimed twice"
    assert sum(t == watched for page in pages for _, t in page) == total
    bound = 2 + share * tenants
    counts = sorted(sum(t == watched for _, t in page) for page in pages)
    served = [c for c in counts if c]
    assert max(served) <= share * PAGE + bound, counts
    # one page at most is the one where its work ran out
    assert min(served[1:] or served) >= share * PAGE - bound, counts
    # after its work ran out, each claimer takes one page without it and stops
    assert counts.count(0) <= CLAIMERS, counts


# -- the scheduler alone ---------------------------------------------------------------------


def test_shares_raise_minimums_and_hold_maximums() -> None:
    """Catches: weights ignored, a minimum not raised, a maximum not held, shares that do not
    add up, minimums over 1 kept as they are."""
    set_ = {
        "a": TenantSetting("a", weight=3),
        "b": TenantSetting("b", weight=1, min_share=0.4),
        "c": TenantSetting("c", weight=1, max_share=0.1),
    }
    assert effective_shares(["a", "d"], set_) == pytest.approx({"a": 0.75, "d": 0.25})
    shares = effective_shares(["a", "b", "c", "d"], set_)
    assert shares["b"] == pytest.approx(0.4)
    assert shares["c"] == pytest.approx(0.1)
    assert shares["a"] == pytest.approx(0.5 * 3 / 4)
    assert sum(shares.values()) == pytest.approx(1)
    assert effective_shares(["c"], set_) == {"c": pytest.approx(0.1)}
    over = {n: TenantSetting(n, min_share=0.8) for n in "xy"}
    assert effective_shares(["x", "y"], over) == pytest.approx({"x": 0.5, "y": 0.5})


@settings(max_examples=60, deadline=None)
@given(
    weights=st.lists(st.integers(1, 8), min_size=1, max_size=5),
    page=st.integers(1, 60),
    pages=st.integers(1, 30),
)
def test_every_window_of_claims_is_within_the_bound(
    weights: list[int], page: int, pages: int
) -> None:
    """Catches: a scheduler whose error grows with the backlog or the number of pages (a tenant
    claimed over or under its share by more than ``2 + s * N`` in any window of claims)."""
    names = [f"t{i}" for i in range(len(weights))]
    set_ = {n: TenantSetting(n, weight=w) for n, w in zip(names, weights, strict=True)}
    shares = effective_shares(names, set_)
    passes: dict[str, float] = {}
    clock = 0.0
    sequence: list[str] = []
    for _ in range(pages):
        plan = allocate(dict.fromkeys(names, 10**6), shares, passes, clock, page)
        assert len(plan.slots) == page
        passes.update(charged_passes(plan, Counter(plan.slots), passes))
        clock = plan.clock
        sequence += plan.slots
    bound = 2 + max(shares.values()) * len(names)
    for width in (len(sequence), min(len(sequence), 200), min(len(sequence), 37)):
        for start in range(0, len(sequence) - width + 1, max(1, width // 3)):
            got = Counter(sequence[start:start + width])
            for n in names:
                assert abs(got[n] - shares[n] * width) <= bound, (n, start, width)


def test_a_tenant_back_from_idle_saved_no_credit() -> None:
    """Catches: a tenant that had no work for a while coming back with a burst of saved-up
    credit (its pass left behind the clock), taking the whole page."""
    shares = {"a": 0.5, "b": 0.5}
    passes = {"a": 0.0, "b": 0.0}
    plan = allocate({"a": 1000}, {"a": 1.0}, passes, 0.0, 100)
    passes.update(charged_passes(plan, Counter(plan.slots), passes))
    plan = allocate({"a": 1000, "b": 1000}, shares, passes, plan.clock, 20)
    assert Counter(plan.slots) == {"a": 10, "b": 10}


def test_a_tenant_name_is_checked() -> None:
    """Catches: a reserved or unstorable tenant name accepted, the field not named."""
    for bad, field in (("~clock", "name"), ("", "name"), ("x" * 201, "name")):
        with pytest.raises(ValidationError) as caught:
            TenantSetting(bad)
        assert caught.value.field == field
    with pytest.raises(ValidationError) as caught:
        TenantSetting("a", weight=0)
    assert caught.value.field == "weight"
    with pytest.raises(ValidationError) as caught:
        TenantSetting("a", min_share=0.5, max_share=0.2)
    assert caught.value.field == "min"


def test_a_job_types_fairness_key_names_the_tenant() -> None:
    """Catches: a fairness key not formatted from the payload, no default tenant without one,
    a key that cannot be formed accepted silently."""
    import dataclasses

    mail = get_job_type("send_email")
    example = mail.presentation.example
    assert mail.tenant_for(dict(example)) == DEFAULT_TENANT
    keyed = dataclasses.replace(mail, flow=FlowControl(fairness_key="user:{user_id}"))
    assert keyed.tenant_for({**example}) == f"user:{example['user_id']}"
    with pytest.raises(ValidationError) as caught:
        keyed.tenant_for({})
    assert caught.value.field == "fairness_key"
    with pytest.raises(ValueError, match="names no payload field"):
        dataclasses.replace(mail, flow=FlowControl(fairness_key="everyone"))


# -- the claim, several processes, both dialects --------------------------------------------


def test_a_small_tenant_behind_a_large_backlog_is_claimed_at_its_weights_share(
    db_url: str,
) -> None:
    """Catches: claims in arrival order (the small tenant waits behind all 5,000), a share not
    following the weights, a request claimed twice by concurrent claimers."""
    db = Database.from_url(db_url)
    upgrade(db)
    try:
        TenantStore(db).set("big", weight=3)
        _backlog(db, "big", 5000)
        _backlog(db, "small", 100)
        pages = _claim_in_parallel(db_url, "small")
        _check_pages(pages, "small", 0.25, total=100, tenants=2)
        claimed = sum(len(p) for p in pages)
        assert claimed < 100 / 0.25 + CLAIMERS * PAGE + PAGE, "it waited for the backlog"
        counts = {t.name: t.claimed for t in TenantStore(db).list()}
        assert counts["small"] == 100 and counts["big"] == claimed - 100
    finally:
        db.dispose()


def test_a_guaranteed_minimum_holds_under_a_burst_from_three_tenants(db_url: str) -> None:
    """Catches: the minimum ignored (the tenant gets its weight's quarter), priorities of the
    bursting tenants overriding the share of another tenant."""
    db = Database.from_url(db_url)
    upgrade(db)
    try:
        TenantStore(db).set("payments", weight=1, min_share=0.4)
        _backlog(db, "payments", 80)
        for name in ("bulk1", "bulk2", "bulk3"):
            _backlog(db, name, 600, priority=5)
        pages = _claim_in_parallel(db_url, "payments")
        _check_pages(pages, "payments", 0.4, total=80, tenants=4)
        others = Counter(t for page in pages for _, t in page if t != "payments")
        assert max(others.values()) - min(others.values()) <= PAGE, others
    finally:
        db.dispose()


def test_a_weight_change_takes_effect_at_the_next_page(db_url: str) -> None:
    """Catches: weights cached in the claimer (a restart needed), a change that takes several
    pages to show, the CLI not writing the settings the claim reads."""
    db = Database.from_url(db_url)
    upgrade(db)
    try:
        _backlog(db, "a", 300)
        _backlog(db, "b", 300)
        store = RequestStore(db)
        first = Counter(r.tenant for r in store.claim_for_launch(PAGE))
        assert first == {"a": 10, "b": 10}
        assert cli(["tenants", "set", "a", "--weight", "4", "--url", db_url]) == 0
        second = Counter(r.tenant for r in store.claim_for_launch(PAGE))
        assert abs(second["a"] - 16) <= 1 and second["a"] + second["b"] == PAGE, second
        assert cli(["tenants", "set", "b", "--weight", "1", "--max", "0.1",
                    "--url", db_url]) == 0
        third = Counter(r.tenant for r in store.claim_for_launch(PAGE))
        assert third["b"] <= 2 + 1, third
    finally:
        db.dispose()


def test_priorities_still_order_work_inside_a_tenant(db: Database) -> None:
    """Catches: the fair claim taking a tenant's requests in id order, ignoring priority."""
    _backlog(db, "a", 30)
    _backlog(db, "a", 5, start=100, priority=9)
    _backlog(db, "b", 30)
    claimed = RequestStore(db).claim_for_launch(10)
    mine = [r for r in claimed if r.tenant == "a"]
    assert len(mine) == 5 and all(r.priority == 9 for r in mine)
    assert all(r.claimed_at is not None for r in claimed)


def test_tenants_cli_sets_and_lists(db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Catches: --json output mixed with text, a bad value not refused with exit 2 and the
    field named, settings not listed."""
    db = Database.from_url(db_url)
    upgrade(db)
    db.dispose()
    assert cli(["tenants", "set", "acme", "--weight", "2", "--min", "0.3", "--url", db_url]) == 0
    capsys.readouterr()
    assert cli(["tenants", "list", "--json", "--url", db_url]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed[0]["name"] == "acme" and listed[0]["weight"] == 2
    assert listed[0]["min_share"] == 0.3 and listed[0]["max_share"] is None
    assert cli(["tenants", "set", "acme", "--weight", "-1", "--url", db_url]) == 2
    assert "weight" in capsys.readouterr().err
    assert cli(["tenants", "set", "other", "--weight", "1", "--min", "0.8",
                "--url", db_url]) == 2
    assert "min" in capsys.readouterr().err


# -- what a fair claim costs ------------------------------------------------------------------


def _statements_of_a_claim(db: Database, store: RequestStore, limit: int) -> list[Any]:
    """The SQL (driver text and parameters) one claim ran, in order."""
    seen: list[Any] = []

    def record(_c: Any, _cur: Any, statement: str, parameters: Any, *_: Any) -> None:
        seen.append((statement, parameters))

    event.listen(db.engine, "before_cursor_execute", record)
    try:
        assert store.claim_for_launch(limit)
    finally:
        event.remove(db.engine, "before_cursor_execute", record)
    return seen


def _plan_nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
    return [node] + [n for child in node.get("Plans", []) for n in _plan_nodes(child)]


def test_the_tenants_query_reads_each_tenants_work_from_an_index(db: Database) -> None:
    """Catches: the tenants-with-work query counting a tenant's claimable requests by reading
    the table (Postgres chose a sequential scan once statistics showed a large backlog: every
    page read the whole table, dead rows included), or by walking the tenant's requests already
    claimed (launched, not due again) to reach its pending ones."""
    for name in ("t0", "t1", "t2", "t3"):
        _backlog(db, name, 1000)
    store = RequestStore(db)
    for _ in range(3):
        assert len(store.claim_for_launch(200)) == 200
    if db.is_postgres:
        with db.statement() as conn:
            conn.execute(text("ANALYZE job_requests"))
    ran = _statements_of_a_claim(db, store, 200)
    query = [s for s in ran if "WITH RECURSIVE" in s[0]]
    assert len(query) == 1, [s[0][:60] for s in ran]
    sql, params = query[0]
    with db.transaction() as conn:
        if db.is_postgres:
            plan = conn.exec_driver_sql("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params).scalar()
            reads = [n for n in _plan_nodes(plan[0]["Plan"])
                     if n.get("Relation Name") == "job_requests"]
            assert reads and not [n for n in reads if n["Node Type"] == "Seq Scan"], reads
            assert not [n for n in reads if n.get("Rows Removed by Filter")
                        or n.get("Rows Removed by Index Recheck")], reads
        else:
            details = [r[3] for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql, params)]
            reads = [d for d in details if "job_requests" in d]
            assert "SCAN job_requests" not in reads, details
            counts = [d for d in reads if "status=?" in d]
            assert len(counts) == 2 and all("COVERING INDEX" in d for d in counts), details


def test_a_tenant_with_only_due_relaunches_or_debounced_work_is_counted_right(
    db: Database,
) -> None:
    """Catches: a tenant's claimable count that misses its launched requests due again (it
    would get no share of the page) or counts its pending debounced requests (the page would
    be planned for requests the claim cannot take, and come back short)."""
    _backlog(db, "a", 60)
    _backlog(db, "b", 10)
    store = RequestStore(db)
    with db.transaction() as conn:
        for i in range(30):
            store.enqueue("fair_test", f"fair:b:debounced:{i}", {"n": i}, queue="light",
                          conn=conn, tenant="b", debounce=Debounced(f"fair_test:{i}", 3600,
                                                                     7200))
    first = store.claim_for_launch(20)
    assert Counter(r.tenant for r in first) == {"a": 10, "b": 10}
    second = store.claim_for_launch(20)
    assert Counter(r.tenant for r in second) == {"a": 20}, "b's debounced were counted"
    again = store.claim_for_launch(20, relaunch_after=0)
    assert Counter(r.tenant for r in again) == {"a": 10, "b": 10}
    assert {r.id for r in again if r.tenant == "b"} == {r.id for r in first if r.tenant == "b"}


# -- what an operator sees -------------------------------------------------------------------


def test_metrics_show_each_tenant_with_bounded_labels(db: Database) -> None:
    """Catches: a label per tenant without bound (12 tenants -> 12 series), ``~other`` not
    summing the rest, waits or shares missing."""
    for i in range(12):
        _backlog(db, f"t{i:02d}", 12 - i)
    RequestStore(db).claim_for_launch(24)
    snap = MetricsCollector(db).collect()
    depth = {dict(s.labels)["tenant"]: s.value for s in snap.samples
             if s.name == "sekali_tenant_queue_depth"}
    assert len(depth) == TOP_TENANTS + 1 and OTHER in depth
    assert sum(depth.values()) == sum(range(1, 13)) - 24
    share = [s.value for s in snap.samples if s.name == "sekali_tenant_claim_share"]
    assert sum(share) == pytest.approx(1)
    assert snap.get("sekali_tenant_wait_seconds", tenant="t00", quantile="0.99") is not None


def test_doctor_names_a_starved_tenant(db: Database) -> None:
    """Catches: a tenant passed over for newer work of others not reported, a backlog nobody
    claims (the intake stopped) mistaken for starvation."""
    now = 5_000_000.0
    old = RequestStore(db, clock=lambda: now - 1800)
    with db.transaction() as conn:
        for i in range(3):
            old.enqueue("fair_test", f"fair:starved:{i}", {"n": i}, queue="light",
                        conn=conn, tenant="starved")
    setup = DiagnosisSetup(db=db, job_types={}, lease_seconds=30.0, clock=lambda: now)
    assert check_tenant_starvation(setup).passed  # nobody overtook it: not starvation
    recent = RequestStore(db, clock=lambda: now - 60, fair=False)
    with db.transaction() as conn:
        for i in range(5):
            recent.enqueue("fair_other", f"fair:noisy:{i}", {"n": i}, queue="light",
                           conn=conn, tenant="noisy")
    assert len(recent.claim_for_launch(5, job_types=["fair_other"])) == 5
    finding = check_tenant_starvation(setup)
    assert not finding.passed and "starved" in finding.found
    assert finding.evidence["starved"]["starved"]["overtaken_by"] == 5


def test_the_run_carries_its_tenant(db: Database) -> None:
    """Catches: runs without the tenant tag, a batch of several tenants tagged as one."""
    mail = get_job_type("send_email")
    store = RequestStore(db)
    for i, tenant in enumerate(("acme", "acme", "globex")):
        payload = {**mail.presentation.example, "user_id": f"u{i}"}
        store.enqueue("send_email", f"email:t:{i}", payload,
                      queue=mail.queue, tenant=tenant)
    claimed = sorted(store.claim_for_launch(3), key=lambda r: r.id)
    runs, _ = run_requests_for(claimed[:1], IntakePolicy())
    assert runs[0].tags[tag.TENANT] == "acme"
    batch, _ = run_requests_for(claimed, IntakePolicy(default_mode=IntakeMode.MICRO_BATCH,
                                                      batch_size=10))
    assert batch[0].tags[tag.TENANT] == tag.SEVERAL_TENANTS


def test_tenant_operations_job_sets_and_refuses_with_the_field(db_url: str) -> None:
    """Catches: the UI way in writing something the claim does not read, a bad weight retried
    or failing without the field named."""
    db = Database.from_url(db_url)
    upgrade(db)

    def launch(**config: Any) -> dg.ExecuteInProcessResult:
        return tenant_operations.execute_in_process(
            run_config={"ops": {"tenant_operation": {"config": config}}},
            resources={"requests": RequestsResource(database_url=db_url)},
            instance=dg.DagsterInstance.ephemeral(), raise_on_error=False,
        )

    try:
        assert launch(action="set", name="acme", weight=4.0, min_share=0.25).success
        [acme] = TenantStore(db).list()
        assert (acme.weight, acme.min_share, acme.max_share) == (4.0, 0.25, None)
        refused = launch(action="set", name="acme", weight=-2.0)
        assert not refused.success
        failure = refused.failure_data_for_node("tenant_operation")
        assert failure is not None and failure.user_failure_data is not None
        assert failure.user_failure_data.metadata["field"].value == "weight"
        assert TenantStore(db).list()[0].weight == 4.0
        assert launch().success
    finally:
        db.dispose()
