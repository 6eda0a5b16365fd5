"""What the Dagster UI shows of sekali's config (the Launchpad's field help, the resource pages)
is plain text: the docstrings are reST for the code's readers, and Dagster would print
``x``, :class:`y` and the indentation as they are."""

from __future__ import annotations

import re
from typing import Any

import pytest

from pipelines.definitions import defs
from resources.dagster_resources import plain_text

pytestmark = [pytest.mark.dagster]

REST = re.compile(r"``|:[a-z]+:`|`[^`]+`|::\s")


def _descriptions(config_type: Any, path: str, seen: set[int]) -> list[tuple[str, str]]:
    if id(config_type) in seen:
        return []
    seen.add(id(config_type))
    out = []
    for name, field in (getattr(config_type, "fields", None) or {}).items():
        if field.description:
            out.append((f"{path}.{name}", field.description))
        out += _descriptions(field.config_type, f"{path}.{name}", seen)
    for attr in ("inner_type", "scalar_type", "non_scalar_type", "key_type", "value_type"):
        inner = getattr(config_type, attr, None)
        if inner is not None:
            out += _descriptions(inner, path, seen)
    return out


def test_no_rest_markup_reaches_a_config_description() -> None:
    """Catches the Launchpad showing ``ids`` or :class:`resources.flow.RateLimits`."""
    seen: set[int] = set()
    found = []
    for job in defs.get_repository_def().get_all_jobs():
        found += _descriptions(job.run_config_schema.config_type, job.name, seen)
    assert any(path.endswith("dlq_operation.config") for path, _ in found)  # the walk reaches it
    ours = [(p, t) for p, t in found if ".ops." in p or ".resources." in p]  # not Dagster's own
    leaks = [(path, text[:80]) for path, text in ours if REST.search(text)]
    assert leaks == []


@pytest.mark.parametrize(("rest", "plain"), [
    ("``ids`` select records", "ids select records"),
    ("A :class:`StampedeCache` on Redis.", "A StampedeCache on Redis."),
    ("see :func:`~engine.replay.amend`", "see amend"),
    ("(:class:`resources.flow.RateLimits`)", "(resources.flow.RateLimits)"),
    ("first line\n    second ``x``", "first line\nsecond x"),
    ("An example::\n\n    y: 1", "An example:\n\ny: 1"),
])
def test_plain_text(rest: str, plain: str) -> None:
    assert plain_text(rest) == plain
