"""Test helpers for a job type's own CI: the chaos proof, called from a test.

::

    from engine.testing import run_under_faults

    def test_award_loyalty_points_survives_the_faults() -> None:
        report = run_under_faults("award_loyalty_points", faults="all", requests=40)
        assert report.ok, report.violations
        assert report.duplicates == 0 and report.lost == 0

:func:`run_under_faults` runs ``sekali chaos --job-type NAME --json`` in a child process and
returns its report. Its verdict counts the job type's effects where they happen: by its sandbox
stand-in's own record (``Sandbox.record``) when the stand-in declares one, else through the job
type's lookup (``counting``, and ``unverified`` says so); before any fault its lookup must
report every duplicate the calibration made on purpose (``calibration``), and every recorded
arrival must fall inside a send bound its holder confirmed. The harness starts servers and
kills processes (it lives above the platform, in ``proof/``), and a child process is also what
keeps those signals and servers away from the test's own process. The job type's module reaches
the child through ``SEKALI_JOB_MODULES``: the module of a :class:`JobType` given as an object,
and of a name this process knows (registered here through its own ``SEKALI_JOB_MODULES``, or
declared by a module already imported, e.g. by the test file) is added to it unless ``env``
names the modules itself (then that list stands as given); a name known to
neither reaches the child as it is (its ``env`` may name the module), and a child that does not
know it either refuses the run (:class:`ChaosRunFailed`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.contract import JobType
from engine.registry import JOB_TYPES, MODULES_ENV
from resources.errors import SekaliError


class ChaosRunFailed(SekaliError):
    """``sekali chaos`` refused the run or did not produce a report: read the message (it says
    what to declare or which option to fix) and ``output`` (the run's stderr)."""

    permanent = True

    def __init__(self, message: str, output: str) -> None:
        super().__init__(f"{message}\n{output[-4000:]}")
        self.output = output


@dataclass(frozen=True)
class ChaosVerdict:
    """What a chaos run found: ``ok`` when every invariant held; per-fault ``rows``; the
    ``violations`` in words (a lookup that failed its calibration, an effect outside the send
    bound, a duplicate, a loss); ``counting`` per job type (``record`` or ``lookup``), each
    lookup's ``calibration``, what stayed ``unverified``; the run's whole JSON as ``raw``."""

    ok: bool
    violations: list[str]
    rows: list[dict[str, Any]]
    stats: dict[str, Any]
    raw: dict[str, Any] = field(repr=False)
    counting: dict[str, str] = field(default_factory=dict)
    calibration: list[dict[str, Any]] = field(default_factory=list)
    unverified: list[str] = field(default_factory=list)

    @property
    def verified(self) -> bool:
        """Every job type counted by its stand-in's own record, its lookup calibrated."""
        return not self.unverified and all(how == "record" for how in self.counting.values())

    def _total(self, column: str) -> int:
        return int(next((r[column] for r in self.rows if r["fault"] == "all"), 0))

    @property
    def duplicates(self) -> int:
        return self._total("duplicates")

    @property
    def lost(self) -> int:
        return self._total("lost")


def run_under_faults(
    job_type: str | JobType | Sequence[str | JobType],
    *,
    faults: str | Sequence[str] = "all",
    requests: int = 40,
    workers: int = 2,
    backend: str = "sqlite",
    database_url: str | None = None,
    seed: int = 1,
    timeout: float = 300.0,
    env: Mapping[str, str] | None = None,
    calibration_runs: int = 3,
    require_record: bool = False,
) -> ChaosVerdict:
    """Run the chaos proof on ``job_type`` (a name, a :class:`JobType`, or several) and return
    its report. Raises :class:`ChaosRunFailed` when the run is refused (a job type it cannot
    judge, a bad option: the message says what to declare) or ends without a report; a run
    whose invariants failed returns a report with ``ok`` False.

    ``calibration_runs``: sends per calibration key the lookup must all report before the
    fault run (0 skips it, and ``unverified`` says so). ``require_record``: refuse a job type
    whose stand-in declares no record of its own (:class:`ChaosRunFailed`), for a CI that
    wants no count it cannot check."""
    given = [job_type] if isinstance(job_type, str | JobType) else list(job_type)
    names = [jt.name if isinstance(jt, JobType) else jt for jt in given]
    named_here = env is None or MODULES_ENV not in env  # else the caller named the modules
    modules = [_module_of(jt) if isinstance(jt, JobType)
               else _module_named(jt) if named_here else None for jt in given]
    child_env = {**os.environ, **(env or {})}
    listed = [m for m in child_env.get(MODULES_ENV, "").split(",") if m.strip()]
    extra = [m for m in modules if m is not None and m not in listed and not
             m.startswith("pipelines.jobs.")]
    if extra:
        child_env[MODULES_ENV] = ",".join([*listed, *extra])
    argv = [
        sys.executable, "-m", "cli.main", "chaos", "--job-type", ",".join(names),
        "--faults", faults if isinstance(faults, str) else ",".join(faults),
        "--requests", str(requests), "--workers", str(workers), "--backend", backend,
        "--seed", str(seed), "--timeout", str(timeout), "--json", "--no-progress",
        "--calibration-runs", str(calibration_runs),
    ]
    if require_record:
        argv.append("--require-record")
    if database_url is not None:
        argv += ["--database-url", database_url]
    try:
        done = subprocess.run(argv, env=child_env, capture_output=True, text=True,
                              timeout=timeout + 120, check=False)
    except subprocess.TimeoutExpired as exc:
        raise ChaosRunFailed(f"sekali chaos did not end within {timeout + 120:.0f}s",
                             str(exc.stderr or "")) from exc
    if done.returncode not in (0, 1) or not done.stdout.strip():
        raise ChaosRunFailed(f"sekali chaos exited {done.returncode}", done.stderr)
    raw = json.loads(done.stdout)
    return ChaosVerdict(ok=bool(raw["ok"]), violations=list(raw["violations"]),
                       rows=list(raw["rows"]), stats=dict(raw["stats"]), raw=raw,
                       counting=dict(raw.get("counting", {})),
                       calibration=list(raw.get("calibration", [])),
                       unverified=list(raw.get("unverified", [])))


def _module_of(jt: JobType) -> str | None:
    module = getattr(jt.handler, "__module__", None)
    return module if isinstance(module, str) and module != "__main__" else None


def _module_named(name: str) -> str | None:
    """The module declaring job type ``name``: the registry's, else the imported module whose
    ``JOB_TYPE`` / ``JOB_TYPES`` declares it (the one imported last, when several do); None
    when this process knows neither."""
    if name in JOB_TYPES:
        return JOB_TYPES.module_of(name)
    for module_name, module in reversed(list(sys.modules.items())):  # the latest import first
        attributes = getattr(module, "__dict__", {})  # no module __getattr__ is triggered
        declared = attributes.get("JOB_TYPES")
        found = [attributes.get("JOB_TYPE"),
                 *(declared if isinstance(declared, list | tuple) else ())]
        if module_name != "__main__" and any(
                isinstance(jt, JobType) and jt.name == name for jt in found):
            return module_name
    return None


__all__ = ["ChaosRunFailed", "ChaosVerdict", "run_under_faults"]
