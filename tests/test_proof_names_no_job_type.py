"""``proof/`` names no job type: the chaos harness and the demo ask each registered job type
what they need (:class:`engine.chaos.ChaosProof`) instead of branching on built-in names, so a
job type added, renamed or removed needs no line of ``proof/`` to change."""

from __future__ import annotations

import ast
from pathlib import Path

from engine.registry import BUILT_IN_PACKAGE, JOB_TYPES

PROOF = Path(__file__).resolve().parent.parent / "proof"
BUSINESS = ("pipelines.jobs", "pipelines.domain")


def _built_in_names() -> set[str]:
    return {name for name in JOB_TYPES
            if (JOB_TYPES.module_of(name) or "").startswith(BUILT_IN_PACKAGE + ".")}


def _mentions(path: Path, names: set[str], root: Path = PROOF.parent) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(root)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found += [f"{where}: {name!r} in a string" for name in names if name in node.value]
        elif isinstance(node, ast.Name) and node.id in names:
            found.append(f"{where}: name {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in names:
            found.append(f"{where}: attribute {node.attr}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(BUSINESS):
            found.append(f"{where}: imports {node.module}")
        elif isinstance(node, ast.Import):
            found += [f"{where}: imports {a.name}" for a in node.names
                      if a.name.startswith(BUSINESS)]
    return found


def test_proof_names_no_built_in_job_type_and_imports_no_business_module() -> None:
    """Would catch a ``if job_type == "charge_payment"`` branch, a hand-kept tuple of built-in
    names, or an import of a job module or the business domain creeping back into proof/."""
    names = _built_in_names()
    assert len(names) >= 3, names  # the registry found the built-in job types
    found = [hit for path in sorted(PROOF.rglob("*.py")) for hit in _mentions(path, names)]
    assert found == []


def test_the_check_sees_a_name_in_a_string_an_identifier_and_an_import(tmp_path: Path) -> None:
    """The check itself is not blind: each form it looks for is reported."""
    probe = tmp_path / "probe.py"
    name = sorted(_built_in_names())[0]
    probe.write_text(f'import pipelines.domain\nfrom pipelines.jobs import x\nA = "{name} here"\n'
                     f"B = x.{name}\n{name} = 1\n")
    assert len(_mentions(probe, {name}, root=tmp_path)) == 5
