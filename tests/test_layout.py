"""The house rules of docs/design.md, checked on the code itself.

import-linter (``lint-imports`` in CI) holds the layers; these tests hold what it cannot say:
the public names the README shows stay importable from the same place, no module imports the
project's own code inside a function, the defences and the platform need no Dagster, no
business module, class or function lives under ``resources/`` or ``engine/``, importing the
platform imports no job type (they are found at first use), and no docstring or comment cites
an issue or a file outside the tree.
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = (
    "resources", "engine", "sandbox", "sensors", "pipelines", "proof", "cli", "benchmarks",
)
"""Every top-level package, lowest layer first."""
NO_LOCAL_IMPORTS = tuple(p for p in PACKAGES if p != "benchmarks")
"""Where a function-local import of the project is refused (the benchmarks import what they
measure inside the suite that measures it, so ``sekali bench --help`` stays fast)."""
GENERIC = ("resources", "engine")
"""The layers that know no business word."""
BUSINESS_WORDS = re.compile(r"\b(payment|payments|mail|mailer|order|orders|stock|report)\b", re.I)

README_NAMES = {
    "resources.idempotency": [
        "IdempotencyStore", "IdempotencyConflict", "AlreadyInProgress", "LeaseLost",
    ],
    "resources.locks": [
        "RedisLock", "DbLock", "NoLock", "LockNotAcquired", "LockLost", "fenced_write",
    ],
    "resources.cache": ["StampedeCache"],
    "resources.errors": ["SekaliError", "ValidationError", "PermanentJobError"],
    "resources.settings": ["Settings"],
    "resources.db": ["Database"],
    "resources.migrations": ["upgrade"],
    "engine.intake": ["enqueue"],
    "engine.runtime": ["execute_request"],
    "engine.services": ["Services"],
    "pipelines.definitions": ["defs"],
}


def _modules(*packages: str) -> list[Path]:
    return sorted(p for pkg in packages for p in (ROOT / pkg).rglob("*.py"))


@pytest.mark.parametrize("module", sorted(README_NAMES))
def test_public_names_stay_where_the_readme_shows_them(module: str) -> None:
    loaded = importlib.import_module(module)
    missing = [name for name in README_NAMES[module] if not hasattr(loaded, name)]
    assert not missing, f"{module} no longer exports {missing}"


def test_no_function_local_imports_of_the_project() -> None:
    """A function-local import that dodges a cycle means the code sits on the wrong layer. A
    typing-only import (``if TYPE_CHECKING:``) is no runtime dependency: the contract's handler
    type names the context class the runtime builds from the contract."""
    found = []
    for path in _modules(*NO_LOCAL_IMPORTS):
        tree = ast.parse(path.read_text())
        typing_only = {id(sub) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                       for sub in node.body}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom | ast.Import) and node.col_offset > 0:
                name = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                if name and name.split(".")[0] in PACKAGES:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    assert found == []


def test_only_the_wrapper_module_under_resources_imports_dagster() -> None:
    importers = []
    for path in _modules(*GENERIC):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom | ast.Import):
                name = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                if name and name.split(".")[0] == "dagster":
                    importers.append(str(path.relative_to(ROOT)))
    assert sorted(set(importers)) == ["resources/dagster_resources.py"]


@pytest.mark.parametrize("package", GENERIC)
def test_the_generic_layers_import_without_dagster_or_a_job_type(package: str) -> None:
    """Importing every module of the defences (but their wrapper module) or of the platform
    loads no Dagster and no job type: the registry finds job types at first use."""
    code = (
        "import sys, importlib, pkgutil\n"
        f"import {package}\n"
        f"for m in pkgutil.walk_packages({package}.__path__, '{package}.'):\n"
        "    if m.name != 'resources.dagster_resources':\n"
        "        importlib.import_module(m.name)\n"
        "print('dagster' in sys.modules, 'pipelines' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False False"


def test_no_business_module_under_the_generic_layers() -> None:
    """Module, class and function names under resources/ and engine/ carry no business word."""
    offenders = []
    for path in _modules(*GENERIC):
        if BUSINESS_WORDS.search(path.stem):
            offenders.append(str(path.relative_to(ROOT)))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef | ast.FunctionDef) and BUSINESS_WORDS.search(
                re.sub(r"(?<!^)(?=[A-Z])", " ", node.name).replace("_", " ")
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{node.name}")
    assert offenders == []


def test_no_comment_cites_an_issue_or_a_file_outside_the_tree() -> None:
    """Code says why in its own words. (Applied migrations in sql/ are checksummed history: an
    edit, even of a comment, is drift, so they are not rewritten.)"""
    pattern = re.compile(r"\bissue\s+#?\d+|\(#\d+\)|\bDESIGN\.md\b|\.\./shared")
    hits = []
    for path in _modules(*PACKAGES):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{lineno}")
    assert hits == []
