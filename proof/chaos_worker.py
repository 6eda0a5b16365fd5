"""One worker process of the chaos harness (:mod:`proof.chaos`): the consumer side of a broker.

Started as ``python -m proof.chaos_worker CONFIG_JSON``. It reads one delivery per line (JSON)
on stdin and writes JSON lines on stdout: ``start`` when it takes a delivery, ``done`` or
``fail`` when it ends, ``stopping`` just before it freezes itself with SIGSTOP. Nothing else goes
to stdout; logs go to stderr.

Guarded mode runs the real job code path, :func:`engine.runtime.execute_request`, under a
:class:`resources.locks.RedisLock` on the job's resource, and reports ``done`` only after it
returned (the ack follows the record). Naive mode is what the defences replace: it acks first,
then does the effect with no idempotency claim, no lock and no ``Idempotency-Key``.

Fault hooks, chosen per delivery by the coordinator (so a run is reproducible from its seed):

- ``crash``: SIGKILL itself at ``before_effect`` (claim held, nothing charged or sent),
  ``after_effect`` (the charge or mail happened, its record not; for a reservation the job
  type's own ``SEKALI_CRASH_AT`` point inside the transaction) or ``after_record`` (key
  completed, ``done`` not yet reported).
- ``stop``: SIGSTOP itself at ``before_effect`` or ``after_effect``; the coordinator sends
  SIGCONT once the lease and the lock TTL have run out, so every later write is a stale one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from email.utils import make_msgid
from pathlib import Path
from typing import Any

from sqlalchemy import text

from engine.downstreams import ClientOptions
from engine.registry import get_job_type
from engine.runtime import execute_request
from engine.services import Services
from pipelines.domain.mail import SMTP
from pipelines.domain.payments import GATEWAY
from pipelines.jobs import email, payment
from resources.errors import ValidationError
from resources.locks import MemoryLockStats, RedisLock
from resources.retry import classify
from resources.storage.redis import redis_client
from resources.storage.settings import RedisTimeouts, Settings

logger = logging.getLogger(__name__)

CRASH_POINTS = ("before_effect", "after_effect", "after_record")
STOP_POINTS = ("before_effect", "after_effect")
# The job types' own crash hooks (engine.contract.crash_point) that mean "after the effect".
AFTER_EFFECT_HOOKS = "after_charge,after_send,before_commit_reservation"


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker needs; passed as JSON on its command line."""

    worker_id: int
    database_url: str
    redis_url: str
    gateway_url: str
    smtp_host: str
    smtp_port: int
    lease_seconds: float
    lock_ttl: float
    lock_wait: float
    naive: bool
    threads: int = 1
    # the sandbox commits a charge before it answers: a second is past its longest processing
    settle_seconds: float = 1.0
    # the payment client's bounds (None: the production defaults); the provider faults need
    # them short, so that a slow or dripping provider outlasts the client within the run
    gateway_timeout: float | None = None
    gateway_deadline: float | None = None
    # this process's wall clock is off by this much (clock-skew; see proof.skewed_clock)
    clock_offset: float = 0.0

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, raw: str) -> WorkerConfig:
        return cls(**json.loads(raw))


class _Channel:
    """Writes protocol lines to stdout; one writer at a time, flushed at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._out = sys.stdout

    def send(self, event: str, tok: str, **fields: Any) -> None:
        line = json.dumps({"t": event, "tok": tok, "pid": os.getpid(), **fields})
        with self._lock:
            self._out.write(line + "\n")
            self._out.flush()


class TransactionGate:
    """Counts the process's open database transactions and can hold new ones back.

    A stop fault freezes the whole process. Frozen inside a transaction it would hold the
    database's locks (SQLite's single write lock, a Postgres row lock) and stall every other
    worker until SIGCONT: the run would measure a lock pile-up, not the lease. So a thread
    about to freeze first waits until no other thread of its process is inside a transaction,
    and keeps new ones out until it wakes. A thread already inside one may nest.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = 0
        self._closed = False
        self._depth = threading.local()

    def wrap(self, db: Any) -> None:
        """Gate ``db.transaction`` and ``db.statement`` on this instance."""
        for name in ("transaction", "statement"):
            setattr(db, name, self._gated(getattr(db, name)))

    def _gated(self, original: Any) -> Any:
        @contextlib.contextmanager
        def gated(*args: Any, **kwargs: Any) -> Iterator[Any]:
            depth = getattr(self._depth, "n", 0)
            with self._cond:
                while self._closed and depth == 0:
                    self._cond.wait()
                self._open += 1
            self._depth.n = depth + 1
            try:
                with original(*args, **kwargs) as conn:
                    yield conn
            finally:
                self._depth.n = depth
                with self._cond:
                    self._open -= 1
                    self._cond.notify_all()

        return gated

    @contextlib.contextmanager
    def quiesced(self) -> Iterator[None]:
        with self._cond:
            self._closed = True
            while self._open:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._closed = False
                self._cond.notify_all()


