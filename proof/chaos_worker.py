"""One worker process of the chaos harness (:mod:`proof.chaos`): the consumer side of a broker.

Started as ``python -m proof.chaos_worker`` with its configuration (JSON) in the environment
variable ``SEKALI_CHAOS_WORKER_CONFIG``: it holds the database and Redis URLs with their
passwords, which a command line would show every local user. It reads one delivery per line (JSON)
on stdin and writes JSON lines on stdout: ``start`` when it takes a delivery, ``done`` or
``fail`` when it ends, ``stopping`` just before it freezes itself with SIGSTOP. Nothing else goes
to stdout; logs go to stderr.

Guarded mode runs each delivery through the step entry the per-request Dagster op calls,
:func:`engine.step.run_step` (admission, claim, concurrency slots, handler, the failure path with
the retry policy and the shared retry budget, the request settled), with no lock of its own
around it, and reports ``done`` only after it returned (the ack follows the record); a failure
is reported with the path's decision (retry after its delay, or give up), which the coordinator
follows as Dagster follows ``RetryRequested``/``Failure``. Naive mode is what the defences
replace: it acks first, then does the effect with no idempotency claim and no
``Idempotency-Key``.

Fault hooks, chosen per delivery by the coordinator (so a run is reproducible from its seed):

- ``crash``: SIGKILL itself at ``before_effect`` (claim held, nothing charged or sent),
  ``after_effect`` (the charge or mail happened, its record not; for a reservation the job
  type's own ``SEKALI_CRASH_AT`` point inside the transaction) or ``after_record`` (key
  completed, ``done`` not yet reported).
- ``stop``: SIGSTOP itself at ``before_effect`` or ``after_effect``; the coordinator sends
  SIGCONT once the lease has run out, so every later write is a stale one.

A handler that hangs (a job type's downstream that never answers) is abandoned by the engine at
its job type's ``max_runtime_seconds`` and its delivery reported failed, ``timed_out``; the
worker then exits (:data:`TIMED_OUT_EXIT`), as a resident worker does, so the hung thread ends
with its process, and the coordinator starts a fresh worker (deliveries in flight on its other
threads are redelivered, as after a crash).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import logging
import os
import queue
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.contract import freeze_here
from engine.downstreams import ClientOptions
from engine.registry import JOB_TYPES, get_job_type
from engine.services import Services
from engine.step import StepAttempt, run_step
from proof.chaos_mix import after_effect_points, chaos_of, mix_names
from proof.chaos_outbox import Relay
from resources.errors import HandlerTimedOut
from resources.retry import RetryBudget, RetryPolicy, classify, failure_class
from resources.send_bound import SectionGate
from resources.storage.redis import redis_client
from resources.storage.settings import SETTLE_ENV, RedisTimeouts, Settings

logger = logging.getLogger(__name__)
TIMED_OUT_EXIT = 3
"""The exit code of a worker that ended itself after the engine abandoned a hung handler."""

CRASH_POINTS = ("before_effect", "after_effect", "after_record")
STOP_POINTS = ("before_effect", "after_effect")


def calls_out(job_type: str) -> bool:
    """Whether ``job_type``'s effect goes through a downstream call, the client the fault points
    wrap (a charge, a mail), rather than a transaction of its own (a reservation): a kill or a
    stop armed on its delivery reaches a point only then."""
    return bool(get_job_type(job_type).calls.clients)


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
    naive: bool
    # the retry policy of the run (the shipped RetryPolicy, with a chaos run's short delays)
    max_attempts: int = 8
    retry_base: float = 0.1
    retry_cap: float = 1.5
    threads: int = 1
    # the sandbox commits a charge before it answers: a second is past its longest processing
    settle_seconds: float = 1.0
    # the payment client's bounds (None: the production defaults); the provider faults need
    # them short, so that a slow or dripping provider outlasts the client within the run
    gateway_timeout: float | None = None
    gateway_deadline: float | None = None
    # this process's wall clock is off by this much (clock-skew; see proof.skewed_clock)
    clock_offset: float = 0.0
    # --job-type runs: the job types under test, whose declared downstreams get the generic
    # fault points (HookedClient); env: what the process's environment gets on top (the moved
    # sandboxes' addresses, SEKALI_ADAPTIVE)
    job_types: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    # --dagster: each delivery is a run of the job type's per-request Dagster job on the
    # instance in this DAGSTER_HOME; a failed run goes to the DLQ through the sensor's path
    dagster_home: str = ""
    # budget-redis-down: the retry budget on a Redis of its own, which the fault kills
    budget_redis_url: str = ""
    # the mail sink's record (SEKALI_SMTP_LOG_URL, as the sandbox configures it): a retried or
    # taken-over mail is looked up by Message-ID before it is sent again
    smtp_log_url: str = ""
    # crash-loop: the deaths mid-run a key may cause (None: SEKALI_CRASH_LOOP_LIMIT's)
    crash_loop_limit: int | None = None
    # poison-outbox: the process runs the outbox relay beside its deliveries
    outbox_relay: bool = False
    # --delivery resident (proof.chaos_resident): the queue this process's resident worker
    # serves, the owner its claims are held under, its batch, and the requests whose every run
    # kills the process (crash-loop), by correlation id
    queue: str = ""
    owner: str = ""
    batch_size: int = 4
    crash_loops: tuple[str, ...] = ()
    wakeup_namespace: str = ""
    # --delivery resident --dagster: the worker run the supervisor asked for
    run_config: dict[str, Any] = field(default_factory=dict)
    run_tags: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, raw: str) -> WorkerConfig:
        data = json.loads(raw)
        data["job_types"] = tuple(data.get("job_types", ()))
        data["crash_loops"] = tuple(data.get("crash_loops", ()))
        return cls(**data)


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
        self._sections = SectionGate()
        self._depth = threading.local()

    def wrap(self, db: Any) -> None:
        """Gate ``db.transaction`` and ``db.statement`` on this instance."""
        for name in ("transaction", "statement"):
            setattr(db, name, self._gated(getattr(db, name)))

    def _gated(self, original: Any) -> Any:
        @contextlib.contextmanager
        def gated(*args: Any, **kwargs: Any) -> Iterator[Any]:
            depth = getattr(self._depth, "n", 0)
            outer = self._sections.section() if depth == 0 else contextlib.nullcontext()
            with outer:
                self._depth.n = depth + 1
                try:
                    with original(*args, **kwargs) as conn:
                        yield conn
                finally:
                    self._depth.n = depth

        return gated

    def quiesced(self) -> contextlib.AbstractContextManager[None]:
        return self._sections.quiesced()


@dataclass
class _Armed:
    """The faults armed for one delivery."""

    tok: str = ""
    crash: str | None = None
    stop: str | None = None
    drop: bool = False


_ARMED: contextvars.ContextVar[_Armed] = contextvars.ContextVar("chaos_armed")


class Hooks:
    """The faults armed for the delivery being run. Kept in a context variable, not per
    thread: the engine runs each handler in a thread of its own with its caller's context
    (:func:`engine.runtime.run_bounded`), so the fault points the handler reaches see what its
    delivery's consumer thread armed (per thread, they saw nothing armed)."""

    gate = TransactionGate()

    def __init__(self, channel: _Channel) -> None:
        self.channel = channel

    @property
    def _armed(self) -> _Armed:
        try:
            return _ARMED.get()
        except LookupError:
            armed = _Armed()
            _ARMED.set(armed)
            return armed

    @property
    def tok(self) -> str:
        return self._armed.tok

    @property
    def crash(self) -> str | None:
        return self._armed.crash

    @property
    def stop(self) -> str | None:
        return self._armed.stop

    @stop.setter
    def stop(self, value: str | None) -> None:
        self._armed.stop = value

    @property
    def drop(self) -> bool:
        return self._armed.drop

    @drop.setter
    def drop(self, value: bool) -> None:
        self._armed.drop = value

    def arm(self, msg: dict[str, Any], *, job_hooks: bool) -> None:
        _ARMED.set(_Armed(msg["tok"], msg.get("crash"), msg.get("stop"), bool(msg.get("drop"))))
        if self.crash == "after_effect" and job_hooks and not calls_out(msg["job_type"]):
            # inside an effect that is a transaction of its own only the job type's own hook
            # can strike; it reads the (process-wide) environment, so another thread may hit it
            # first: the process dies at that point either way
            # (the job types' own crash hooks, engine.contract.crash_point, that mean "after the
            # effect", as each declares them)
            os.environ["SEKALI_CRASH_AT"] = after_effect_points(list(JOB_TYPES))

    def point(self, name: str) -> None:
        if self.crash == name:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.stop == name:
            self.stop = None
            with self.gate.quiesced():
                self.channel.send("stopping", self.tok, point=name)
                freeze_here()
            self.channel.send("resumed", self.tok, point=name)


