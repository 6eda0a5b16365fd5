"""``sekali dev`` as a script or a service manager runs it: in the background, stopped by a signal.

One instance is started for the module (its UI takes about 45 s to answer here), from ``bash -c
'sekali dev ... & wait'``: a non-interactive shell starts a background job with SIGINT ignored,
the case where ``dagster dev`` used to outlive its parent. Ports are free ones, state and Dagster
home live under a temporary folder, so other work on this machine (port 3000) is never touched.
The stop test runs last and ends the shared instance.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cli.commands.dev import SANDBOX_CATALOGUE, setup
from cli.commands.log_filter import QuietFilter
from cli.commands.preflight import port_in_use
from pipelines.domain.inventory import Inventory
from pipelines.jobs import inventory
from resources.storage.db import Database
from resources.storage.settings import Settings

pytestmark = [pytest.mark.slow, pytest.mark.dagster, pytest.mark.timeout(400)]

SEKALI = str(Path(sys.executable).with_name("sekali"))
UI_DEADLINE = 180.0
STOP_BOUND = 10.0  # the bound users are promised; not a speed target


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command may contain spaces and parentheses: fields start after the last ')'.
    return int(stat.rsplit(")", 1)[1].split()[1])


def descendants(root: int) -> set[int]:
    """``root`` and every process below it, by parent pid."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            ppid = parent_of(int(entry.name))
            if ppid is not None:
                children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo.extend(children.get(pid, []))
    return found


def state_of(pid: int) -> str | None:
    """The process state letter (``Z`` for a zombie), ``None`` once the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def wait_gone(pids: set[int], bound: float, *, zombies_count: bool = True) -> set[int]:
    """Poll until none of ``pids`` exists; returns those still there after ``bound`` seconds."""
    deadline = time.monotonic() + bound
    while True:
        states = {pid: state_of(pid) for pid in pids}
        alive = {
            pid for pid, state in states.items()
            if state is not None and (zombies_count or state != "Z")
        }
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def ignored_signals(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return int(line.split()[1], 16)
    return 0


def dev_env(state: Path, gateway_port: int, smtp_port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("REDIS_URL", "DATABASE_URL", "DAGSTER_PG_URL")}
    env.update(
        SEKALI_STATE_DIR=str(state),
        DAGSTER_HOME=str(state / "dagster_home"),
        SEKALI_GATEWAY_URL=f"http://127.0.0.1:{gateway_port}",
        SEKALI_SMTP_HOST="127.0.0.1",
        SEKALI_SMTP_PORT=str(smtp_port),
        SEKALI_WEBHOOKS_URL=f"http://127.0.0.1:{free_port()}",
    )
    return env


@dataclass
class DevInstance:
    shell: subprocess.Popen[bytes]
    pid: int
    port: int
    gateway_port: int
    smtp_port: int
    env: dict[str, str]
    log: Path
    tree: set[int] = field(default_factory=set)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def _ui_answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=2) as r:
            return int(r.status) == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def dev(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevInstance]:
    root = tmp_path_factory.mktemp("dev")
    port, gateway_port, smtp_port = free_port(), free_port(), free_port()
    env = dev_env(root / "state", gateway_port, smtp_port)
    log = root / "dev.log"
    shell = subprocess.Popen(
        ["bash", "-c", '"$0" dev --port "$1" >"$2" 2>&1 & echo $!; wait',
         SEKALI, str(port), str(log)],
        env=env, stdout=subprocess.PIPE, start_new_session=True,
    )
    assert shell.stdout is not None
    instance = DevInstance(shell, int(shell.stdout.readline()), port, gateway_port, smtp_port,
                           env, log)
    try:
        ready = f"sekali dev: Dagster UI ready on http://127.0.0.1:{port}"
        deadline = time.monotonic() + UI_DEADLINE
        while not (ready in instance.output() and _ui_answers(port)):
            if shell.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"sekali dev did not serve its UI:\n{instance.output()}")
            time.sleep(1)
        instance.tree = descendants(instance.pid)
        yield instance
    finally:
        # Whatever a failed test left: the shell's group (bash and sekali dev), then the tree.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)
        shell.wait(30)
        for pid in wait_gone(instance.tree | descendants(instance.pid), 15.0):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def run_second(env: dict[str, str], port: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SEKALI, "dev", "--port", str(port)], env=env, capture_output=True,
                          text=True, timeout=120)


def test_quiet_by_default(dev: DevInstance) -> None:
    """Catches Dagster's INFO/DEBUG (sensor ticks, alembic, run events) reaching the output."""
    lines = dev.output().splitlines()
    quiet = QuietFilter()
    assert [out for line in lines for out in quiet.feed(line)] + quiet.flush() == lines
    assert not [line for line in lines if "alembic" in line.lower()]


