"""The benchmarks' own counting: the peers benchmark counts at the mail sink, from the sink's own
rows (a second mail of one intent is a duplicate, an intent without a mail is lost, whoever sent
them), judges each sekali deployment against the targets, and bills a job net of a deployment's
idle background; its quick run measures sekali as deployed; the cluster benchmark's
enqueue-to-start comes per request from its first run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from benchmarks import peer_handler, peers
from benchmarks.backends import private_postgres
from benchmarks.cluster import timeline_of
from benchmarks.intake import payloads
from benchmarks.peers import Counters, SinkRecords, installed, per_job, postgres_databases, watch
from benchmarks.suite import met, target_text
from sandbox.mailsink import MailSink
from sandbox.postgres_server import PostgresUnavailable
from tests.conftest import need_server


def test_duplicates_and_lost_are_counted_per_intent_at_the_sink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Catches a count taken from what workers reported, or one that takes a resend (same
    Message-ID) for a new intent: three intents, the first sent twice, the third never."""
    sink = MailSink(f"sqlite:///{tmp_path / 'sink.db'}").start()
    try:
        items = payloads("count", 3)
        w = watch(SinkRecords(tmp_path / "sink.db"), items)
        monkeypatch.setenv("SEKALI_SMTP_PORT", str(sink.port))
        peer_handler.mailer.cache_clear()
        send = peer_handler.send_email
        ids = [send(items[0]), send(items[0]), send(items[1])]
        w.poll()
    finally:
        sink.stop()
    assert ids[0] == ids[1] != ids[2]
    assert w.mails == 3 and len(w.first) == 2
    assert w.mails - len(w.first) == 1  # duplicates
    assert len(w.wanted) - len(w.first) == 1  # lost
    assert not w.done()


def test_cluster_report_has_enqueue_to_start_per_request_from_its_first_run() -> None:
    """Catches an enqueue-to-start figure taken per run (a batch of 50 is one run) or from a
    retry's start instead of the first run's: requests 1-3 in one batch run started at 10 s and
    retried at 30 s, request 4 alone at 12 s."""
    runs = [
        {"tags": {"sekali/intake": "micro_batch", "sekali/request_ids": "1,2,3"},
         "creationTime": 9.0, "startTime": 10.0, "endTime": 11.0, "location": "w1"},
        {"tags": {"sekali/intake": "micro_batch", "sekali/request_ids": "1,2,3"},
         "creationTime": 29.0, "startTime": 30.0, "endTime": 31.0, "location": "w1"},
        {"tags": {"sekali/intake": "per_request", "sekali/request_id": "4"},
         "creationTime": 11.0, "startTime": 12.0, "endTime": 13.0, "location": "w2"},
        {"tags": {"dagster/sensor_name": "other"}, "creationTime": 0.0, "startTime": 0.0,
         "endTime": 99.0, "location": "w1"},
    ]
    timeline = timeline_of(runs, {1: 4.0, 2: 6.0, 3: 8.0, 4: 11.0})
    assert timeline["count"] == 3
    assert timeline["enqueue_to_start_p50_s"] == 4.0  # 6, 4, 2 and 1 s
    assert timeline["enqueue_to_start_max_s"] == 6.0


