"""What every part of :class:`engine.requests.RequestStore` shares: the database, the clock,
the named statements of the database's dialect, and whether a status may be written yet."""

from __future__ import annotations

import time
from pathlib import Path

from engine.requests.model import INTRODUCED_BY, Clock, RequestStatus, job_requests
from resources.storage.db import Database
from resources.storage.migrations import ReaderFloor
from resources.storage.queries import filled_queries, load_dialect_queries, load_queries

_QUERY_FILE = Path(__file__).with_name("queries.sql")
QUERIES = {dialect: filled_queries(queries, fragments=("read_request", "claimable", "ready"),
                                   columns=[c.name for c in job_requests.c])
           for dialect, queries in load_dialect_queries(_QUERY_FILE).items()}
"""The request store's named statements per dialect, the blocks other statements include
(``{read_request}``, which includes ``{claimable}``, which includes ``{ready}``) and the column
lists filled in; only this package reads them."""
CONDITIONS = load_queries(_QUERY_FILE)
"""The blocks as written, for the conditions other stores' retention embeds (the same on every
dialect)."""


class StoreBase:
    """The state every part of the store reads. Thread-safe; share one per process."""

    def __init__(self, db: Database, *, clock: Clock = time.time, fair: bool = True) -> None:
        self.db = db
        self.clock = clock
        self.fair = fair
        """Share claims between tenants (:mod:`engine.tenants`); False claims in ``claim_rank``
        order alone, as before fair share (the benchmark's baseline)."""
        self.readers = ReaderFloor(db)
        self._q = QUERIES[db.dialect]

    def writable(self, status: RequestStatus) -> bool:
        """May ``status`` be written? Not while a process that cannot read it may run
        (:data:`engine.requests.INTRODUCED_BY`)."""
        introduced = INTRODUCED_BY.get(status)
        return introduced is None or self.readers.knows(introduced)
