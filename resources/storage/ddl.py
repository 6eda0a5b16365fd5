"""What a migration statement locks on Postgres, and what work it does under that lock.

``sekali db upgrade --dry-run`` prints it beside each statement, the Postgres runner uses it to
bound a statement's wait and hold (:mod:`resources.storage.migration_runners`), and a test keeps
new migrations online with it. The rules are PostgreSQL's own (the ``ALTER TABLE`` and
"Explicit Locking" chapters); a test runs every statement of ``sql/`` and compares the lock it
really takes (``pg_locks``) with the one written here.

The question an operator asks is "does this stop my writers, and for how long?": a lock that
conflicts with ``ROW EXCLUSIVE`` (SHARE and stronger) stops every INSERT/UPDATE on the table
while it is held, and while it waits in the queue. Held for metadata work it lasts milliseconds;
held while the table is scanned, rewritten or indexed it lasts as long as the table is large.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

ACCESS_EXCLUSIVE = "ACCESS EXCLUSIVE"
EXCLUSIVE = "EXCLUSIVE"
SHARE_ROW_EXCLUSIVE = "SHARE ROW EXCLUSIVE"
SHARE = "SHARE"
SHARE_UPDATE_EXCLUSIVE = "SHARE UPDATE EXCLUSIVE"
ROW_EXCLUSIVE = "ROW EXCLUSIVE"

_BLOCKS_WRITES = {ACCESS_EXCLUSIVE, EXCLUSIVE, SHARE_ROW_EXCLUSIVE, SHARE}
_STRENGTH = [ROW_EXCLUSIVE, SHARE_UPDATE_EXCLUSIVE, SHARE, SHARE_ROW_EXCLUSIVE, EXCLUSIVE,
             ACCESS_EXCLUSIVE]

# What the statement does while it holds the lock: the first three are short whatever the size
# of the table; the rest grow with it.
METADATA = "metadata"
NEW_TABLE = "new table"
ROWS = "rows"  # an UPDATE/DELETE/INSERT: row locks on the rows it touches
BATCHES = "rows, in batches"
SCAN = "scan"
REWRITE = "rewrite"
BUILD = "index build"
UNKNOWN = "unknown"
_SIZE_BOUND = {SCAN, REWRITE, BUILD, UNKNOWN}


@dataclass(frozen=True)
class TableLock:
    """One table lock a statement takes: the table, the lock mode (as PostgreSQL's docs name
    it) and the work done while holding it."""

    table: str
    mode: str
    work: str

    @property
    def blocks_writes(self) -> bool:
        """Writers on ``table`` wait while this lock is held or queued."""
        return self.mode in _BLOCKS_WRITES

    @property
    def size_bound(self) -> bool:
        """Held for as long as the table is large (scan, rewrite, index build, unknown)."""
        return self.work in _SIZE_BOUND

    def __str__(self) -> str:
        return f"{self.table}: {self.mode} ({self.work})"


@dataclass
class Context:
    """What earlier statements of the same migration did, as later ones depend on it: tables it
    created (nobody else uses them yet) and columns a validated ``CHECK (c IS NOT NULL)`` proves
    (``SET NOT NULL`` then skips its scan, PostgreSQL 12 and later)."""

    created: set[str] = field(default_factory=set)
    checks: dict[tuple[str, str], str] = field(default_factory=dict)  # (table, name) -> expression
    proven_not_null: set[tuple[str, str]] = field(default_factory=set)


_WS = re.compile(r"\s+")
_IDENT = r"\"?([A-Za-z_][A-Za-z0-9_.]*)\"?"
_TAKES_NO_TABLE_LOCK = re.compile(
    r"CREATE OR REPLACE FUNCTION|CREATE FUNCTION|COMMENT ON|SELECT", re.I)
_VOLATILE = re.compile(r"\b(random|clock_timestamp|gen_random_uuid|uuid_generate_v4|nextval|"
                       r"timeofday)\s*\(", re.I)


def statement_locks(sql: str, context: Context | None = None, *, batched: bool = False
                    ) -> list[TableLock]:
    """The table locks ``sql`` takes on Postgres, strongest first per table; updates
    ``context`` with what it created or proved. ``batched``: a data change the runner runs in
    bounded batches (``-- sekali: batch``)."""
    ctx = context if context is not None else Context()
    s = _WS.sub(" ", sql.strip()).rstrip(";")
    if m := re.match(rf"CREATE TABLE (?:IF NOT EXISTS )?{_IDENT}", s, re.I):
        ctx.created.add(_name(m.group(1)))
        return [TableLock(_name(m.group(1)), ACCESS_EXCLUSIVE, NEW_TABLE)]
    if m := re.match(rf"CREATE (?:UNIQUE )?INDEX (CONCURRENTLY )?(?:IF NOT EXISTS )?(?:{_IDENT} )?"
                     rf"ON (?:ONLY )?{_IDENT}", s, re.I):
        table = _name(m.group(3))
        if m.group(1):
            return [TableLock(table, SHARE_UPDATE_EXCLUSIVE, BUILD)]
        return [TableLock(table, SHARE, NEW_TABLE if table in ctx.created else BUILD)]
    if m := re.match(rf"DROP INDEX (CONCURRENTLY )?(?:IF EXISTS )?{_IDENT}", s, re.I):
        target = f"index {_name(m.group(2))}"
        return [TableLock(target, SHARE_UPDATE_EXCLUSIVE if m.group(1) else ACCESS_EXCLUSIVE,
                          METADATA)]
    if m := re.match(rf"CREATE (?:OR REPLACE )?(?:CONSTRAINT )?TRIGGER .*? ON {_IDENT}", s, re.I):
        return [TableLock(_name(m.group(1)), SHARE_ROW_EXCLUSIVE, METADATA)]
    if m := re.match(rf"DROP TRIGGER (?:IF EXISTS )?{_IDENT} ON {_IDENT}", s, re.I):
        return [TableLock(_name(m.group(2)), ACCESS_EXCLUSIVE, METADATA)]
    if m := re.match(rf"DROP TABLE (?:IF EXISTS )?{_IDENT}", s, re.I):
        return [TableLock(_name(m.group(1)), ACCESS_EXCLUSIVE, METADATA)]
    if m := re.match(rf"(?:UPDATE|DELETE FROM|INSERT INTO) (?:ONLY )?{_IDENT}", s, re.I):
        table = _name(m.group(1))
        work = NEW_TABLE if table in ctx.created else BATCHES if batched else ROWS
        return [TableLock(table, ROW_EXCLUSIVE, work)]
    if m := re.match(rf"ALTER TABLE (?:IF EXISTS )?(?:ONLY )?{_IDENT} (.*)$", s, re.I):
        table = _name(m.group(1))
        locks = [_alter_action(table, action, ctx) for action in _actions(m.group(2))]
        mode = max((lock.mode for lock in locks), key=_STRENGTH.index)
        work = _worst(lock.work for lock in locks)
        if table in ctx.created:
            work = NEW_TABLE
        return [TableLock(table, mode, work)]
    if m := re.match(rf"(?:VACUUM|ANALYZE)(?: \([^)]*\))? {_IDENT}", s, re.I):
        return [TableLock(_name(m.group(1)), SHARE_UPDATE_EXCLUSIVE, SCAN)]
    if _TAKES_NO_TABLE_LOCK.match(s):
        return []
    return [TableLock("?", ACCESS_EXCLUSIVE, UNKNOWN)]


def _alter_action(table: str, action: str, ctx: Context) -> TableLock:
    a = action.strip()
    up = a.upper()
    if up.startswith("VALIDATE CONSTRAINT"):
        name = _name(a.split()[2])
        expression = ctx.checks.get((table, name), "")
        if nn := re.fullmatch(rf"\(?\s*{_IDENT} IS NOT NULL\s*\)?", expression, re.I):
            ctx.proven_not_null.add((table, _name(nn.group(1))))
        return TableLock(table, SHARE_UPDATE_EXCLUSIVE, SCAN)
    if m := re.match(rf"ADD CONSTRAINT {_IDENT} CHECK ?(.*)$", a, re.I):
        body = m.group(2)
        not_valid = body.upper().endswith("NOT VALID")
        if not_valid:
            body = body[: -len("NOT VALID")].strip()
        ctx.checks[(table, _name(m.group(1)))] = _strip_parens(body)
        return TableLock(table, ACCESS_EXCLUSIVE, METADATA if not_valid else SCAN)
    if re.match(rf"ADD CONSTRAINT {_IDENT} FOREIGN KEY", a, re.I):
        return TableLock(table, SHARE_ROW_EXCLUSIVE, METADATA if up.endswith("NOT VALID") else SCAN)
    if re.match(rf"ADD CONSTRAINT {_IDENT} (UNIQUE|PRIMARY KEY)", a, re.I):
        return TableLock(table, ACCESS_EXCLUSIVE, METADATA if "USING INDEX" in up else BUILD)
    if up.startswith("DROP CONSTRAINT"):
        return TableLock(table, ACCESS_EXCLUSIVE, METADATA)
    if m := re.match(rf"ADD (?:COLUMN )?(?:IF NOT EXISTS )?{_IDENT} (.*)$", a, re.I):
        rest = m.group(2).upper()
        generated = "GENERATED ALWAYS AS" in rest and "STORED" in rest
        rewrites = generated or bool(_VOLATILE.search(rest))
        return TableLock(table, ACCESS_EXCLUSIVE, REWRITE if rewrites else METADATA)
    if re.match(r"DROP (?:COLUMN )?", a, re.I):
        return TableLock(table, ACCESS_EXCLUSIVE, METADATA)
    if m := re.match(rf"ALTER (?:COLUMN )?{_IDENT} (.*)$", a, re.I):
        column, change = _name(m.group(1)), m.group(2).upper()
        if change.startswith(("TYPE", "SET DATA TYPE")):
            return TableLock(table, ACCESS_EXCLUSIVE, REWRITE)
        if change.startswith("SET NOT NULL"):
            proven = (table, column) in ctx.proven_not_null
            return TableLock(table, ACCESS_EXCLUSIVE, METADATA if proven else SCAN)
        if change.startswith("SET STATISTICS"):
            return TableLock(table, SHARE_UPDATE_EXCLUSIVE, METADATA)
        return TableLock(table, ACCESS_EXCLUSIVE, METADATA)  # DROP NOT NULL, SET/DROP DEFAULT
    if up.startswith(("RENAME", "OWNER TO")):
        return TableLock(table, ACCESS_EXCLUSIVE, METADATA)
    if up.startswith(("SET (", "RESET (")):
        return TableLock(table, SHARE_UPDATE_EXCLUSIVE, METADATA)
    return TableLock(table, ACCESS_EXCLUSIVE, UNKNOWN)


def _actions(text: str) -> list[str]:
    """``ALTER TABLE``'s comma-separated actions, commas inside parentheses kept."""
    out: list[str] = []
    current: list[str] = []
    depth = 0
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(current))
            current = []
        else:
            current.append(ch)
    out.append("".join(current))
    return [a.strip() for a in out if a.strip()]


def _worst(works: Iterable[str]) -> str:
    order = [NEW_TABLE, METADATA, ROWS, BATCHES, SCAN, BUILD, REWRITE, UNKNOWN]
    return max(works, key=order.index)


def _strip_parens(text: str) -> str:
    text = text.strip()
    while text.startswith("(") and text.endswith(")"):
        text = text[1:-1].strip()
    return text


def _name(identifier: str) -> str:
    return identifier.strip('"').split(".")[-1].lower()


def outside_transactions(sql: str) -> bool:
    """Postgres runs this statement only outside a transaction block (an online file)."""
    upper = sql.upper()
    return "CONCURRENTLY" in upper or upper.lstrip().startswith("VACUUM")


def risky(locks: list[TableLock]) -> list[TableLock]:
    """The locks that stop writers for as long as the table is large: what an online migration
    must not hold on a table that may be big (the tables it creates itself are empty)."""
    return [
        lock for lock in locks
        if (lock.blocks_writes and lock.size_bound) or lock.work == ROWS
    ]