class Hooks(threading.local):
    """The faults armed for the delivery this thread runs."""

    gate = TransactionGate()

    def __init__(self, channel: _Channel) -> None:
        self.channel = channel
        self.tok = ""
        self.crash: str | None = None
        self.stop: str | None = None

    def arm(self, msg: dict[str, Any], *, job_hooks: bool) -> None:
        self.tok = msg["tok"]
        self.crash = msg.get("crash")
        self.stop = msg.get("stop")
        if self.crash == "after_effect" and job_hooks and msg["job_type"] == "reserve_inventory":
            # inside the reservation transaction only the job type's own hook can strike; it
            # reads the (process-wide) environment, so another thread may hit it first: the
            # process dies at that point either way
            os.environ["SEKALI_CRASH_AT"] = AFTER_EFFECT_HOOKS

    def point(self, name: str) -> None:
        if self.crash == name:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.stop == name:
            self.stop = None
            with self.gate.quiesced():
                self.channel.send("stopping", self.tok, point=name)
                os.kill(os.getpid(), signal.SIGSTOP)
            self.channel.send("resumed", self.tok, point=name)


class HookedGateway:
    """The real HTTP gateway client with the fault points around ``charge``."""

    def __init__(self, inner: Any, hooks: Hooks) -> None:
        self.inner = inner
        self.hooks = hooks

    def charge(self, **kwargs: Any) -> Any:
        self.hooks.point("before_effect")
        charge = self.inner.charge(**kwargs)
        self.hooks.point("after_effect")
        return charge

    def find_charges(self, reference: str) -> Any:
        return self.inner.find_charges(reference)


class HookedMailer:
    """The real SMTP mailer with the fault points around ``send``."""

    def __init__(self, inner: Any, hooks: Hooks) -> None:
        self.inner = inner
        self.hooks = hooks

    def send(self, **kwargs: Any) -> None:
        self.hooks.point("before_effect")
        self.inner.send(**kwargs)
        self.hooks.point("after_effect")


