"""The architecture review's figures of the code itself: ``python -m benchmarks.code_figures
[--json] [--top N]``.

Read from the source with :mod:`ast` (nothing is imported or run), so the same command gives the
before and after of a restructuring:

- the largest classes (lines) in ``engine/`` and ``resources/``, and how many exceed 500 lines;
- the longest functions in the project's packages;
- the functions whose parameter lists exceed 8 (``self`` and ``cls`` not counted);
- the ``type: ignore``, ``noqa`` and ``nosec`` comments, and of the ``noqa`` ones how many name
  only rules ruff does not run (``[tool.ruff.lint] select`` of ``pyproject.toml``);
- the ``is_postgres`` branches (an ``if``, a conditional expression or a comprehension's
  condition that reads it) and the files they sit in;
- the ``text(...)`` calls whose SQL is written inline (anything but ``text(_Q["name"])``, a
  statement of a named-query file) in ``engine/`` and ``resources/``, and elsewhere; and,
  stricter, the string literals there that hold SQL (an upper-case ``SELECT``, ``INSERT INTO``,
  ``UPDATE ... SET``, ``DELETE FROM``, ``WHERE``, ``ON CONFLICT``, ``CREATE``/``ALTER TABLE``;
  docstrings and the patterns of ``re`` calls, which recognise SQL, not counted), wherever
  they are passed;
- the lines of Python per top-level folder.

The totals are of the shipped packages; ``tests/`` shows in the lines per folder and in the
markers per folder only.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import re
import sys
import tokenize
import tomllib
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("resources", "engine", "sandbox", "sensors", "pipelines", "proof", "cli",
            "benchmarks")
"""The shipped top-level packages, lowest layer first."""
ROOMS = ("engine", "resources")
"""Where classes must stay under :data:`CLASS_LIMIT` lines and SQL must be named."""
CLASS_LIMIT = 500
PARAMETER_LIMIT = 8
_NOQA = re.compile(r"#\s*noqa(?::\s*([A-Z0-9, ]+))?", re.I)
_RULE = re.compile(r"[A-Z]+[0-9]+")
_SQL = re.compile(
    r"\bSELECT\b|\bINSERT\s+INTO\b|\bUPDATE\s+\w+\s+SET\b|\bDELETE\s+FROM\b|\bWHERE\b"
    r"|\bON\s+CONFLICT\b|\bCREATE\s+(?:TABLE|INDEX|UNIQUE)\b|\bALTER\s+TABLE\b"
)


@dataclass(frozen=True)
class Span:
    """A class or function: where it is and how long it is."""

    name: str
    path: str
    line: int
    lines: int


def _python_files(root: Path, folder: str) -> list[Path]:
    return sorted(p for p in (root / folder).rglob("*.py") if ".venv" not in p.parts)


def _comments(source: str) -> list[str]:
    try:
        return [tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT]
    except (tokenize.TokenError, SyntaxError):
        return [line[line.index("#"):] for line in source.splitlines() if "#" in line]


def _ruff_selected(root: Path) -> tuple[str, ...]:
    config = tomllib.loads((root / "pyproject.toml").read_text())
    lint = config.get("tool", {}).get("ruff", {}).get("lint", {})
    return tuple(lint.get("select", ())) + tuple(lint.get("extend-select", ()))


def _runs(rule: str, selected: tuple[str, ...]) -> bool:
    """Whether ruff's ``select`` covers ``rule``: ``B`` selects ``B904`` but not ``BLE001``."""
    letters = rule.rstrip("0123456789")
    for selector in selected:
        prefix = selector.rstrip("0123456789")
        if selector == "ALL" or (prefix == letters and rule.startswith(selector)):
            return True
    return False


def _reads_is_postgres(node: ast.AST) -> bool:
    return any(
        (isinstance(sub, ast.Attribute) and sub.attr == "is_postgres")
        or (isinstance(sub, ast.Name) and sub.id == "is_postgres")
        for sub in ast.walk(node)
    )


def _is_text_call(node: ast.Call) -> bool:
    func = node.func
    return (isinstance(func, ast.Name) and func.id == "text") or (
        isinstance(func, ast.Attribute) and func.attr == "text"
        and isinstance(func.value, ast.Name) and func.value.id in {"sa", "sqlalchemy"}
    )


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings or bare string statements."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}


_PATTERN_CALLS = frozenset({"compile", "match", "search", "fullmatch", "sub", "split",
                            "findall", "finditer"})


