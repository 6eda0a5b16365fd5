"""docs/job-types.md's example module, copied as a reader would: saved into a package outside
the tree and named in ``SEKALI_JOB_MODULES``, it becomes a job type with its own per-request
Dagster job and typed launch form, ``sekali enqueue`` accepts it, and a real run (its sandbox
ledger over HTTP, a real Dagster instance, SQLite and Postgres) credits once, counted through
the example's own lookup."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox.redis_server import free_port
from tests.guide_example import JOB_TYPE, ROOT, install_example

pytestmark = pytest.mark.dagster

CHILD = '''
import json, os, sys
from pathlib import Path

import dagster as dg

from engine.registry import JOB_TYPES
from pipelines.definitions import defs
from pipelines.profile import DownstreamResource
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from resources.storage.settings import Settings
from tests.job_workers import dagster_resources

name, state = sys.argv[1], Path(sys.argv[2])
jt = JOB_TYPES[name]
(ledger_decl,) = jt.calls.clients
sandbox = ledger_decl.sandbox.start(Settings.from_env(), state)  # the example's stand-in
upgrade(Database.from_url(os.environ["DATABASE_URL"]))

job = defs.get_job_def(name)
opened = dg.validate_run_config(job, None)["ops"][jt.op_name]["config"]["payload"]
try:
    dg.validate_run_config(job, {"ops": {jt.op_name: {"config": {"payload": {
        "account_id": "a", "points": "lots", "reason": "r"}}}}})
    refused = ""
except dg.DagsterInvalidConfigError as exc:
    refused = str(exc)

resources = dagster_resources(db_url=os.environ["DATABASE_URL"],
                              redis_url=os.environ["REDIS_URL"], namespace="guide")
resources[ledger_decl.name] = DownstreamResource(downstream=ledger_decl.name)
payload = {"account_id": "acct-7", "points": 40, "reason": "signup"}
runs = [
    job.execute_in_process(
        run_config={"ops": {jt.op_name: {"config": {"payload": payload}}}},
        resources=resources, instance=dg.DagsterInstance.ephemeral(), raise_on_error=False,
    ).success
    for _ in range(2)
]
clean = jt.validate(payload)
client = ledger_decl.build(Settings.from_env(), __import__("engine").ClientOptions())
effects = jt.effects({ledger_decl.name: client}.__getitem__, jt.keying.key_for(clean), clean)
other = jt.effects({ledger_decl.name: client}.__getitem__, "loyalty:acct-8:signup", None)
sandbox.stop()
print(json.dumps({
    "module": type(jt.typed(clean)).__module__,
    "typed": type(jt.typed(clean)).__name__,
    "fields": [[f.name, f.type.__name__, f.required] for f in jt.presentation.fields],
    "op_needs": sorted(job.graph.node_named(jt.op_name).definition.required_resource_keys),
    "opened": opened, "refused": refused, "runs": runs,
    "effects": [e.reference for e in effects], "other": len(other),
}))
'''


def _env(tmp_path: Path, module: str, db_url: str, redis_url: str) -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": f"{tmp_path / 'site'}:{ROOT}",
        "SEKALI_JOB_MODULES": module,
        "SEKALI_LOYALTY_LEDGER_URL": f"http://127.0.0.1:{free_port()}",
        "SEKALI_EGRESS_ALLOW": "127.0.0.1",  # the user's own service, as the guide says
        "SEKALI_STATE_DIR": str(tmp_path / "state"),
        "DATABASE_URL": db_url,
        "REDIS_URL": redis_url,
        "DAGSTER_HOME": str(tmp_path / "home"),
    }


def test_the_guide_example_runs_as_a_job_type_and_credits_once(
    tmp_path: Path, db_url: str, redis_url: str
) -> None:
    """Catches: a guide whose example does not import or register, a job type from outside the
    tree without its own job, typed launch form or downstream resource, a handler given a dict
    instead of its model, and a retried intent credited twice at the downstream."""
    module = install_example(tmp_path / "site")
    (tmp_path / "state").mkdir()
    env = _env(tmp_path, module, db_url, redis_url)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, JOB_TYPE, str(tmp_path / "state")], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["module"] == module and seen["typed"] == "Award"
    assert seen["fields"] == [["account_id", "str", True], ["points", "int", True],
                              ["reason", "str", True]]
    assert "loyalty_ledger" in seen["op_needs"]
    assert seen["opened"] == {"account_id": "acct-1", "points": 50, "reason": "signup"}
    assert "points" in seen["refused"]
    assert seen["runs"] == [True, True]
    assert len(seen["effects"]) == 1 and seen["other"] == 0


def test_sekali_enqueue_accepts_the_guide_example_and_names_a_bad_field(
    tmp_path: Path, sqlite_url: str, redis_url: str
) -> None:
    """Catches: a CLI that only knows the built-in job types, or lets a bad value through."""
    module = install_example(tmp_path / "site")
    env = _env(tmp_path, module, sqlite_url, redis_url)
    sekali = [str(Path(sys.executable).parent / "sekali")]

    def enqueue(payload: dict[str, object]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*sekali, "enqueue", JOB_TYPE, "--payload", json.dumps(payload), "--json",
             "--url", sqlite_url],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
        )

    ok = enqueue({"account_id": "acct-9", "points": 5, "reason": "signup"})
    assert ok.returncode == 0, ok.stderr[-2000:]
    queued = json.loads(ok.stdout)
    assert queued["key"] == "loyalty:acct-9:signup", queued
    bad = enqueue({"account_id": "acct-9", "points": "lots", "reason": "signup"})
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert "points" in bad.stdout + bad.stderr


def test_the_guide_examples_client_sends_nothing_past_its_send_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The example's credit carries the bound ``ctx.confirm_lease()`` returned: a worker that
    wakes past it (frozen, taken over meanwhile) must get ``SendDeadlinePassed`` and the ledger
    must hold nothing; within the bound the credit goes out once."""
    import importlib
    import time

    from resources.errors import SendDeadlinePassed

    module = install_example(tmp_path / "site", package="boundjobs")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    example = importlib.import_module(module)
    server = example.LedgerServer(tmp_path / "ledger.db").start()
    try:
        client = example.LedgerClient(server.url, timeout=2.0, deadline=5.0)
        with pytest.raises(SendDeadlinePassed):
            client.credit(account_id="acct-1", points=5, key="k-late",
                          send_by=time.monotonic() - 0.01)
        assert client.credits("k-late") == []
        client.credit(account_id="acct-1", points=5, key="k-live",
                      send_by=time.monotonic() + 30)
        assert len(client.credits("k-live")) == 1
    finally:
        server.stop()


