"""The dead letter queue in the Dagster UI.

- ``dead_letters``: an asset whose latest materialisation's metadata is the table of unresolved
  DLQ records (id, status, job type, class, reason, failures, age, key), with counts by status
  and class.
- ``no_permanent_dead_letters``: its asset check, ERROR while any unresolved record failed
  permanently (a permanent failure is never retried: someone must fix the cause, then replay or
  discard it).

Both are published without a run: the DLQ sensors call :func:`publish` after they record,
resolve or launch something, and it reports a materialisation and the check's evaluation as
runless asset events only when the store changed (its change mark and the table's digest are
kept in the metadata), so the asset page follows the store within one sensor tick at the cost
of one query when nothing changed, and of a bounded :func:`snapshot` when something did: the
counts come from a grouped count in the database, the table shows the oldest ``MAX_ROWS``
records; no tick lists every unresolved record. Materialising the asset from the UI computes
the same in a run.
"""

import hashlib
import time
from dataclasses import dataclass
from typing import Any

import dagster as dg

from resources.dagster_resources import DlqResource
from resources.dlq import DlqRecord, DlqStore, failure_line

DEAD_LETTERS = "dead_letters"
CHECK_NAME = "no_permanent_dead_letters"
UNRESOLVED = ("open", "replay_requested", "replaying")
MAX_ROWS = 200
"""Rows shown in the table (oldest records first); the counts cover every record."""

_COLUMNS = [
    dg.TableColumn("id", "int"),
    dg.TableColumn("status", "string"),
    dg.TableColumn("job_type", "string"),
    dg.TableColumn("class", "string"),
    dg.TableColumn("reason", "string"),
    dg.TableColumn("count", "int", description="failures recorded"),
    dg.TableColumn("age", "string", description="since the last failure, when published"),
    dg.TableColumn("key", "string"),
]


