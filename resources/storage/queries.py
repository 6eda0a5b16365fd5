"""Named SQL statements kept in a ``.sql`` file beside the store that owns their tables.

The file holds blocks in procrastinate's style::

    -- queue_depth --
    -- Pending and launched requests per job type, with the oldest pending one.
    SELECT ...;

A block starts with a ``-- name --`` line; the comment lines after it describe the statement;
everything up to the next block is the statement (a trailing ``;`` is dropped). Only the owning
store loads its file, once, at import.

Where the dialects need different text for a statement, ``NAME.postgresql.sql`` and
``NAME.sqlite.sql`` beside ``NAME.sql`` hold that block for their dialect
(:func:`load_dialect_queries`), as the migrations' dialect files do: the store picks the set of
its database's dialect once and never branches on it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path

DIALECTS = ("sqlite", "postgresql")
"""The dialects, as SQLAlchemy names them and as variant query (and migration) files end; each
has its class in :mod:`resources.storage.dialects`."""

_HEADER = re.compile(r"^--\s*([a-z_][a-z0-9_]*)\s*--\s*$")


def load_queries(path: Path) -> dict[str, str]:
    """``{name: statement}`` from ``path``; a duplicate or empty block is a ValueError."""
    queries: dict[str, str] = {}
    name: str | None = None
    body: list[str] = []

    def close() -> None:
        if name is None:
            return
        statement = "\n".join(line for line in body if not line.lstrip().startswith("--"))
        statement = statement.strip().rstrip(";").strip()
        if not statement:
            raise ValueError(f"{path.name}: query {name!r} is empty")
        if name in queries:
            raise ValueError(f"{path.name}: query {name!r} is defined twice")
        queries[name] = statement

    for line in path.read_text().splitlines():
        match = _HEADER.match(line.strip())
        if match:
            close()
            name, body = match.group(1), []
        elif name is not None:
            body.append(line)
    close()
    return queries


def load_dialect_queries(path: Path) -> dict[str, dict[str, str]]:
    """``{dialect: {name: statement}}``: the blocks of ``path``, each overridden by the block of
    the same name in ``path``'s ``.postgresql.sql`` / ``.sqlite.sql`` sibling when there is one.
    A name that some dialect lacks is a ValueError (a store would fail only on that dialect)."""
    shared = load_queries(path)
    by_dialect: dict[str, dict[str, str]] = {}
    for dialect in DIALECTS:
        own = path.with_suffix(f".{dialect}.sql")
        by_dialect[dialect] = {**shared, **(load_queries(own) if own.exists() else {})}
    names = set().union(*(set(q) for q in by_dialect.values()))
    for dialect, queries in by_dialect.items():
        missing = sorted(names - set(queries))
        if missing:
            raise ValueError(f"{path.name}: no {dialect} text for {', '.join(missing)}")
    return by_dialect


_ALIASED_COLUMNS = re.compile(r"\{([a-z_]+)\.columns\}")


def filled_queries(
    queries: Mapping[str, str], *, fragments: Sequence[str] = (), columns: Sequence[str] = ()
) -> dict[str, str]:
    """``queries`` with their shared parts written out at import, so a statement names each
    only once: ``{name}`` of a block in ``fragments`` becomes that block (in the order given,
    so a block may use the ones after it; the blocks themselves are left out), ``{columns}``
    the column list, ``{t.columns}`` the same list qualified by ``t``. Any other ``{...}`` is
    left for the caller to format."""
    names = list(fragments)
    blocks = {name: queries[name] for name in names}
    for i, name in enumerate(names):
        for later in names[i + 1:]:
            blocks[name] = blocks[name].replace(f"{{{later}}}", blocks[later])
    listed = ", ".join(columns)
    out: dict[str, str] = {}
    for name, sql in queries.items():
        if name in blocks:
            continue
        for block in names:
            sql = sql.replace(f"{{{block}}}", blocks[block])
        sql = sql.replace("{columns}", listed)
        out[name] = _ALIASED_COLUMNS.sub(
            lambda m: ", ".join(f"{m[1]}.{c}" for c in columns), sql)
    return out


_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?$")


def identifier(name: str) -> str:
    """``name`` if it is a plain SQL identifier (``table`` or ``schema.table``) a statement may
    be formatted with; a ValueError otherwise, so nothing else reaches the SQL text."""
    if not _IDENTIFIER.match(name):
        raise ValueError(f"not a plain SQL identifier: {name!r}")
    return name