def test_a_peer_that_fails_to_import_is_left_out_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Catches a peers suite that takes a peer for installed because its files are found, then
    fails on the import (``sekali bench --quick`` failed the whole suite that way): a stand-in
    ``celery`` that raises ImportError, as a missing or half-installed one does."""
    hidden = tmp_path / "hidden" / "celery"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('celery is hidden')\n")
    monkeypatch.syspath_prepend(str(hidden.parent))
    for name in [m for m in sys.modules if m == "celery" or m.startswith("celery.")]:
        monkeypatch.delitem(sys.modules, name)

    assert installed("celery") is False
    said = [line for line in capsys.readouterr().err.splitlines() if "celery" in line]
    assert len(said) == 1 and "pip install -e '.[bench]'" in said[0]
    assert "measures sekali's side" in said[0]


def test_the_private_cluster_is_started_once_per_run_and_the_suites_drop_their_databases() -> None:
    """Catches a run that starts a private PostgreSQL cluster per suite again (an ``initdb`` and a
    server start each), and a suite that leaves its databases on the shared cluster."""
    try:
        server = private_postgres()
    except PostgresUnavailable as exc:
        need_server("a private PostgreSQL cluster (initdb, pg_ctl)", exc)
        raise
    assert private_postgres() is server
    with postgres_databases(["sekali"]) as urls:
        assert f"127.0.0.1:{server.port}/" in urls["sekali"]
        made = urls["sekali"].rsplit("/", 1)[1]
    engine = create_engine(server.url())
    with engine.connect() as conn:
        names = conn.execute(text("SELECT datname FROM pg_database")).scalars().all()
    engine.dispose()
    assert made not in names
    assert server.postmaster_pid() is not None  # still up for the next suite


def test_sekali_targets_are_met_only_when_every_sekali_deployment_meets_them() -> None:
    """Catches a per-deployment headline judged on one deployment only (SQLite passing while
    the production profile on Postgres misses), or on a peer's figure: the ``sekali>=`` and
    ``sekali<=`` verdicts look at every ``sekali*`` entry and nothing else."""
    assert met("sekali>=", 1.0, {"sekali": 1.2, "sekali_postgres": 1.1, "celery": 0.1}) is True
    assert met("sekali>=", 1.0, {"sekali": 1.2, "sekali_postgres": 0.9}) is False
    assert met("sekali<=", 50.0, {"sekali": 12.0, "sekali_postgres": None}) is False
    assert met("sekali<=", 50.0, {"celery": 10.0}) is None
    assert target_text("sekali<=", 500.0) == "sekali <= 500"


def test_costs_per_job_are_net_of_the_deployments_idle_rate() -> None:
    """Catches costs per job that bill a deployment's background (sensor ticks, heartbeats,
    run monitoring: rows and CPU it spends with nothing to do) to the jobs, or that lose it
    from the gross figure: 10 s, 500 jobs, 40 CPU-seconds and 2,000 event rows of which the
    idle rates (1 CPU-s/s, 100 rows/s) account for 10 and 1,000."""
    before = Counters(at=0.0, cpu=5.0, dagster={"event_rows": 100})
    after = Counters(at=10.0, cpu=45.0, dagster={"event_rows": 2100})
    costs = per_job(before, after, 500, {"cpu_seconds": 1.0, "dagster_event_rows": 100.0})
    assert costs["cpu_seconds_per_job"] == 0.08
    assert costs["cpu_seconds_per_job_net"] == 0.06
    assert costs["dagster_event_rows_per_1000_jobs"] == 4000.0
    assert costs["dagster_event_rows_per_1000_jobs_net"] == 2000.0


@pytest.mark.slow
@pytest.mark.dagster
@pytest.mark.postgres
@pytest.mark.timeout(3600)
def test_quick_peers_run_measures_sekali_as_deployed_and_keeps_every_intent_once() -> None:
    """The quick run end to end: ``sekali dev`` and the production profile started as deployed,
    each measured beside Celery in interleaved repetitions. Catches a headline that leaves a
    deployment out or has fewer repetitions than it claims, a worker-run or daemon kill that
    loses or repeats a mail, and a dead letter that ends its worker run (its run must still be
    STARTED and the requests after it sent). Asserts structure and counts, never times."""
    try:
        private_postgres()
    except PostgresUnavailable as exc:
        need_server("a private PostgreSQL cluster (initdb, pg_ctl)", exc)
        raise
    report = peers.run(quick=True)
    h = report["headline"]
    for key in ("peers_latency_p50_ms", "peers_latency_p99_ms", "first_effect_idle_ms"):
        assert {"sekali", "sekali_postgres"} <= set(h[key])
        assert all(v is not None and v > 0 for k, v in h[key].items() if k.startswith("sekali"))
    if "celery" in report["systems"]:
        assert set(h["peers_sekali_over_celery"]) == {"sekali", "sekali_postgres"}
        spread = report["headline_spread"]["peers_sekali_over_celery.sekali_postgres"]
        assert len(spread["runs"]) >= 3
    for name in ("sekali", "sekali_postgres"):
        assert h["peers_duplicates_under_kills"][name] == {"duplicates": 0, "lost": 0}
        kills = report["systems"][name]["kills"]["kills"]
        assert sum(k["what"] == "worker" for k in kills) >= 1
        assert h["peers_dead_letter_run_kept_going"][name] is True
        assert h["peers_dead_letter_after_decision_ms"][name] is not None
        costs = report["systems"][name]["costs"]
        assert costs["cpu_seconds_per_job"] > 0
        assert costs["dagster_event_rows_per_1000_jobs"] >= 0
    assert any(k["what"] == "daemon"
               for k in report["systems"]["sekali_postgres"]["kills"]["kills"])
    assert report["sekali_daemon_restarts"]["sekali_postgres"] == 1
    assert met("zero", 0, h["peers_duplicates_under_kills"]) is True