def test_an_expected_failure_is_two_lines_naming_its_dead_letter(dev: DevInstance) -> None:
    """Catches an expected permanent failure printing its tracebacks (STEP_FAILURE and
    RUN_FAILURE: ~150 lines a run), the attempt and retry lines, a dead-letter line printed
    twice or without the command to run next, and ANSI codes in output that is not a TTY."""
    before = len(dev.output().splitlines())
    carts = [f"c-unknown-sku-{i}" for i in range(2)]
    for cart in carts:
        payload = json.dumps({"cart_id": cart, "items": [{"sku": "no-such-sku", "quantity": 1}]})
        subprocess.run([SEKALI, "enqueue", "reserve_inventory", "--payload", payload],
                       env=dev.env, check=True, capture_output=True, timeout=120)
    deadline = time.monotonic() + 300
    while dev.output().count("dead-lettered as") < len(carts):
        assert time.monotonic() < deadline, dev.output()[-4000:]
        time.sleep(1)
    time.sleep(5)  # anything printed after the dead letter (a late traceback) is counted too
    new = dev.output().splitlines()[before:]
    about = [line for line in new
             if "c-unknown-sku-" in line or "UnknownSku" in line or "no-such-sku" in line]
    assert len(about) == 2 * len(carts), "\n".join(new)
    for cart in carts:
        (op_line,) = [line for line in about if cart in line and "to the DLQ" in line]
        assert "(permanent): UnknownSku" in op_line
        (dead,) = [line for line in about if cart in line and "dead-lettered as" in line]
        record = int(dead.rsplit("sekali dlq show ", 1)[1])
        assert f"dead-lettered as {record}: sekali dlq show {record}" in dead
    assert not [line for line in new if "\x1b[" in line]


def test_second_instance_on_the_same_folder_exits_2_with_one_line(dev: DevInstance) -> None:
    """Catches a second daemon on one Dagster home: the lock names the running pid, and the
    second command starts nothing (its own UI port is free, so only the lock can stop it)."""
    result = run_second(dev.env, free_port())
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert f"pid {dev.pid}" in result.stderr
    assert "already" in result.stderr or "another sekali dev" in result.stderr


def test_busy_port_exits_2_naming_the_holder(dev: DevInstance, tmp_path: Path) -> None:
    """Catches tracebacks for busy ports: one line naming the port and the process on it."""
    env = dev_env(tmp_path / "other", free_port(), free_port())
    result = run_second(env, dev.port)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1, result.stderr
    line = result.stderr.strip()
    assert f"port {dev.port}" in line
    holder = int(line.split(" by pid ", 1)[1].split()[0])
    assert holder in dev.tree, line  # the webserver of the running instance
    assert not (tmp_path / "other" / "app.db").exists()  # nothing was started


WORKER_RUNS = textwrap.dedent("""
    import json
    import dagster as dg
    with dg.DagsterInstance.get() as instance:
        print(json.dumps([
            {"id": r.run_id, "status": r.status.value, "slot": r.tags.get("sekali/worker")}
            for r in instance.get_runs(dg.RunsFilter(job_name="sekali_worker"))]))
""")


def worker_runs(dev: DevInstance) -> list[dict[str, str]]:
    """The resident worker runs of the dev instance (read from its Dagster home)."""
    out = subprocess.run([sys.executable, "-c", WORKER_RUNS], env=dev.env, capture_output=True,
                         text=True, timeout=120, check=True)
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