class Worker:
    """Runs deliveries on ``threads`` consumer threads (a broker consumer with that prefetch).
    Every thread shares one :class:`engine.services.Services`, as the threads of a run
    worker would."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.channel = _Channel()
        self.hooks = Hooks(self.channel)
        settings = Settings(
            database_url=config.database_url,
            redis_url=config.redis_url,
            dagster_home=Path("."),
            gateway_url=config.gateway_url,
            smtp_host=config.smtp_host,
            smtp_port=config.smtp_port,
            gateway_settle_seconds=config.settle_seconds,
        )
        gateway = ClientOptions(
            timeout=config.gateway_timeout, deadline=config.gateway_deadline,
            extra={"send_idempotency_key": not config.naive},
        )
        self.services = Services.from_settings(
            settings, lease_seconds=config.lease_seconds, options={GATEWAY.name: gateway}
        )
        Hooks.gate.wrap(self.services.db)  # the store and the attempts share this Database
        clients = self.services.clients
        clients[GATEWAY.name] = HookedGateway(clients[GATEWAY.name], self.hooks)
        clients[SMTP.name] = HookedMailer(clients[SMTP.name], self.hooks)
        self.redis = redis_client(config.redis_url, timeouts=RedisTimeouts(connect=1.0))

    def handle(self, msg: dict[str, Any]) -> None:
        self.hooks.arm(msg, job_hooks=not self.config.naive)
        tok = msg["tok"]
        self.channel.send("start", tok)
        try:
            if self.config.naive:
                self._naive(msg)
            else:
                self._guarded(msg)
        finally:
            if self.hooks.crash == "after_effect":
                os.environ["SEKALI_CRASH_AT"] = ""

    # -- guarded: the real code path -------------------------------------------------------

    def _lock_name(self, job_type: str, payload: dict[str, Any]) -> str | None:
        jt = get_job_type(job_type)
        try:
            return f"chaos:{job_type}:{jt.resource_id(jt.validate(dict(payload)))}"
        except ValidationError:
            return None  # the runtime validates again, records the attempt and raises

    def _guarded(self, msg: dict[str, Any]) -> None:
        tok = msg["tok"]
        try:
            name = self._lock_name(msg["job_type"], msg["payload"])
            lock = (
                RedisLock(
                    self.redis, name, ttl=self.config.lock_ttl,
                    blocking_timeout=self.config.lock_wait, observer=MemoryLockStats(),
                )
                if name is not None
                else None
            )
            if lock is not None:
                lock.acquire()
            try:
                self.hooks.point("after_lock")
                outcome = execute_request(
                    msg["job_type"],
                    msg["payload"],
                    services=self.services,
                    run_id=f"chaos-{tok}",
                    step=f"{msg['job_type']}_op",
                    attempt=int(msg.get("attempt", 0)),
                    correlation_id=f"chaos-req-{msg['req']}",
                    request_id=int(msg["req"]),
                )
            finally:
                if lock is not None:
                    lock.release()
        except Exception as exc:  # noqa: BLE001 - every failure is reported to the broker
            self.channel.send(
                "fail", tok, error=type(exc).__name__, kind=str(classify(exc)),
                message=str(exc)[:500],
                retry_after=getattr(exc, "retry_after", None),
            )
            return
        self.hooks.point("after_record")
        self.channel.send("done", tok, status=outcome.status, fence=outcome.fence)

    # -- naive: ack first, no claim, no lock, no key ------------------------------------------

    def _naive(self, msg: dict[str, Any]) -> None:
        self.channel.send("done", msg["tok"], status="acked_before_work", fence=0)
        try:
            self._naive_effect(msg["job_type"], msg["payload"], int(msg["req"]))
        except Exception as exc:  # noqa: BLE001 - the naive consumer logs and moves on
            logger.warning("naive delivery %s failed after its ack: %r", msg["tok"], exc)
        self.hooks.point("after_record")

    def _naive_effect(self, job_type: str, payload: dict[str, Any], req: int) -> None:
        jt = get_job_type(job_type)
        clean = jt.validate(dict(payload))
        key = jt.key_for(clean)
        correlation_id = f"chaos-req-{req}"
        if job_type == "charge_payment":
            self.services.client(GATEWAY.name).charge(
                reference=payment.reference_for(key), amount_cents=clean["amount_cents"],
                currency=clean["currency"], idempotency_key=None, correlation_id=correlation_id,
            )
        elif job_type == "send_email":
            subject, body = email.render(clean)
            self.services.client(SMTP.name).send(
                to=clean["to"], subject=subject, body=body,
                message_id=make_msgid(domain="naive.sekali"), correlation_id=correlation_id,
            )
        elif job_type == "reserve_inventory":
            self.hooks.point("before_effect")
            with self.services.db.transaction() as conn:
                for item in clean["items"]:
                    conn.execute(
                        text("UPDATE stock SET reserved = reserved + :q, updated_at = :now"
                             " WHERE sku = :sku"),
                        {"q": item["quantity"], "sku": item["sku"], "now": time.time()},
                    )
                    conn.execute(
                        text("INSERT INTO reservations (cart_id, sku, quantity, status, fence,"
                             " created_at, updated_at) VALUES (:c, :s, :q, 'reserved', 0, :now,"
                             " :now) ON CONFLICT DO NOTHING"),
                        {"c": clean["cart_id"], "s": item["sku"], "q": item["quantity"],
                         "now": time.time()},
                    )
            self.hooks.point("after_effect")
        else:
            raise ValueError(f"the naive worker has no effect for {job_type!r}")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    config = WorkerConfig.from_json(args[0])
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr,
        format=f"%(asctime)s w{config.worker_id} %(levelname)s %(name)s: %(message)s",
    )
    worker = Worker(config)
    inbox: queue.Queue[dict[str, Any] | None] = queue.Queue()

    def consume() -> None:
        while (msg := inbox.get()) is not None:
            try:
                worker.handle(msg)
            except Exception as exc:  # noqa: BLE001 - a bug must not look like a crash fault
                logger.exception("worker bug on %s", msg.get("tok"))
                worker.channel.send("fail", msg.get("tok", ""), error=type(exc).__name__,
                                    kind="unknown", message=f"chaos worker bug: {exc}"[:500])

    threads = [threading.Thread(target=consume, name=f"consumer-{i}", daemon=True)
               for i in range(max(1, config.threads))]
    for t in threads:
        t.start()
    worker.channel.send("ready", "")
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        msg = json.loads(line)
        if msg.get("t") == "exit":
            break
        inbox.put(msg)
    for _ in threads:
        inbox.put(None)
    for t in threads:
        t.join(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