def test_the_guide_examples_stand_in_says_nothing_when_a_client_hangs_up(tmp_path: Path) -> None:
    """A worker killed while its credit is answered (``sekali chaos`` kills them) hangs up on
    the stand-in: the credit is recorded, and the stand-in prints no ``BrokenPipeError`` /
    ``ConnectionResetError`` traceback into the run's output. Runs the stand-in in a child
    process and reads its stderr, as the chaos harness's output would show it."""
    module = install_example(tmp_path / "site", package="hangupjobs")
    child = (
        "import socket, struct, sys, time\n"
        "from pathlib import Path\n"
        f"from {module} import LedgerServer, LedgerClient\n"
        "server = LedgerServer(Path(sys.argv[1])).start()\n"
        "host, port = server.server.server_address[:2]\n"
        "body = b'{\"account_id\": \"a\", \"points\": 1, \"key\": \"k-gone\"}'\n"
        "for _ in range(8):\n"
        "    s = socket.create_connection((host, port), timeout=5)\n"
        "    s.sendall(b'POST /credits HTTP/1.1\\r\\nHost: x\\r\\nContent-Type: application/json'\n"
        "              b'\\r\\nContent-Length: %d\\r\\n\\r\\n%s' % (len(body), body))\n"
        "    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack('ii', 1, 0))\n"
        "    s.close()  # a reset: the worker died before the answer came\n"
        "deadline = time.monotonic() + 10\n"
        "client = LedgerClient(server.url)\n"
        "while len(client.credits('k-gone')) < 8 and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "time.sleep(0.5)  # the handlers' answers meet the resets\n"
        "print(len(client.credits('k-gone')))\n"
        "server.stop()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", child, str(tmp_path / "ledger.db")],
        env={**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}:{ROOT}"},
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "8"  # every credit that went out is on the ledger
    assert "Traceback" not in done.stderr and "Error" not in done.stderr, done.stderr[-2000:]
