"""The dead letter queue in the Dagster UI.

- ``dead_letters``: an asset whose latest materialisation's metadata is the table of unresolved
  DLQ records (id, status, job type, class, reason, failures, age, key), with counts by status
  and class.
- ``no_permanent_dead_letters``: its asset check, ERROR while any unresolved record failed
  permanently (a permanent failure is never retried: someone must fix the cause, then replay or
  discard it).

Both are published without a run: the DLQ sensors call :func:`publish` after they record,
resolve or launch something, and it reports a materialisation and the check's evaluation as
runless asset events only when the table's content changed (its digest is kept in the
metadata), so the asset page follows the store within one sensor tick at the cost of one query.
Materialising the asset from the UI computes the same in a run.
"""

import hashlib
import time
from collections.abc import Sequence
from typing import Any

import dagster as dg

from resources.dagster_resources import DlqResource
from resources.dlq import DlqRecord, DlqStore

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
    """The error type and message (without the type repeated in it), cut at a word boundary."""
    message = record.last_error or ""
    head, sep, rest = message.partition(": ")
    if sep and head.rsplit(".", 1)[-1] == record.error_type:
        message = rest
    text = f"{record.error_type}: {message}".strip().rstrip(":")
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[:limit].rsplit(" ", 1)[0]
    return cut + " …"


def digest(records: Sequence[DlqRecord]) -> str:
    """What the table says, apart from ages: a change of it is worth publishing."""
    raw = "|".join(
        f"{r.id}:{r.status}:{r.failure_count}:{r.error_class}:{r.fingerprint}" for r in records
    )
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def permanent(records: Sequence[DlqRecord]) -> list[DlqRecord]:
    return [r for r in records if r.error_class == "permanent"]


def dead_letter_metadata(records: Sequence[DlqRecord], now: float) -> dict[str, Any]:
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
        for r in records[:MAX_ROWS]
    ]
    by_class: dict[str, int] = {}
    by_status: dict[str, int] = {}
    for r in records:
        by_class[r.error_class] = by_class.get(r.error_class, 0) + 1
        by_status[str(r.status)] = by_status.get(str(r.status), 0) + 1
    metadata: dict[str, Any] = {
        "records": dg.MetadataValue.table(rows, dg.TableSchema(columns=_COLUMNS)),
        "unresolved": dg.MetadataValue.int(len(records)),
        **{f"class/{k}": dg.MetadataValue.int(v) for k, v in sorted(by_class.items())},
        **{f"status/{k}": dg.MetadataValue.int(v) for k, v in sorted(by_status.items())},
        "digest": dg.MetadataValue.text(digest(records)),
    }
    if len(records) > MAX_ROWS:
        metadata["shown"] = dg.MetadataValue.text(f"the oldest {MAX_ROWS} of {len(records)}")
    return metadata


def check_evaluation(records: Sequence[DlqRecord]) -> tuple[bool, str, dict[str, Any]]:
    """(passed, description, metadata) of ``no_permanent_dead_letters``."""
    stuck = permanent(records)
    if not stuck:
        return True, "no permanent failure is waiting in the DLQ", {}
    ids = ", ".join(str(r.id) for r in stuck[:20]) + (" …" if len(stuck) > 20 else "")
    return (
        False,
        f"{len(stuck)} permanent failure(s) waiting in the DLQ (ids {ids}): fix the cause, then"
        " replay them (dlq_operations, `sekali dlq replay`) or discard them with a reason",
        {"permanent": dg.MetadataValue.int(len(stuck)), "ids": dg.MetadataValue.text(ids)},
    )


def unresolved(store: DlqStore) -> list[DlqRecord]:
    return store.list_records(status=UNRESOLVED)


def publish(instance: dg.DagsterInstance, store: DlqStore, *, force: bool = False) -> bool:
    """Report the table and the check as runless events if the table changed since the last
    materialisation (or ``force``). Returns whether it reported."""
    records = unresolved(store)
    key = dg.AssetKey(DEAD_LETTERS)
    if not force:
        latest = instance.get_latest_materialization_event(key)
        materialization = latest.asset_materialization if latest is not None else None
        last = materialization.metadata.get("digest") if materialization is not None else None
        if last is not None and getattr(last, "value", None) == digest(records):
            return False
    instance.report_runless_asset_event(
        dg.AssetMaterialization(key, metadata=dead_letter_metadata(records, time.time()))
    )
    passed, description, metadata = check_evaluation(records)
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
    records = unresolved(dlq.get_store())
    return dg.MaterializeResult(metadata=dead_letter_metadata(records, time.time()))


@dg.asset_check(
    asset=dead_letters,
    name=CHECK_NAME,
    description="Fails (ERROR) while a permanent failure waits in the DLQ.",
)
def no_permanent_dead_letters(dlq: DlqResource) -> dg.AssetCheckResult:
    passed, description, metadata = check_evaluation(unresolved(dlq.get_store()))
    return dg.AssetCheckResult(
        passed=passed,
        severity=dg.AssetCheckSeverity.ERROR,
        description=description,
        metadata=metadata,
    )


assets = [dead_letters]
asset_checks = [no_permanent_dead_letters]
