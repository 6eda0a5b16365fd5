"""The complete example module of docs/job-types.md, extracted so tests can run it.

The guide's one ```python block whose first line is ``# myjobs/loyalty.py`` is saved into a
fresh package outside the tree (renamed, so nothing can import it from the tree by accident):
what a reader copies is what the tests prove."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "job-types.md"
FIRST_LINE = "# myjobs/loyalty.py"
JOB_TYPE = "award_loyalty_points"
_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def example_source(guide: Path = GUIDE) -> str:
    """The guide's example module, as written there."""
    blocks = [b for b in _BLOCK.findall(guide.read_text()) if b.startswith(FIRST_LINE + "\n")]
    if len(blocks) != 1:
        raise AssertionError(f"{guide} must hold one ```python block starting {FIRST_LINE!r}, "
                             f"found {len(blocks)}")
    return blocks[0]


def install_example(root: Path, package: str = "guidejobs") -> str:
    """Save the example as ``<root>/<package>/loyalty.py``; returns the module's import path
    (for ``SEKALI_JOB_MODULES``; put ``root`` on ``PYTHONPATH``)."""
    folder = root / package
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "__init__.py").write_text("")
    (folder / "loyalty.py").write_text(example_source())
    return f"{package}.loyalty"
