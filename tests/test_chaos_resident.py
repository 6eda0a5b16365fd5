"""The chaos harness with resident workers as the delivery path (``--delivery resident``).

Short runs: the workload enqueued (each request three times), real
:class:`engine.worker.ResidentWorker` processes on the light and the heavy queue claiming it,
SIGKILLs and SIGSTOPs past the lease armed on them, Redis restarted, gateway answers dropped,
a crash-looping request, poison refused at the enqueue. What a dead or cut-off worker held
comes back only through :func:`engine.worker.give_back` (the supervisor's path), so a request
left ``running`` under a dead owner is found lost by the checker.
"""

from __future__ import annotations

import json

import pytest

from proof.chaos import (
    ChaosConfig,
    ChaosConfigError,
    ChaosReport,
    ChaosWorld,
    ResidentCoordinator,
    build_workload,
    format_table,
    run_chaos,
)
from proof.chaos_typed import environment
from resources.dlq import DlqStatus
from tests.conftest import PG_URL, _postgres_error, need_server

pytestmark = pytest.mark.slow

FAULTS = ("kill", "stop", "redis-restart", "drop-response", "poison", "crash-loop")


def _explain(report: ChaosReport) -> str:
    return (format_table(report.rows) + f"\nstats {json.dumps(report.stats, sort_keys=True)}\n"
            + "\n".join(report.violations[:20]) + f"\ndead letters {report.dead_letters[:10]}")


def _assert_resident(report: ChaosReport) -> None:
    why = _explain(report)
    assert report.finished and report.ok, why
    total = next(r for r in report.rows if r["fault"] == "all")
    assert total["duplicates"] == 0 and total["lost"] == 0, why
    stats = report.stats
    assert stats.get("unplanned_deaths", 0) == 0, why
    assert stats["kills"] >= 1 and stats["crash-loop"] == 1, why  # the faults struck
    # dead workers' requests came back through the supervisor's give-back, to new workers
    assert stats["given_back"] >= 1 and stats["worker_runs"] > 2, why
    assert stats["poison_refused_at_enqueue"] >= 1, why
    assert stats["clean_effects"] == stats["clean_requests"], why


@pytest.mark.timeout(180)
def test_resident_workers_keep_every_invariant_on_sqlite() -> None:
    """Catches: a resident worker's kill (before or after the effect, after the keys completed)
    leaving its batch ``running`` forever or run twice; a stop past the lease whose late writes
    are accepted after its requests were given back; a crash loop not dead-lettered as such."""
    report = run_chaos(ChaosConfig(
        requests=60, workers=2, redelivery=3, faults=FAULTS, kills=3, stops=1,
        redis_restarts=1, drop_rate=0.06, poison_rate=0.05, seed=7, timeout=150,
        delivery="resident"))
    _assert_resident(report)


@pytest.mark.postgres
@pytest.mark.timeout(180)
def test_resident_workers_keep_every_invariant_on_postgres() -> None:
    """The same with the app store on Postgres (``FOR UPDATE SKIP LOCKED`` claims)."""
    error = _postgres_error()
    if error is not None:
        need_server("PostgreSQL", error)
    report = run_chaos(ChaosConfig(
        requests=60, workers=2, redelivery=3, faults=FAULTS, kills=3, stops=1,
        redis_restarts=1, drop_rate=0.06, poison_rate=0.05, seed=8, timeout=150,
        backend="postgres", database_url=PG_URL, delivery="resident"))
    _assert_resident(report)


def test_resident_delivery_refuses_what_it_cannot_run() -> None:
    for bad in ({"naive": True}, {"job_types": ("send_email",)}, {"batch_size": 0},
                {"delivery": "fan_out"}, {"faults": ("pg-failover",), "backend": "postgres"}):
        with pytest.raises(ChaosConfigError):
            ChaosConfig(**{"delivery": "resident", **bad}).validate()  # type: ignore[arg-type]


@pytest.mark.dagster
@pytest.mark.timeout(240)
def test_resident_workers_as_dagster_runs_of_the_real_supervisor() -> None:
    """``--dagster``: every worker is a ``sekali_worker`` run the supervisor asked for
    (``worker_run_requests``); a killed one's run is failed as run monitoring would, the
    supervisor's own give-back returns what it held and its slot gets the next run. Catches a
    slot left empty or doubled, requests left with a dead run, a worker run left open."""
    report = run_chaos(ChaosConfig(
        requests=16, workers=2, redelivery=2, faults=("kill", "poison"), kills=2,
        poison_rate=0.1, seed=2, timeout=200, delivery="resident", dagster=True))
    why = _explain(report)
    assert report.finished and report.ok, why
    stats = report.stats
    assert stats["kills"] >= 1 and stats["dagster_runs_failed_by_monitoring"] >= 1, why
    assert stats["dagster_worker_runs"] == stats["worker_runs"] > 2, why
    assert stats["dagster_runs_open_at_end"] == 0, why
    assert stats["clean_effects"] == stats["clean_requests"], why


@pytest.mark.timeout(240)
def test_a_record_replayed_again_and_failing_again_is_open_again() -> None:
    """Catches a harness whose second replay of a record runs as the first one did (the same
    run id): the store has seen that run fail, so the failure changes nothing, the record stays
    ``replaying`` for good and the run never settles. A crash-looping request evicted by
    ``evicting-redis`` and replayed, then replayed again after the retention purge, is that."""
    config = ChaosConfig(requests=12, workers=2, redelivery=1, faults=("crash-loop",), seed=3,
                         timeout=150, delivery="resident")
    config.validate()
    requests = build_workload(config)
    with ChaosWorld(config) as world:
        world.seed_stock(requests)
        coordinator = ResidentCoordinator(config, world, requests)
        assert coordinator.run(), _explain_stats(coordinator.stats)
        looping = next(r for r in requests if r.crash_loop)
        record = next(r for r in coordinator.dlq.list_records(status=[DlqStatus.OPEN])
                      if r.request_id == coordinator.ids[looping.id])
        with environment({"REDIS_URL": world.redis_url,
                          "SEKALI_WAKEUP_NAMESPACE": coordinator.namespace}):
            for replay in (1, 2):
                assert coordinator.replay_records([record.id], "crash-loop", "again") == 1
                again = coordinator.dlq.get(record.id)
                assert (again.status, again.replay_count) == (
                    DlqStatus.OPEN, replay), (replay, again, coordinator.stats)
                assert again.error_class == "crash_loop", again
        coordinator._shutdown()


def _explain_stats(stats: dict[str, int]) -> str:
    return json.dumps(stats, sort_keys=True)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("seed", [1, 2])
def test_kills_left_when_an_eviction_wave_took_every_request_strike_the_replays(
        seed: int) -> None:
    """Catches kills armed on resident workers after ``evicting-redis`` dead-lettered the
    requests they could have struck: nothing left in a queue reaches their point, the replays
    run as per-request runs, and the run ends with a kill never struck (3 of 4 on these seeds
    before the kills went to the replays)."""
    report = run_chaos(ChaosConfig(requests=40, workers=2, redelivery=2,
                                   faults=("kill", "evicting-redis"), kills=4, seed=seed,
                                   timeout=200, delivery="resident"))
    why = _explain(report)
    assert report.finished and report.ok, why
    total = next(r for r in report.rows if r["fault"] == "all")
    assert total["duplicates"] == 0 and total["lost"] == 0, why
    assert report.stats["kills"] == 4 and report.stats["kills_not_struck"] == 0, why
    assert report.stats["eviction_replayed"] >= 1, why  # the wave struck (whether a kill then
    # needed a replay to strike depends on when it came: the count is in kills_on_replays)