class PointedClient:
    """A real client with the fault points around the calls that make its effect
    (``effects``), and ``reads`` passed through: it offers those alone, as the job types of the
    mix declare them (:class:`engine.chaos.ChaosProof`)."""

    def __init__(self, inner: Any, hooks: Hooks, effects: frozenset[str],
                 reads: frozenset[str]) -> None:
        self.inner = inner
        self.hooks = hooks
        self.effects = effects
        self.reads = reads

    def __getattr__(self, name: str) -> Any:
        if name in self.reads:
            return getattr(self.inner, name)
        if name not in self.effects:
            raise AttributeError(name)
        value = getattr(self.inner, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.hooks.point("before_effect")
            answer = value(*args, **kwargs)
            self.hooks.point("after_effect")
            return answer

        return call


class DroppedAnswer(ConnectionResetError):
    """drop-response: the downstream took the call and its answer never came back."""


class HookedClient:
    """Any declared downstream's client with the fault points around its effect calls: every
    public method but the ones the job type's lookup hook reads with (``reads``). A drop
    armed for the delivery raises :class:`DroppedAnswer` after the effect call returned."""

    def __init__(self, inner: Any, hooks: Hooks, reads: frozenset[str]) -> None:
        self.inner = inner
        self.hooks = hooks
        self.reads = reads

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        if not callable(value) or name.startswith("_") or name in self.reads:
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            self.hooks.point("before_effect")
            answer = value(*args, **kwargs)
            self.hooks.point("after_effect")
            if self.hooks.drop:
                self.hooks.drop = False
                self.hooks.channel.send("dropped", self.hooks.tok, call=name)
                raise DroppedAnswer(f"{name}: the downstream gave no answer (drop-response)")
            return answer

        return call


class _Recorder:
    """Delegates to a client and writes down the methods called on it."""

    def __init__(self, inner: Any, seen: set[str]) -> None:
        self.inner = inner
        self.seen = seen

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        if callable(value) and not name.startswith("_"):
            self.seen.add(name)
        return value


def lookup_reads(job_type: str, clients: dict[str, Any]) -> frozenset[str]:
    """The client methods ``job_type``'s lookup hook calls, found by calling it once for its
    example (against the sandbox, which holds nothing for it yet)."""
    jt = get_job_type(job_type)
    seen: set[str] = set()
    if jt.calls.lookup is None or not jt.presentation.example:
        return frozenset()
    try:
        clean = jt.validate(dict(jt.presentation.example))
        jt.calls.lookup(lambda name: _Recorder(clients[name], seen), jt.keying.key_for(clean),
                        clean)
    except Exception:  # noqa: BLE001 - the reads recorded before it failed are what we know
        logger.warning("the lookup of %s failed on its example", job_type, exc_info=True)
    return frozenset(seen)


def build_services(config: WorkerConfig) -> Services:
    """The services of a chaos worker process, as a run worker builds them, with the run's
    lease, retry policy, budget and crash-loop bound; every transaction passes the process's
    :class:`TransactionGate` (a stop fault freezes only outside one)."""
    os.environ.update(config.env)  # the sandboxes' addresses, whether leases adapt
    if config.job_types:
        os.environ.update({"DATABASE_URL": config.database_url,
                           "REDIS_URL": config.redis_url,
                           SETTLE_ENV: str(config.settle_seconds)})
        settings = dataclasses.replace(
            Settings.from_env(), database_url=config.database_url,
            redis_url=config.redis_url, dagster_home=Path("."),
            gateway_settle_seconds=config.settle_seconds,
        )
    else:
        settings = Settings(
            database_url=config.database_url,
            redis_url=config.redis_url,
            dagster_home=Path("."),
            gateway_url=config.gateway_url,
            smtp_host=config.smtp_host,
            smtp_port=config.smtp_port,
            smtp_log_url=config.smtp_log_url or None,
            gateway_settle_seconds=config.settle_seconds,
        )
    # the provider's client (a downstream that dedupes by the idempotency key it is sent): the
    # run's bounds, and no key sent when naive
    provider = ClientOptions(
        timeout=config.gateway_timeout, deadline=config.gateway_deadline,
        extra={"send_idempotency_key": not config.naive},
    )
    options = {d.name: provider for jt in JOB_TYPES.values() for d in jt.calls.clients
               if d.dedupes}
    services = Services.from_settings(
        settings, lease_seconds=config.lease_seconds, options=options,
        retry_policy=RetryPolicy(max_attempts=config.max_attempts,
                                 base_delay=config.retry_base, max_delay=config.retry_cap,
                                 max_unknown_attempts=config.max_attempts),
    )
    if config.budget_redis_url:
        services.retry_budget = RetryBudget(
            redis_client(config.budget_redis_url, timeouts=RedisTimeouts(socket=2.0,
                                                                         connect=1.0)))
    if config.crash_loop_limit is not None:
        services.crash_loop_limit = config.crash_loop_limit
    Hooks.gate.wrap(services.db)  # the store and the attempts share this Database
    return services


Deliveries = Callable[["WorkerConfig", dict[str, Any]], Any]
"""Builds what runs each delivery instead of the step entry (``deliver(msg) -> (event, tok,
fields)``): :mod:`proof.chaos_dagster`'s real Dagster runs."""


class Worker:
    """Runs deliveries on ``threads`` consumer threads (a broker consumer with that prefetch).
    Every thread shares one :class:`engine.services.Services`, as the threads of a run
    worker would."""

    def __init__(self, config: WorkerConfig, deliveries: Deliveries | None = None) -> None:
        self.config = config
        self.channel = _Channel()
        self.hooks = Hooks(self.channel)
        self.services = build_services(config)
        clients = self.services.clients
        if config.job_types:
            reads: dict[str, frozenset[str]] = {}
            for name in config.job_types:
                found = lookup_reads(name, clients)
                for downstream in get_job_type(name).calls.clients:
                    reads[downstream.name] = reads.get(downstream.name, frozenset()) | found
            for downstream_name, read in reads.items():
                clients[downstream_name] = HookedClient(clients[downstream_name], self.hooks, read)
        else:
            effects: dict[str, frozenset[str]] = {}
            plain: dict[str, frozenset[str]] = {}
            for name in mix_names():
                chaos = chaos_of(JOB_TYPES[name])
                for downstream in JOB_TYPES[name].calls.clients:
                    effects[downstream.name] = (effects.get(downstream.name, frozenset())
                                                | frozenset(chaos.effect_calls))
                    plain[downstream.name] = (plain.get(downstream.name, frozenset())
                                              | frozenset(chaos.lookup_calls))
            for downstream_name, made in effects.items():
                clients[downstream_name] = PointedClient(
                    clients[downstream_name], self.hooks, made, plain[downstream_name])
        self.dagster = deliveries(config, clients) if deliveries is not None else None

    def handle(self, msg: dict[str, Any]) -> None:
        self.hooks.arm(msg, job_hooks=not self.config.naive)
        tok = msg["tok"]
        self.channel.send("start", tok)
        try:
            if self.config.naive:
                self._naive(msg)
            elif self.dagster is not None:
                event, tok, fields = self.dagster.deliver(msg)
                if event == "done":
                    self.hooks.point("after_record")
                self.channel.send(event, tok, **fields)
            else:
                self._guarded(msg)
        finally:
            if self.hooks.crash == "after_effect":
                os.environ["SEKALI_CRASH_AT"] = ""

    # -- guarded: the shipped step entry ----------------------------------------------------

    def _guarded(self, msg: dict[str, Any]) -> None:
        tok = msg["tok"]
        delivery = tok.split(".")[0]  # one delivery is one run; its redeliveries are attempts
        try:
            result = run_step(
                self.services,
                StepAttempt(run_id=f"chaos-{delivery}", step=f"{msg['job_type']}_op",
                            attempt=int(msg.get("attempt", 0))),
                job_type=msg["job_type"],
                payload=msg["payload"],
                request_id=int(msg["request_id"]),
                correlation_id=f"chaos-req-{msg['req']}",
                replay_of=msg.get("replay_of"),
            )
        except Exception as exc:  # noqa: BLE001 - out of the step: Dagster fails the run
            self.channel.send("fail", tok, error=type(exc).__name__, kind=str(classify(exc)),
                              message=str(exc)[:500], retry=False, outcome="run_failed")
            return
        if result.error is not None:
            error, decision = result.error, result.decision
            assert decision is not None
            self.channel.send(
                "fail", tok, error=type(error).__name__, kind=str(decision.error_class),
                message=str(error)[:500], retry=decision.retry, delay=decision.delay,
                reason=decision.reason, outcome=str(result.recorded),
                dlq_class=str(failure_class(error)),
            )
            if isinstance(error, HandlerTimedOut):  # its thread hangs on: end with it
                logger.error("worker %s exits: %s", self.config.worker_id, error)
                sys.stderr.flush()
                os._exit(TIMED_OUT_EXIT)
            return
        assert result.outcome is not None
        self.hooks.point("after_record")
        self.channel.send("done", tok, status=result.outcome.status, fence=result.outcome.fence)

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
        naive = chaos_of(jt).naive
        if naive is None:
            raise ValueError(f"the naive worker has no effect for {job_type!r}: it declares "
                             "no ChaosProof.naive")
        naive(_NaiveRun(self.services, self.hooks), clean, jt.keying.key_for(clean),
              f"chaos-req-{req}")


class _NaiveRun:
    """What a job type's naive effect may use (:class:`engine.chaos.NaiveRun`)."""

    def __init__(self, services: Services, hooks: Hooks) -> None:
        self.db = services.db
        self._services = services
        self._hooks = hooks

    def client(self, name: str) -> Any:
        return self._services.client(name)

    def point(self, name: str) -> None:
        self._hooks.point(name)


CONFIG_ENV = "SEKALI_CHAOS_WORKER_CONFIG"


def main(argv: list[str] | None = None, deliveries: Deliveries | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    config = WorkerConfig.from_json(args[0] if args else os.environ[CONFIG_ENV])
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr,
        format=f"%(asctime)s w{config.worker_id} %(levelname)s %(name)s: %(message)s",
    )
    worker = Worker(config, deliveries)
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
    if config.outbox_relay:
        Relay(worker.services.db, config.lease_seconds,
              on_error=lambda exc: logger.warning("outbox relay: %s", exc)).start()
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
