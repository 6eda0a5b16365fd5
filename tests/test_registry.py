"""Job types are discovered: the built-in package's modules, and the modules named in
``SEKALI_JOB_MODULES`` from a package outside the tree, with everything else derived from the
declaration (the Dagster job, the downstream's resource and client, the key prefix)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.registry import JobModuleError, discover

ROOT = Path(__file__).resolve().parent.parent

POINTS = '''
"""award_points: credit an account once at a points ledger (a downstream of its own)."""

from engine import (
    Calls, Downstream, JobType, Keying, PayloadField, Presentation, Queue, Running, reject_unknown,
    require_str,
)

CREDITS: list[str] = []


class Ledger:
    def __init__(self, address: str, timeout: float, deadline: float) -> None:
        self.address, self.timeout, self.deadline = address, timeout, deadline

    def credit(self, account_id: str, key: str) -> str:
        CREDITS.append(key)
        return f"cr-{len(CREDITS)}"


LEDGER = Downstream(
    name="points_ledger",
    build=lambda settings, o: Ledger(o.address or "http://127.0.0.1:9", o.timeout or 2.0,
                                     o.deadline or 5.0),
    calls=("credit",),
)


def validate(payload):
    reject_unknown(payload, {"account_id"})
    return {"account_id": require_str(payload, "account_id")}


def award(ctx, p):
    return {"credit_id": ctx.client("points_ledger").credit(p["account_id"], ctx.key)}


JOB_TYPE = JobType(
    name="award_points", queue=Queue.LIGHT, validate=validate, handler=award, side_effect=True,
    keying=Keying(key_for=lambda p: f"points:{p['account_id']}",
                  resource_id=lambda p: p["account_id"]),
    running=Running(max_runtime_seconds=60),
    calls=Calls(clients=(LEDGER,)),
    presentation=Presentation(
        fields=(PayloadField("account_id", str, "The account to credit."),),
        example={"account_id": "a-1"},
    ),
)
'''

CHILD = '''
import json
from engine.registry import JOB_TYPES, key_owner
from engine.runtime import execute_request
from engine.services import Services
from pipelines.definitions import defs
from pipelines.profile import resource_defs
from resources.storage.db import Database
from resources.storage.migrations import upgrade
import pointsjobs.award as award

upgrade(Database.from_url(__import__("os").environ["DATABASE_URL"]))
services = Services.from_settings(budget_namespace="reg", cache_namespace="reg")
first = execute_request("award_points", {"account_id": "a-7"}, services=services)
again = execute_request("award_points", {"account_id": "a-7"}, services=services)
job = defs.get_job_def("award_points")
print(json.dumps({
    "types": sorted(JOB_TYPES),
    "owner": key_owner("points:a-7"),
    "resource": type(resource_defs()["points_ledger"]).__name__,
    "op_needs": sorted(job.graph.node_named("award_points_op").definition.required_resource_keys),
    "client": type(services.client("points_ledger")).__name__,
    "outcomes": [first.status, again.status],
    "credits": award.CREDITS,
    "budget": JOB_TYPES["award_points"].calls.budget,
}))
'''


def _package(root: Path, modules: dict[str, str]) -> None:
    package = root / "pointsjobs"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    for name, text in modules.items():
        (package / f"{name}.py").write_text(textwrap.dedent(text))


def test_a_module_named_in_the_environment_becomes_a_job_type_with_its_job_and_client(
    tmp_path: Path, redis_url: str
) -> None:
    """A package outside the tree, named in SEKALI_JOB_MODULES and nowhere else: the job type
    is registered, gets its per-request Dagster job, its downstream's resource (required by its
    op) and client, its key prefix and retry bucket, and runs once per intent. Catches a
    registry that lists job types by hand (the module would be unknown)."""
    _package(tmp_path, {"award": POINTS})
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": f"{tmp_path}:{ROOT}",
        "SEKALI_JOB_MODULES": "pointsjobs.award",
        "DATABASE_URL": f"sqlite:///{tmp_path / 'app.db'}",
        "REDIS_URL": redis_url,
        "DAGSTER_HOME": str(tmp_path / "home"),
    }
    out = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert "award_points" in seen["types"] and "charge_payment" in seen["types"]
    assert seen["owner"] == "award_points"
    assert seen["resource"] == "DownstreamResource"
    assert "points_ledger" in seen["op_needs"]
    assert seen["client"] == "Ledger"
    assert seen["outcomes"] == ["completed", "duplicate"]
    assert seen["credits"] == ["points:a-7"]
    assert seen["budget"] == "points_ledger"


@pytest.mark.parametrize(
    ("modules", "named", "words"),
    [
        ({}, "pointsjobs.nowhere", "cannot be found"),
        ({"empty": "X = 1\n"}, "pointsjobs.empty", "declares no job type"),
        (
            {"award": POINTS, "copy": POINTS},
            "pointsjobs.award,pointsjobs.copy",
            "'award_points' is declared twice",
        ),
        (
            {"clash": POINTS.replace('name="award_points"', 'name="charge_payment"')},
            "pointsjobs.clash",
            "'charge_payment' is declared twice",
        ),
        ({"wrong": "JOB_TYPE = 'send_email'\n"}, "pointsjobs.wrong", "must hold engine.JobType"),
    ],
    ids=["missing", "no-job-type", "twice", "clashes-with-a-built-in", "not-a-job-type"],
)
def test_a_job_module_that_cannot_be_used_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, modules: dict[str, str], named: str,
    words: str,
) -> None:
    """Catches a registry that skips a module it was told to load, or lets a second
    declaration of a name replace the first silently."""
    _package(tmp_path, modules)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("pointsjobs")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(JobModuleError) as info:
        discover({"SEKALI_JOB_MODULES": named})
    assert words in str(info.value)
    assert named.split(",")[-1] in str(info.value) or "nowhere" not in named


def test_the_built_in_job_types_are_found_without_being_listed() -> None:
    """Every module of pipelines.jobs that declares a JOB_TYPE, in name order."""
    assert list(discover({})) == [
        "charge_payment", "deliver_webhook", "fulfill_order", "rebuild_report_cache",
        "reserve_inventory", "send_email",
    ]