def test_the_supervisor_keeps_one_worker_per_slot_and_a_worker_serves_a_request(
    dev: DevInstance,
) -> None:
    """Catches a supervisor that launches a worker run every tick (runs pile up in Dagster's
    queue: it once counted no run of its location as alive), a slot left empty, and requests
    that wait for a run of their own: through the real daemon and launcher, the three slots of
    this two-core machine hold one worker run each, and a request enqueued is executed by one
    of them."""
    deadline = time.monotonic() + 300
    while sum(r["status"] == "STARTED" for r in worker_runs(dev)) < 3:
        assert time.monotonic() < deadline, worker_runs(dev)
        time.sleep(2)
    time.sleep(20)  # four supervisor ticks more
    runs = worker_runs(dev)
    assert sorted(r["slot"] for r in runs) == ["heavy/0", "light/0", "light/1"], runs
    payload = json.dumps({"template": "welcome", "user_id": "w-dev", "date": "2026-12-06",
                          "to": "w-dev@example.com"})
    done = subprocess.run([SEKALI, "enqueue", "send_email", "--payload", payload, "--wait",
                           "--timeout", "60", "--json"], env=dev.env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    request = json.loads(done.stdout)
    assert request["status"] == "completed" and request["run_id"] in {r["id"] for r in runs}


def test_sigterm_stops_the_whole_tree_within_the_bound(dev: DevInstance) -> None:
    """Catches children outliving ``sekali dev`` (started in the background, signalled by pid):
    webserver, daemon, code server and embedded Redis must all be gone, their ports free."""
    children = dev.tree - {dev.pid}
    assert len(children) >= 5, dev.tree  # watchdog, redis, dagster dev, webserver, daemon, ...
    stop_signals = 1 << (signal.SIGINT - 1) | 1 << (signal.SIGTERM - 1)
    for pid in children:
        with contextlib.suppress(OSError):
            if b"dagster" in Path(f"/proc/{pid}/cmdline").read_bytes():
                # Must not inherit the SIG_IGN the background shell gave sekali dev.
                assert not ignored_signals(pid) & stop_signals, pid

    started = time.monotonic()
    os.kill(dev.pid, signal.SIGTERM)
    alive = wait_gone(dev.tree, STOP_BOUND)
    elapsed = time.monotonic() - started
    print(f"\nsekali dev tree of {len(dev.tree)} processes gone in {elapsed:.1f} s")
    assert not alive, f"still running after {STOP_BOUND} s: {sorted(alive)}"
    for port in (dev.port, dev.gateway_port, dev.smtp_port):
        assert not port_in_use("127.0.0.1", port), port
    assert dev.shell.wait(10) == 0
    assert dev.output().splitlines()[-1].startswith("sekali dev: stopped in ")


WATCHED = textwrap.dedent("""
    import sys, time
    from cli.commands.supervisor import Supervisor
    supervisor = Supervisor(grace=1.0)
    child = supervisor.spawn("tree", ["bash", "-c", "sleep 300 & sleep 300 & wait"])
    print(child.pid, flush=True)
    time.sleep(300)
""")


def test_watchdog_stops_the_groups_when_the_supervisor_is_killed() -> None:
    """Catches orphans after ``kill -9`` of ``sekali dev``: the watchdog ends every group,
    grandchildren included, which ``PR_SET_PDEATHSIG`` alone would not reach."""
    supervisor = subprocess.Popen([sys.executable, "-c", WATCHED], stdout=subprocess.PIPE,
                                  start_new_session=True)
    assert supervisor.stdout is not None
    child = int(supervisor.stdout.readline())
    deadline = time.monotonic() + 10
    while len(descendants(child)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    tree = descendants(child)
    assert len(tree) == 3, tree  # bash and its two sleeps
    assert os.getpgid(child) == child != os.getpgid(supervisor.pid)

    supervisor.kill()
    supervisor.wait()
    try:
        # Reaping orphans is PID 1's job here, so a zombie counts as stopped.
        assert not wait_gone(tree, STOP_BOUND, zombies_count=False)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child, signal.SIGKILL)


@pytest.mark.parametrize(
    ("line", "kept"),
    [
        ("\x1b[32m2026-11-30 14:59:48 +0000\x1b[0m - dagster.daemon.EventLogConsumerDaemon - "
         "\x1b[34mWARNING\x1b[0m - No cursor for event type", True),
        ("2026-11-30 15:00:04 +0000 - dagster - DEBUG - cache_warming_job - 21e7 - 21828 - "
         "RUN_START - Started execution of run", False),
        ("2026-11-30 15:00:04 +0000 - dagster.daemon.SensorDaemon - INFO - Checking for new runs "
         "for sensor: intake_sensor", False),
        ("2026-11-30 15:00:04 +0000 - dagster - ERROR - charge_payment - boom", True),
        ("Traceback (most recent call last):", True),
        ("sekali dev: Dagster UI ready on http://127.0.0.1:3000", True),
    ],
)
def test_quiet_filter_keeps_warnings_and_errors(line: str, kept: bool) -> None:
    assert QuietFilter().keep(line + "\n") is kept


EXPECTED_FAILURE = """\
2026-12-02 04:45:43 +0000 - dagster - ERROR - reserve_inventory - 34ea - 3234 - reserve_inventory_op - STEP_FAILURE - Execution of step "reserve_inventory_op" failed.

dagster._core.definitions.events.Failure: permanent: UnknownSku: sku 'x' is not stocked (given up at attempt 1)

Stack Trace:
  File "/x/execute_plan.py", line 243, in dagster_event_sequence_for_step
    yield from check.generator(step_events)

The above exception was caused by the following exception:
pipelines.domain.inventory.UnknownSku: sku 'x' is not stocked

Stack Trace:
  File "/x/inventory.py", line 205, in reserve
    raise UnknownSku(sku)

attempt reserve_inventory bde1109693954d3387586e34624a3ff0 key=inventory-reserve:c-1 outcome=failed_permanent unreserved->None fence=1
giving up after attempt 0: permanent (permanent: UnknownSku)
reserve_inventory key=inventory-reserve:c-1 (permanent, UnknownSku) dead-lettered as 6: sekali dlq show 6
"""  # noqa: E501 - Dagster's lines as printed


def test_quiet_filter_drops_an_expected_failure_s_tracebacks_and_keeps_an_unknown_one() -> None:
    quiet = QuietFilter()
    lines = EXPECTED_FAILURE.splitlines()
    kept = [out for line in lines for out in quiet.feed(line)] + quiet.flush()
    assert kept == lines[-1:]
    unknown = [line.replace("Failure: permanent: UnknownSku", "Failure: unknown: KeyError")
               for line in lines[:15]]
    kept = [out for line in unknown for out in quiet.feed(line)] + quiet.flush()
    assert kept == unknown


EXPECTED_FAILURE_ONE_LINE = """\
2026-12-06 04:45:43 +0000 - dagster - ERROR - reserve_inventory - 34ea - 3234 - reserve_inventory_op - STEP_FAILURE - Execution of step "reserve_inventory_op" failed.

dagster._core.definitions.events.Failure: permanent: UnknownSku: sku 'x' is not stocked (given up at attempt 1)
Error ID 3f2a9c01b7de. The error has been masked to prevent leaking sensitive information. Search in logs for this error ID for more details.
2026-12-06 04:45:43 +0000 - dagster - ERROR - reserve_inventory - 34ea - 3234 - RUN_FAILURE - Execution of run for "reserve_inventory" failed. Steps failed: ['reserve_inventory_op'].

dagster._core.definitions.events.Failure: permanent: UnknownSku: sku 'x' is not stocked (given up at attempt 1)
Error ID 3f2a9c01b7de. The error has been masked to prevent leaking sensitive information. Search in logs for this error ID for more details.
giving up after attempt 0: permanent (permanent: UnknownSku); error id 3f2a9c01b7de
reserve_inventory key=inventory-reserve:c-1 (permanent, UnknownSku) dead-lettered as 6: sekali dlq show 6
"""  # noqa: E501 - Dagster's lines as printed


def test_quiet_filter_drops_an_expected_failure_without_a_stack() -> None:
    """Catches the ``Error ID`` line of a failure event without a stack trace (the failure
    path's one-line form, :func:`resources.dagster_resources.expected_failure`) printed."""
    quiet = QuietFilter()
    lines = EXPECTED_FAILURE_ONE_LINE.splitlines()
    kept = [out for line in lines for out in quiet.feed(line)] + quiet.flush()
    assert kept == lines[-1:]


def test_quiet_filter_drops_maturity_notices_with_their_source_line() -> None:
    quiet = QuietFilter()
    lines = [
        "/x/click/core.py:911: SupersessionWarning: Function `dev_command` is superseded.",
        "  return callback(*args, **kwargs)",
        "2026-11-30 14:59:45 +0000 - dagster - WARNING - /x/sensor_definition.py:809: "
        "BetaWarning: Parameter `owners` of initializer `SensorDefinition.__init__` is in beta.",
        "  return SensorDefinition(",
        "",
        "/x/jobs.py:12: DeprecationWarning: old call",
        "  old()",
    ]
    assert [line for line in lines if quiet.keep(line)] == lines[5:]


def test_setup_seeds_the_sandbox_catalogue_once_and_never_resets_it(tmp_path: Path) -> None:
    """Catches: a fresh dev stack where the inventory and fulfilment examples fail with
    UnknownSku (nothing seeded), and a restart that resets stock someone changed."""
    url = f"sqlite:///{tmp_path / 'dev.db'}"
    settings = Settings(database_url=url, redis_url="redis://127.0.0.1:9/0",
                        dagster_home=tmp_path / "home", gateway_url="http://127.0.0.1:9",
                        smtp_host="127.0.0.1", smtp_port=9)
    setup(settings, verbose=False)
    db = Database.from_url(url)
    stock = Inventory(db)
    example_skus = {item["sku"] for item in inventory.JOB_TYPE.presentation.example["items"]}
    assert example_skus <= set(SANDBOX_CATALOGUE)
    assert all(stock.stock(sku) == (SANDBOX_CATALOGUE[sku], 0) for sku in SANDBOX_CATALOGUE)
    stock.set_stock("apple", 3)
    setup(settings, verbose=False)
    assert stock.stock("apple") == (3, 0)
    db.dispose()
