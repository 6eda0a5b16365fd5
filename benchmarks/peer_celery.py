"""The Celery side of ``sekali bench --only peers``: a Celery 5 app on the Redis broker, set up
the way Celery's documentation asks for jobs that must survive a dying worker.

- ``task_acks_late``: the message is acknowledged after the task ran, so a worker that dies
  mid-task leaves it to be delivered again;
- ``task_reject_on_worker_lost``: when a pool child is killed the message is requeued at once
  instead of acknowledged as failed;
- ``worker_prefetch_multiplier = 1``: with late acks a child reserves one message at a time;
- no result backend (``task_ignore_result``): the effect is the mail;
- explicit broker timeouts (connect and socket) and the transport's visibility timeout, so no
  client waits without a bound.

Run as Celery users run it, with its own worker CLI and prefork pool::

    SEKALI_PEERS_BROKER_URL=redis://127.0.0.1:PORT/0 SEKALI_SMTP_PORT=PORT \\
        celery -A benchmarks.peer_celery worker --pool prefork --concurrency 2 -Q QUEUE

Importing this module opens no connection (Celery connects on first use).
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from benchmarks import peer_handler

BROKER_ENV = "SEKALI_PEERS_BROKER_URL"
app = Celery("sekali_peers", broker=os.environ.get(BROKER_ENV, "redis://127.0.0.1:6379/15"))
app.conf.update(
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    task_ignore_result=True,
    broker_connection_timeout=4,
    broker_connection_retry_on_startup=True,
    broker_transport_options={
        "visibility_timeout": 3600,
        "socket_connect_timeout": 3,
        "socket_timeout": 10,
    },
    worker_hijack_root_logger=False,
)


@app.task(name="send_email")
def send_email(payload: dict[str, Any]) -> str:
    return peer_handler.send_email(payload)
