"""The type checker holds a handler to its job type's payload model: a job type declares its
model once (``payload=``) and a handler annotated with another model is a type error, found
before anything runs, as Temporal finds an activity's input type from its signature.

Each case is a small job type module written to a temporary folder and checked with the
project's own mypy configuration (strict), the way a user's module would be in their CI.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mypy import api

ROOT = Path(__file__).resolve().parents[1]

MODULE = '''
from typing import Any

from pydantic import BaseModel

from engine import JobContext, JobType, Keying, Queue, Running, formatted


class Award(BaseModel):
    account_id: str
    points: int


class Refund(BaseModel):
    order_id: str


def award(ctx: JobContext, p: {handler_model}) -> dict[str, Any]:
    return {{"id": ctx.key}}


JOB_TYPE = JobType(
    name="award_points",
    queue=Queue.LIGHT,
    payload=Award,
    handler=award,  # the checked line
    side_effect=False,
    keying=Keying(key_for=formatted("points:{{account_id}}"),
                  resource_id=formatted("{{account_id}}")),
    running=Running(max_runtime_seconds=10),
)
'''


def _checked(tmp_path: Path, handler_model: str) -> tuple[str, int, int]:
    """mypy's report on the module with the handler taking ``handler_model``, the line of the
    handler's declaration, and mypy's exit status."""
    source = MODULE.format(handler_model=handler_model)
    module = tmp_path / f"award_{handler_model.lower()}.py"
    module.write_text(source)
    line = next(i for i, text in enumerate(source.splitlines(), 1) if "the checked line" in text)
    out, err, status = api.run([
        "--config-file", str(ROOT / "pyproject.toml"),
        "--cache-dir", str(ROOT / ".mypy_cache"),
        "--no-error-summary", str(module),
    ])
    assert not err, err
    return out, line, status


@pytest.fixture(autouse=True)
def _at_the_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # mypy finds the project's packages from the working directory


def test_a_handler_of_another_model_is_a_type_error(tmp_path: Path) -> None:
    """Catches the contract's handler typed loosely again (``Callable[[Any, Any], Any]``): a
    handler written for ``Refund`` declared on an ``Award`` job type would type-check and fail
    only when a request runs."""
    out, line, status = _checked(tmp_path, "Refund")
    assert status == 1, out
    assert f":{line}: error:" in out and '"handler"' in out, out


def test_the_handler_of_the_declared_model_type_checks(tmp_path: Path) -> None:
    """Catches a contract so strict (or so broken) that the correct declaration fails too: the
    other half of the test above."""
    out, _, status = _checked(tmp_path, "Award")
    assert status == 0, out
    assert out == "", out