def age_text(seconds: float) -> str:
    """``45s``, ``12m``, ``3h 05m``, ``2d 04h``: short enough for a table cell."""
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m"
    if seconds < 86400:
        return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d {seconds % 86400 // 3600:02d}h"


def reason_text(record: DlqRecord, limit: int = 120) -> str:
    """The failure in one line (:func:`resources.dlq.failure_line`: the type once, no stack
    trace), cut at a word boundary."""
    text = failure_line(record.error_type, record.last_error)
    if len(text) <= limit:
        return text
    cut = text[:limit].rsplit(" ", 1)[0]
    return cut + " …"


STUCK = ("permanent", "crash_loop", "timed_out")
"""Classes no retry can help: the check fails while a record of one waits."""
STUCK_IDS = 20


@dataclass(frozen=True)
class Snapshot:
    """What the asset shows, read with a bounded amount of work whatever the number of
    unresolved records: a grouped count per (status, class) done by the database, the oldest
    :data:`MAX_ROWS` records, the oldest :data:`STUCK_IDS` permanent ones, and the store's
    change mark when it was read."""

    tally: dict[tuple[str, str], int]
    oldest: list[DlqRecord]
    stuck: list[DlqRecord]
    mark: int

    @property
    def unresolved(self) -> int:
        return sum(self.tally.values())

    @property
    def stuck_count(self) -> int:
        return sum(n for (_, error_class), n in self.tally.items() if error_class in STUCK)


def snapshot(store: DlqStore, mark: int | None = None) -> Snapshot:
    """The table's view; ``mark``: the change mark the caller read just before (read here if
    not given), first: a write after it shows as a change next tick."""
    mark = store.change_mark() if mark is None else mark
    return Snapshot(
        tally=store.tally(UNRESOLVED),
        oldest=store.list_records(status=UNRESOLVED, limit=MAX_ROWS, scan_ids=True),
        stuck=store.list_records(
            status=UNRESOLVED, error_classes=STUCK, limit=STUCK_IDS, by_id=False
        ),
        mark=mark,
    )


def digest(view: Snapshot) -> str:
    """What the table says, apart from ages: a change of it is worth publishing."""
    raw = "|".join(
        [f"{k[0]}:{k[1]}:{n}" for k, n in sorted(view.tally.items())]
        + [f"{r.id}:{r.status}:{r.failure_count}:{r.error_class}:{r.fingerprint}"
           for r in view.oldest]
    )
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def dead_letter_metadata(view: Snapshot, now: float) -> dict[str, Any]:
    rows = [
        dg.TableRecord(
            {
                "id": r.id,
                "status": str(r.status),
                "job_type": r.job_type,
                "class": r.error_class,
                "reason": reason_text(r),
                "count": r.failure_count,
                "age": age_text(now - r.last_failed_at),
                "key": r.idempotency_key or "",
            }
        )
        for r in view.oldest
    ]
    by_class: dict[str, int] = {}
    by_status: dict[str, int] = {}
    for (status, error_class), n in view.tally.items():
        by_class[error_class] = by_class.get(error_class, 0) + n
        by_status[status] = by_status.get(status, 0) + n
    metadata: dict[str, Any] = {
        "records": dg.MetadataValue.table(rows, dg.TableSchema(columns=_COLUMNS)),
        "unresolved": dg.MetadataValue.int(view.unresolved),
        **{f"class/{k}": dg.MetadataValue.int(v) for k, v in sorted(by_class.items())},
        **{f"status/{k}": dg.MetadataValue.int(v) for k, v in sorted(by_status.items())},
        "digest": dg.MetadataValue.text(digest(view)),
        "mark": dg.MetadataValue.int(view.mark),
    }
    if view.unresolved > len(rows):
        metadata["shown"] = dg.MetadataValue.text(f"the oldest {len(rows)} of {view.unresolved}")
    return metadata


def check_evaluation(view: Snapshot) -> tuple[bool, str, dict[str, Any]]:
    """(passed, description, metadata) of ``no_permanent_dead_letters``."""
    if not view.stuck_count:
        return True, "no permanent failure is waiting in the DLQ", {}
    ids = ", ".join(str(r.id) for r in view.stuck) + (
        " …" if view.stuck_count > len(view.stuck) else ""
    )
    return (
        False,
        f"{view.stuck_count} permanent failure(s) (permanent, crash_loop or timed_out) waiting"
        " in the DLQ"
        f" (ids {ids}): fix the cause, then replay them (dlq_operations, `sekali dlq replay`)"
        " or discard them with a reason",
        {"permanent": dg.MetadataValue.int(view.stuck_count), "ids": dg.MetadataValue.text(ids)},
    )


def publish(instance: dg.DagsterInstance, store: DlqStore, *, force: bool = False) -> bool:
    """Report the table and the check as runless events if the DLQ changed since the last
    materialisation (or ``force``). Returns whether it reported.

    Bounded work per call whatever the number of records: one read of the store's change mark
    and of the latest materialisation; only when the mark moved, a :func:`snapshot` (a grouped
    count and two pages), and the events only when its digest differs from the last one."""
    key = dg.AssetKey(DEAD_LETTERS)
    last: dict[str, Any] = {}
    mark = None
    if not force:
        latest = instance.get_latest_materialization_event(key)
        materialization = latest.asset_materialization if latest is not None else None
        if materialization is not None:
            last = {k: getattr(v, "value", None) for k, v in materialization.metadata.items()}
        mark = store.change_mark()
        if last.get("mark") is not None and last["mark"] == mark:
            return False
    view = snapshot(store, mark)
    if not force and last.get("digest") == digest(view) and last.get("mark") is not None:
        return False
    instance.report_runless_asset_event(
        dg.AssetMaterialization(key, metadata=dead_letter_metadata(view, time.time()))
    )
    passed, description, metadata = check_evaluation(view)
    instance.report_runless_asset_event(
        dg.AssetCheckEvaluation(
            asset_key=key,
            check_name=CHECK_NAME,
            passed=passed,
            severity=dg.AssetCheckSeverity.ERROR,
            description=description,
            metadata=metadata,
        )
    )
    return True


@dg.asset(
    name=DEAD_LETTERS,
    group_name="dlq",
    description="Unresolved DLQ records as a table (id, status, job type, class, reason, "
    "failures, age, key). Kept current by the DLQ sensors; materialise to refresh by hand.",
)
def dead_letters(dlq: DlqResource) -> dg.MaterializeResult:
    return dg.MaterializeResult(
        metadata=dead_letter_metadata(snapshot(dlq.get_store()), time.time())
    )


@dg.asset_check(
    asset=dead_letters,
    name=CHECK_NAME,
    description="Fails (ERROR) while a permanent failure waits in the DLQ.",
)
def no_permanent_dead_letters(dlq: DlqResource) -> dg.AssetCheckResult:
    passed, description, metadata = check_evaluation(snapshot(dlq.get_store()))
    return dg.AssetCheckResult(
        passed=passed,
        severity=dg.AssetCheckSeverity.ERROR,
        description=description,
        metadata=metadata,
    )


assets = [dead_letters]
asset_checks = [no_permanent_dead_letters]
