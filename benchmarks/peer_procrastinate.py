"""The procrastinate side of ``sekali bench --only peers``: a procrastinate app on Postgres,
with the recovery its documentation recommends for workers that die.

A worker killed with SIGKILL leaves its job in ``doing``; procrastinate's answer (docs: "Retry
stalled jobs") is a task that asks for the jobs of workers whose heartbeat stopped and retries
them: :func:`retry_stalled_jobs`, which the harness runs every second during a run with kills
(the documentation schedules it every ten minutes; the benchmark cannot wait that long). The
workers beat every ``HEARTBEAT_SECONDS`` and a job counts as stalled after ``STALLED_SECONDS``
without one (10 s and 30 s by default, shortened here as the documentation says to do together).

Run as procrastinate users run it, with its own worker CLI::

    export SEKALI_PEERS_PG_CONNINFO="host=127.0.0.1 port=PORT user=postgres dbname=DB"
    SEKALI_SMTP_PORT=PORT procrastinate --app=benchmarks.peer_procrastinate.app \\
        worker --concurrency 1 -q QUEUE

Importing this module opens no connection.
"""

from __future__ import annotations

import os
from typing import Any

from procrastinate import App, PsycopgConnector

from benchmarks import peer_handler

CONNINFO_ENV = "SEKALI_PEERS_PG_CONNINFO"
HEARTBEAT_SECONDS = 1.0
STALLED_SECONDS = 3.0

app = App(
    connector=PsycopgConnector(
        conninfo=os.environ.get(CONNINFO_ENV, "host=127.0.0.1 user=postgres dbname=postgres")
        + " connect_timeout=3",
        kwargs={"options": "-c statement_timeout=30000"},
        timeout=10,
    ),
    worker_defaults={
        "update_heartbeat_interval": HEARTBEAT_SECONDS,
        "stalled_worker_timeout": STALLED_SECONDS,
    },
)


@app.task(name="send_email")
def send_email(payload: dict[str, Any]) -> str:
    return peer_handler.send_email(payload)


async def retry_stalled_jobs(opened: App = app) -> int:
    """The documented recovery, on an app opened asynchronously: retry the jobs of workers
    that stopped beating. Returns how many were retried."""
    stalled = await opened.job_manager.get_stalled_jobs(seconds_since_heartbeat=STALLED_SECONDS)
    n = 0
    for job in stalled:
        await opened.job_manager.retry_job(job)
        n += 1
    return n