def _patterns(tree: ast.AST) -> set[int]:
    """ids of the string constants in the pattern argument of an ``re`` call: text that
    recognises SQL (a migration's DDL read for its locks), not SQL sent anywhere."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "re"
                and node.func.attr in _PATTERN_CALLS):
            out.update(id(sub) for sub in ast.walk(node.args[0]))
    return out


def _sql_literals(tree: ast.AST) -> int:
    """String literals (f-string parts included) that hold SQL, docstrings and ``re`` patterns
    left out."""
    skip = _docstrings(tree) | _patterns(tree)
    count = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr) and id(node) in skip:
            skip.update(id(v) for v in node.values)
        elif isinstance(node, ast.JoinedStr):
            parts = [v.value for v in node.values
                     if isinstance(v, ast.Constant) and isinstance(v.value, str)]
            count += bool(_SQL.search("".join(parts)))
            skip.update(id(v) for v in node.values)
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in skip and _SQL.search(node.value)):
            count += 1
    return count


def _named(arg: ast.expr) -> bool:
    """``_Q["name"]`` (or any subscript of a loaded query dict) is a named statement."""
    return isinstance(arg, ast.Subscript)


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = fn.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    if names and names[0] in {"self", "cls"}:
        names = names[1:]
    return len(names) + (args.vararg is not None) + (args.kwarg is not None)


@dataclass
class _Tally:
    """What the files read so far add up to."""

    selected: tuple[str, ...]
    classes: list[Span] = field(default_factory=list)
    functions: list[Span] = field(default_factory=list)
    wide: list[dict[str, Any]] = field(default_factory=list)
    markers_by_folder: dict[str, Counter[str]] = field(default_factory=dict)
    noqa_unrun_rules: Counter[str] = field(default_factory=Counter)
    branches: list[str] = field(default_factory=list)
    inline_sql: Counter[str] = field(default_factory=Counter)
    inline_sql_files: Counter[str] = field(default_factory=Counter)
    sql_literals: Counter[str] = field(default_factory=Counter)
    sql_literal_files: Counter[str] = field(default_factory=Counter)

    def comments(self, folder: str, source: str) -> None:
        markers = self.markers_by_folder.setdefault(folder, Counter())
        for comment in _comments(source):
            for marker in ("type: ignore", "nosec"):
                if marker in comment:
                    markers[marker] += 1
            match = _NOQA.search(comment)
            if match:
                markers["noqa"] += 1
                rules = _RULE.findall(match.group(1) or "")
                unrun = [r for r in rules if not _runs(r, self.selected)]
                if rules and len(unrun) == len(rules):
                    markers["noqa of rules ruff does not run"] += 1
                    self.noqa_unrun_rules.update(unrun)

    def code(self, folder: str, rel: str, tree: ast.AST) -> None:
        where = folder if folder in ROOMS else "elsewhere"
        literals = _sql_literals(tree)
        if literals:
            self.sql_literals[where] += literals
            self.sql_literal_files[rel] += literals
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and folder in ROOMS:
                self.classes.append(_span(node, rel))
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self.functions.append(_span(node, rel))
                count = _parameters(node)
                if count > PARAMETER_LIMIT:
                    self.wide.append({"name": node.name, "path": rel, "line": node.lineno,
                                      "parameters": count})
            elif isinstance(node, ast.If | ast.IfExp | ast.While) and _reads_is_postgres(
                    node.test):
                self.branches.append(f"{rel}:{node.lineno}")
            elif isinstance(node, ast.comprehension) and any(
                    _reads_is_postgres(c) for c in node.ifs):
                self.branches.append(f"{rel}:{node.target.lineno}")
            elif isinstance(node, ast.Call) and _is_text_call(node) and node.args and not (
                    _named(node.args[0])):
                self.inline_sql[where] += 1
                self.inline_sql_files[rel] += 1


def _span(node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef, rel: str) -> Span:
    return Span(node.name, rel, node.lineno, (node.end_lineno or node.lineno) - node.lineno + 1)


def measure(top: int = 10, root: Path = ROOT) -> dict[str, Any]:
    """Every figure of the module docstring for the checkout at ``root``, as one JSON-ready
    dict."""
    t = _Tally(_ruff_selected(root))
    lines_per_folder: dict[str, int] = {}
    for folder in (*PACKAGES, "tests"):
        lines_per_folder[folder] = 0
        for path in _python_files(root, folder):
            source = path.read_text()
            lines_per_folder[folder] += len(source.splitlines())
            t.comments(folder, source)
            if folder != "tests":
                t.code(folder, str(path.relative_to(root)), ast.parse(source))
    markers: Counter[str] = Counter()
    for folder in PACKAGES:
        markers.update(t.markers_by_folder.get(folder, Counter()))
    classes = sorted(t.classes, key=lambda s: -s.lines)
    functions = sorted(t.functions, key=lambda s: -s.lines)
    wide = sorted(t.wide, key=lambda w: -int(w["parameters"]))
    total = sum(lines_per_folder[f] for f in PACKAGES)
    kinds = ("type: ignore", "noqa", "nosec")
    by_file = Counter(b.rsplit(":", 1)[0] for b in t.branches)
    return {
        "largest_classes": [asdict(s) for s in classes[:top]],
        "classes_over_limit": sum(1 for s in classes if s.lines > CLASS_LIMIT),
        "class_limit": CLASS_LIMIT,
        "longest_functions": [asdict(s) for s in functions[:top]],
        "functions_over_100_lines": sum(1 for s in functions if s.lines > 100),
        "parameter_lists_over_limit": len(wide),
        "parameter_limit": PARAMETER_LIMIT,
        "widest_parameter_lists": wide[:top],
        "markers": {m: markers[m] for m in kinds},
        "markers_with_tests": {m: sum(c[m] for c in t.markers_by_folder.values())
                               for m in kinds},
        "markers_by_folder": {f: dict(c) for f, c in t.markers_by_folder.items() if c},
        "noqa_naming_only_rules_ruff_does_not_run": markers["noqa of rules ruff does not run"],
        "noqa_unrun_rules": dict(t.noqa_unrun_rules.most_common()),
        "ruff_selected": list(t.selected),
        "is_postgres_branches": len(t.branches),
        "is_postgres_files": len(by_file),
        "is_postgres_by_file": dict(by_file.most_common()),
        "inline_sql_text_calls": dict(t.inline_sql),
        "inline_sql_files": len(t.inline_sql_files),
        "inline_sql_by_file": dict(t.inline_sql_files.most_common(top)),
        "sql_literals": dict(t.sql_literals),
        "sql_literal_files": len(t.sql_literal_files),
        "sql_literals_by_file": dict(t.sql_literal_files.most_common(top)),
        "lines_per_folder": lines_per_folder,
        "share_of_shipped_lines": {f: round(100 * lines_per_folder[f] / total, 1)
                                   for f in PACKAGES} if total else {},
    }


def render(figures: dict[str, Any]) -> str:
    """The figures as the plain text the review quotes."""
    out: list[str] = []
    limit = figures["class_limit"]
    out.append(f"largest classes in {' and '.join(ROOMS)} "
               f"({figures['classes_over_limit']} over {limit} lines):")
    out += [f"  {c['lines']:5d}  {c['name']}  {c['path']}:{c['line']}"
            for c in figures["largest_classes"]]
    out.append(f"longest functions ({figures['functions_over_100_lines']} over 100 lines):")
    out += [f"  {f['lines']:5d}  {f['name']}  {f['path']}:{f['line']}"
            for f in figures["longest_functions"]]
    out.append(f"parameter lists over {figures['parameter_limit']}: "
               f"{figures['parameter_lists_over_limit']}")
    out += [f"  {w['parameters']:5d}  {w['name']}  {w['path']}:{w['line']}"
            for w in figures["widest_parameter_lists"]]
    m, t = figures["markers"], figures["markers_with_tests"]
    out.append(f"markers in the shipped packages (with tests): type: ignore {m['type: ignore']} "
               f"({t['type: ignore']}), noqa {m['noqa']} ({t['noqa']}), nosec {m['nosec']} "
               f"({t['nosec']}); {figures['noqa_naming_only_rules_ruff_does_not_run']} noqa "
               f"name only rules ruff does not run (select = {figures['ruff_selected']})")
    for folder, counts in figures["markers_by_folder"].items():
        out.append(f"  {folder:11s} " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    out.append(f"is_postgres branches: {figures['is_postgres_branches']} in "
               f"{figures['is_postgres_files']} files")
    out += [f"  {n:5d}  {p}" for p, n in figures["is_postgres_by_file"].items()]
    sql = figures["inline_sql_text_calls"]
    out.append("inline SQL text() calls: " + ", ".join(f"{k} {v}" for k, v in sorted(sql.items()))
               + f" ({figures['inline_sql_files']} files)")
    out += [f"  {n:5d}  {p}" for p, n in figures["inline_sql_by_file"].items()]
    lit = figures["sql_literals"]
    out.append("string literals holding SQL: " + ", ".join(f"{k} {v}" for k, v in sorted(
        lit.items())) + f" ({figures['sql_literal_files']} files)")
    out += [f"  {n:5d}  {p}" for p, n in figures["sql_literals_by_file"].items()]
    out.append("lines of Python per top-level folder:")
    share = figures["share_of_shipped_lines"]
    out += [f"  {n:7d}  {f}" + (f"  ({share[f]}% of shipped)" if f in share else "")
            for f, n in figures["lines_per_folder"].items()]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.code_figures",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", action="store_true", help="print only JSON on stdout")
    parser.add_argument("--top", type=int, default=10, help="rows per listing (default 10)")
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="the checkout to measure (default: this one), e.g. a worktree of "
                             "an older commit for the before figures")
    args = parser.parse_args(argv)
    if args.top < 1:
        parser.error("--top must be at least 1")
    if not (args.root / "pyproject.toml").is_file():
        parser.error(f"--root {args.root}: no pyproject.toml there")
    figures = measure(args.top, args.root.resolve())
    print(json.dumps(figures, indent=2) if args.json else render(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
