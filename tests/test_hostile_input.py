"""Hostile input at every way in: accepted, or a ``ValidationError`` naming the field and the
limit with exactly one bounded ``job_rejections`` row. Never a crash, never nothing, never the
10 MB verbatim.

Ways in: ``enqueue``, ``sekali enqueue`` (its function), a Launchpad run's config (the
per-request op), a DLQ replay (the replay sensor) and the batch ops (payloads read back from
``job_requests``). The first half is a regression test per cause found by fuzzing; the second
half throws generated hostile payloads at each way in on SQLite and Postgres (1,000 examples per
way in under ``CI=true``).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import math
import reprlib
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from cli.commands import enqueue as enqueue_command
from engine.attempts import AttemptRecorder
from engine.intake import enqueue
from engine.registry import JOB_TYPES
from engine.requests import JobRequest, RequestStatus, RequestStore
from engine.services import Services
from engine.step import run_batch
from engine.validation import admit_request_row
from pipelines import ops
from pipelines.domain.inventory import Inventory
from pipelines.ops.failures import admit_run_config
from resources.dagster_resources import DlqResource
from resources.dlq import DlqRecord, DlqStatus, DlqStore, FailureClass, FailureInfo
from resources.errors import ValidationError
from resources.idempotency import IdempotencyStore
from resources.storage.db import Database
from resources.storage.settings import InputLimits
from sensors.dlq import admit_replay
from tests.conftest import IN_CI
from tests.job_workers import dagster_resources, replay_sensor

LIMITS = InputLimits()
PAYMENT = {"order_id": "o-1", "amount_cents": 1250, "currency": "EUR"}
EMAIL = {"template": "welcome", "user_id": "u-1", "date": "2026-11-29", "to": "u1@example.com"}
MB = 1024 * 1024


def _rejections(db: Database) -> list[dict[str, Any]]:
    return RequestStore(db).rejections()


def _assert_bounded(row: dict[str, Any]) -> None:
    """A rejection row is small and safe whatever was sent."""
    for column in ("payload", "key", "job_type", "field", "error"):
        value = row[column]
        if value is None:
            continue
        assert isinstance(value, str)
        assert len(value.encode("utf-8")) <= LIMITS.excerpt_bytes + 64, column
        assert "\x00" not in value, column
        value.encode("utf-8")  # no lone surrogate survives


def _refused(db: Database, call: Callable[[], object], field: str) -> dict[str, Any]:
    """``call`` raises a ValidationError naming ``field`` and leaves exactly one row."""
    before = len(_rejections(db))
    with pytest.raises(ValidationError) as info:
        call()
    assert info.value.field == field, str(info.value)
    rows = _rejections(db)
    assert len(rows) == before + 1
    _assert_bounded(rows[-1])
    assert rows[-1]["field"] == field
    return rows[-1]


# --- one regression test per cause -----------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "key", "field"),
    [
        pytest.param(PAYMENT, "k-\ud800", "key", id="lone surrogate in the key"),
        pytest.param({**PAYMENT, "order_id": "o-\udfff"}, None, "order_id",
                     id="lone surrogate in a value"),
        pytest.param('{"order_id": "o-\\ud800", "amount_cents": 5}', None, "order_id",
                     id="lone surrogate as a pure-ASCII JSON escape"),
        pytest.param(PAYMENT, "k-\x00-1", "key", id="NUL in the key"),
        pytest.param({**PAYMENT, "order_id": "o\x00"}, None, "order_id",
                     id="NUL in a value"),
        pytest.param('{"order_id": "o\\u0000", "amount_cents": 5}', None, "order_id",
                     id="NUL as a JSON escape"),
        pytest.param(PAYMENT, "k" * 3000, "key", id="a 3,000-character key"),
    ],
)
def test_keys_and_values_that_no_database_stores_are_refused(
    db: Database, payload: Any, key: str | None, field: str
) -> None:
    """Catches: a lone surrogate failing at the INSERT (both databases), NUL failing on Postgres
    only (DataError) and stored on SQLite, a ~3,000-character key over Postgres's index row
    limit (ProgramLimitExceeded, then retried as transient)."""
    row = _refused(db, lambda: enqueue("charge_payment", payload, key=key, db=db), field)
    assert row["source"] == "enqueue"
    with db.statement() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM job_requests")).scalar() == 0


# Connection finalisers that happen to run while the interpreter tears the 3,000-level structure
# down can fail to format their own warning (RecursionError inside weakref.__repr__): noise from
# the garbage collector, reported as "unraisable"; the refusal below is what this test checks.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_deep_nesting_is_refused_naming_the_depth_limit(db: Database) -> None:
    """Catches: 1,000+ levels of nesting raising RecursionError (no rejection row)."""
    deep = '{"template": "welcome", "context": {"x": ' + "[" * 5000 + "]" * 5000 + "}}"
    row = _refused(db, lambda: enqueue("send_email", deep, db=db), "payload")
    assert f"{LIMITS.max_depth}" in row["error"] and "deep" in row["error"]
    nested: Any = "leaf"
    for _ in range(3000):
        nested = {"n": nested}
    _refused(db, lambda: enqueue("send_email", {**EMAIL, "context": nested}, db=db), "payload")


@pytest.mark.parametrize(
    ("job_type", "key", "field"),
    [
        pytest.param(123, None, "job_type", id="an int job type"),
        pytest.param(["send_email"], None, "job_type", id="a list job type"),
        pytest.param(None, None, "job_type", id="no job type"),
        pytest.param("send_email", 42, "key", id="an int key"),
        pytest.param("send_email", b"k-1", "key", id="a bytes key"),
    ],
)
def test_a_non_string_job_type_or_key_is_named_and_kept(
    db: Database, job_type: Any, key: Any, field: str
) -> None:
    """Catches: a non-string job type or key breaking the rejection's own INSERT."""
    row = _refused(db, lambda: enqueue(job_type, EMAIL, key=key, db=db), field)
    assert "string" in row["error"]


def test_ten_megabytes_are_refused_and_kept_as_a_bounded_excerpt_with_size_and_hash(
    db: Database,
) -> None:
    """Catches: a 10 MB key and a 10 MB email context accepted, and rejected 10 MB payloads
    stored verbatim (the database grew to 71 MB)."""
    _refused(db, lambda: enqueue("send_email", EMAIL, key="k" * (10 * MB), db=db), "key")
    huge = {**EMAIL, "context": {"body": "x" * (10 * MB)}}
    row = _refused(db, lambda: enqueue("send_email", huge, db=db), "payload")
    assert str(LIMITS.payload_bytes) in row["error"]
    whole = json.dumps(huge, sort_keys=True, separators=(",", ":")).encode()
    assert (row["payload_size"], row["payload_sha256"]) == (
        len(whole), hashlib.sha256(whole).hexdigest()
    )
    text_payload = json.dumps(huge)
    row = _refused(db, lambda: enqueue("send_email", text_payload, db=db), "payload")
    assert row["payload_size"] == len(text_payload.encode())
    assert json.loads(row["payload"])["context"] == {"body": f"<str {10 * MB}>"}  # no value
    with db.statement() as conn:
        stored = conn.execute(
            text("SELECT SUM(LENGTH(payload) + LENGTH(COALESCE(key, ''))) FROM job_rejections")
        ).scalar()
    assert stored < 16 * 1024


@pytest.mark.parametrize(
    ("value", "words"),
    [
        pytest.param(math.nan, "NaN", id="NaN"),
        pytest.param(math.inf, "Infinity", id="inf"),
        pytest.param(2**70, "64-bit", id="2**70"),
        pytest.param(-(2**63) - 1, "64-bit", id="below int64"),
    ],
)
def test_nan_inf_and_huge_integers_are_named_as_such(
    db: Database, value: float, words: str
) -> None:
    """Catches: NaN and out-of-range integers accepted into a payload (or refused as "not an
    integer", hiding what is wrong)."""
    payload = {**EMAIL, "context": {"n": value}}
    row = _refused(db, lambda: enqueue("send_email", payload, db=db), "context.n")
    assert words in row["error"]
    as_text = json.dumps(payload)  # NaN / Infinity / a 22-digit number in the JSON text
    _refused(db, lambda: enqueue("send_email", as_text, db=db), "context.n")


def test_a_valid_payload_is_still_accepted_unchanged(db: Database) -> None:
    """The boundary refuses what is bad and nothing else: unicode, newlines (in a value that
    reaches only the body: one in the Subject is refused, tests/test_edge_keys.py) and the
    limits' own edges pass."""
    payload = {**EMAIL, "context": {"name": "Zoë 😀", "note": "line one\nline two",
                                    "n": 2**63 - 1}}
    made = enqueue("send_email", payload, key="k" * LIMITS.key_length, db=db)
    assert made.created and _rejections(db) == []


# --- the DLQ keeps what Postgres cannot store --------------------------------------------------


def test_record_failure_stores_nul_and_lone_surrogates_bounded(db: Database) -> None:
    """Catches: ``record_failure`` failing on Postgres for a failure whose message or payload
    holds NUL or a lone surrogate (the sensor tick then fails on every retry)."""
    store = DlqStore(db)
    recorded = store.record_failure(
        FailureInfo(
            job_type="charge_payment",
            dedupe_key="key:charge_payment:k\x00\ud800",
            error_type="DataError\x00",
            message="PostgreSQL text fields cannot contain NUL: 'a\x00b' \udc80" * 2000,
            run_id="r-\x00",
            step="charge_payment_op\ud800",
            trace="Traceback\x00 \ud800" * 10_000,
            idempotency_key="k\x00\ud800",
            payload={"order_id": "o\x00\ud800", "blob": "y" * (4 * MB)},
            run_config={"ops": {"x": {"config": {"payload": {"k": "\x00"}}}}},
            tags={"sekali/key": "k\x00"},
            correlation_id="c\x00",
        )
    )
    again = store.record_failure(
        FailureInfo(
            job_type="charge_payment",
            dedupe_key="key:charge_payment:k\x00\ud800",
            error_type="DataError",
            message="again \x00",
            run_id="r-2\x00",
        )
    )
    record = store.get(recorded.record.id)
    assert recorded.created and again.record.id == record.id and record.failure_count == 2
    for value in (record.last_error, record.trace, record.dedupe_key):
        assert value is not None and "\x00" not in value
        value.encode("utf-8")
    # a key no database stores whole is never kept cut or escaped (a lookup or a replay under
    # the changed key would be another intent): the key column stays empty, the tags keep it
    assert record.idempotency_key is None and record.tags["sekali/key"] == "k\x00"
    assert len(record.trace or "") <= 16_000 and len(record.last_error or "") <= 4_000
    with db.statement() as conn:
        size = conn.execute(text("SELECT LENGTH(payload) FROM dlq_records")).scalar()
    assert size <= 4 * LIMITS.payload_bytes
    other = store.record_failure(
        FailureInfo(job_type="charge_payment", dedupe_key="key:charge_payment:k\x00\ud801",
                    error_type="E", message="m", run_id="r-3")
    )
    assert other.created, "two keys that differ only in what was escaped stay two records"


# --- the other ways in ---------------------------------------------------------------------------


def test_cli_enqueue_refuses_hostile_payloads_with_one_line_and_exit_2(
    db: Database, db_url: str
) -> None:
    """Catches: the CLI exiting with a traceback on a payload the database cannot store."""
    for payload in ('{"order_id": "o-\\ud800", "amount_cents": 5}', "[" * 100_000):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = enqueue_command._enqueue(_cli_args(db_url, "charge_payment", payload))
        assert code == 2
        assert len(err.getvalue().strip().splitlines()) == 1, err.getvalue()
    assert [r["source"] for r in _rejections(db)] == ["cli", "cli"]


def _cli_args(db_url: str, job_type: str, payload: str) -> argparse.Namespace:
    return argparse.Namespace(
        job_type=job_type, payload=payload, key=None, correlation_id=None, url=db_url,
        wait=False, json=False, out=None,
    )


def test_a_launchpad_run_with_a_hostile_config_fails_once_and_is_kept(
    db: Database, db_url: str, redis_url: str, namespace: str
) -> None:
    """Catches: a Launchpad config that reaches the idempotency ledger unvalidated (NUL in the
    derived key: DataError on Postgres, stored on SQLite) and is retried."""
    result = ops.charge_payment_job.execute_in_process(
        run_config={"ops": {"charge_payment_op": {"config": {
            "payload": {"order_id": "o\x00-1", "amount_cents": 100, "currency": "EUR"}}}}},
        resources=dagster_resources(db_url=db_url, redis_url=redis_url, namespace=namespace),
        instance=dg.DagsterInstance.ephemeral(),
        raise_on_error=False,
    )
    assert not result.success
    (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    described = failure.step_failure_data.user_failure_data
    assert described is not None and "order_id: " in (described.description or "")
    assert described.metadata["error_class"].value == "permanent"
    assert not [e for e in result.all_events if e.event_type_value == "STEP_UP_FOR_RETRY"]
    (row,) = _rejections(db)
    assert (row["source"], row["field"]) == ("run_config", "order_id")
    with db.statement() as conn:
        assert conn.execute(text("SELECT COUNT(*) FROM idempotency_records")).scalar() == 0
    attempts = AttemptRecorder(db).all("charge_payment")
    assert [(a["outcome"], a["error_class"]) for a in attempts] == [
        ("failed_permanent", "ValidationError")
    ]


def test_a_dlq_replay_of_a_hostile_payload_is_refused_permanently_and_audited(
    db: Database, db_url: str
) -> None:
    """Catches: a replay launched for a stored payload no run can accept (here a string over
    the length limit), failing again and again instead of being refused before launch."""
    store = DlqStore(db)
    payload = {**EMAIL, "context": {"body": "x" * (LIMITS.string_length + 1)}}
    recorded = store.record_failure(
        FailureInfo(job_type="send_email", dedupe_key="request:7", error_type="SMTPError",
                    message="down", run_id="r-1", error_class=FailureClass.TRANSIENT,
                    idempotency_key="email:welcome:u-1:2026-11-29", request_id=7,
                    payload=payload)
    )
    store.request_replay([recorded.record.id], actor="test")
    sensor = replay_sensor(name="replay_hostile", max_per_tick=5, per_second=5.0)
    context = dg.build_sensor_context(
        instance=dg.DagsterInstance.ephemeral(),
        resources={"dlq": DlqResource(database_url=db_url)},
    )
    result = sensor.evaluate_tick(context)
    assert not result.run_requests
    record = store.get(recorded.record.id)
    assert record.status is DlqStatus.OPEN and record.error_class == "permanent"
    last = store.audit(record.id)[-1]
    assert last["action"] == "replay_refused" and "permanent" in last["detail"]
    assert "context.body" in last["detail"]
    (row,) = _rejections(db)
    assert (row["source"], row["field"]) == ("dlq_replay", "context.body")


def test_the_micro_batch_refuses_a_stored_payload_over_the_limits_and_goes_on(
    db: Database,
) -> None:
    """Catches: a request stored before the limits (or written around ``enqueue``) executed
    by the batch op with a key no store should hold."""
    requests = RequestStore(db)
    long_key = "k" * (LIMITS.key_length + 1)
    bad = requests.enqueue("rebuild_report_cache", long_key,
                           {"report": "daily_sales", "as_of": "2026-11-29"}, queue="light")
    cart = {"cart_id": "c-b", "items": [{"sku": "sku-b", "quantity": 1}]}
    good = requests.enqueue("reserve_inventory", "inventory-reserve:c-b", cart, queue="light")
    Inventory(db).set_stock("sku-b", 5)
    services = Services(db=db, store=IdempotencyStore(db), attempts=AttemptRecorder(db))
    summary = run_batch(requests, [bad.id, good.id], services=services)
    assert (summary["failed"], summary["completed"]) == (1, 1), summary
    stored = requests.get(bad.id)
    assert stored is not None and stored.status is RequestStatus.FAILED
    assert stored.error_class == "permanent"
    (row,) = _rejections(db)
    assert (row["source"], row["field"]) == ("micro_batch", "key")
    neighbour = requests.get(good.id)
    assert neighbour is not None and neighbour.status is RequestStatus.COMPLETED


# --- generated hostile input at every way in -----------------------------------------------------

settings.register_profile(
    "hostile-input-ci",
    max_examples=1000,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
settings.register_profile(
    "hostile-input-dev", max_examples=150, deadline=None, suppress_health_check=list(HealthCheck)
)
PROFILE = settings.get_profile("hostile-input-ci" if IN_CI else "hostile-input-dev")
"""1,000 examples per way in under ``CI=true``; a quick pass on a laptop. One migrated database
per test (each backend), reused across examples: rows are counted, not recreated."""

_ANY_CHAR = st.characters(exclude_categories=())  # every code point, NUL and surrogates too
_SPECIAL = ["\x00", "\ud800", "\udfff", "a\ud83d", "\u202e", "\ufeff", "\x7f", "\x85", "\n",
            "é", "😀", "", " ", ":", "\\u0000", "NaN", "[" * 40]
_SIZES = [1, 511, 512, 513, 65_536, 65_537, 262_143, 262_145, 1_000_000]  # 10 MB: above

weird_text = st.one_of(st.text(_ANY_CHAR, max_size=24), st.sampled_from(_SPECIAL))
huge_text = st.builds(lambda c, n: c * n, st.sampled_from(["x", "é", "😀", "\x00"]),
                      st.sampled_from(_SIZES))
plain_ids = st.from_regex(r"[a-z0-9-]{1,16}", fullmatch=True)
ids = st.one_of(plain_ids, plain_ids, weird_text, huge_text)
numbers = st.one_of(st.integers(-(2**70), 2**70), st.integers(-5, 10**9),
                    st.floats(allow_nan=True, allow_infinity=True))
dict_keys = st.one_of(weird_text, weird_text, st.integers(), st.none(), st.floats(),
                      st.tuples(st.integers()), huge_text)
scalars = st.one_of(st.none(), st.booleans(), numbers, weird_text, huge_text,
                    st.binary(max_size=4))
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(dict_keys, inner, max_size=3),
    max_leaves=12,
)


def _nest(depth: int, leaf: Any, as_list: bool) -> Any:
    for _ in range(depth):
        leaf = [leaf] if as_list else {"n": leaf}
    return leaf


deep = st.builds(_nest, st.integers(20, 3000), values, st.booleans())
payment = st.fixed_dictionaries(
    {"order_id": ids, "amount_cents": numbers,
     "currency": st.sampled_from(["EUR", "usd", "E\x00R"])}
)
email = st.fixed_dictionaries(
    {"template": st.just("welcome"), "user_id": ids, "date": st.just("2026-11-29"),
     "to": st.just("u@example.com")},
    optional={"context": st.dictionaries(dict_keys, values | deep, max_size=3)},
)
inventory = st.fixed_dictionaries(
    {"cart_id": ids, "items": st.lists(
        st.fixed_dictionaries({"sku": ids, "quantity": numbers}), max_size=3)}
)
objects = st.one_of(payment, email, inventory, st.dictionaries(dict_keys, values, max_size=4),
                    deep.map(lambda d: {"context": d}))


def _as_json_text(value: Any, ascii_only: bool) -> str:
    try:
        return json.dumps(value, ensure_ascii=ascii_only, default=str, skipkeys=True)
    except (RecursionError, ValueError, TypeError):
        return reprlib.repr(value)


payload_texts = st.one_of(
    st.builds(_as_json_text, objects, st.booleans()),
    st.text(_ANY_CHAR, max_size=40),
    st.integers(0, 100_000).map(lambda n: "[" * n + "]" * n),
    huge_text,
)
hostile_job_types = st.one_of(
    weird_text, huge_text, st.integers(), st.none(), st.lists(st.text(max_size=3), max_size=2)
)
hostile_keys = st.one_of(weird_text, huge_text, st.integers(), st.binary(max_size=3))
row_ids = st.one_of(st.none(), st.integers(1, 10), st.integers(-5, 0), st.integers(2**62, 2**80),
                    weird_text)
correlation_ids = st.one_of(st.none(), plain_ids, weird_text, huge_text, st.integers())
MATCHING = {"charge_payment": payment, "send_email": email, "reserve_inventory": inventory}
_fine_text = st.text(st.characters(exclude_categories=("Cs", "Cc")), max_size=30)
VALID = {
    "charge_payment": st.fixed_dictionaries(
        {"order_id": plain_ids, "amount_cents": st.integers(1, 10**9), "currency": st.just("EUR")}
    ),
    "send_email": st.fixed_dictionaries(
        {"template": st.just("welcome"), "user_id": plain_ids, "date": st.just("2026-11-29"),
         "to": st.just("u@example.com"),
         "context": st.dictionaries(_fine_text, _fine_text | st.integers(), max_size=3)}
    ),
    "reserve_inventory": st.fixed_dictionaries(
        {"cart_id": plain_ids, "items": st.lists(st.fixed_dictionaries(
            {"sku": plain_ids, "quantity": st.integers(1, 100)}), min_size=1, max_size=3)}
    ),
}


@st.composite
def requests_in(draw: st.DrawFn) -> dict[str, Any]:
    """A request, hostile in some parts: most often the job type and the payload's shape agree
    (so some examples are accepted), and any part may be replaced by something hostile."""
    kind = draw(st.sampled_from(sorted(MATCHING)))
    shaped, valid = MATCHING[kind], VALID[kind]
    sometimes = st.integers(0, 3).map(lambda n: n == 0)
    return {
        "job_type": draw(hostile_job_types) if draw(sometimes) else kind,
        "payload": draw(st.one_of(
            valid, valid, valid.map(lambda p: _as_json_text(p, True)), shaped,
            shaped.map(lambda p: _as_json_text(p, False)), objects, payload_texts, values,
        )),
        "key": draw(st.one_of(st.none(), st.none(), plain_ids, hostile_keys)),
        "request_id": draw(row_ids),
        "correlation_id": draw(correlation_ids),
    }


class Entry:
    """One way in, driven the way its caller drives it; returns False when it refused."""

    def __init__(self, db: Database, db_url: str, payload_file: Path) -> None:
        self.db = db
        self.db_url = db_url
        self.payload_file = payload_file
        self.requests = RequestStore(db)
        # What the failure path reads from an op's context; the real op is run end to end in
        # test_a_launchpad_run_with_a_hostile_config_fails_once_and_is_kept.
        self.context = types.SimpleNamespace(run_id="run-1", retry_number=0)
        self.services = Services(db=db, store=IdempotencyStore(db), attempts=AttemptRecorder(db))

    def enqueue(self, job_type: Any, payload: Any, key: Any, **_: Any) -> bool:
        try:
            enqueue(job_type, payload, key=key, db=self.db)
        except ValidationError:
            return False
        return True

    def cli(self, job_type: Any, payload: Any, key: Any, **_: Any) -> bool | None:
        """True accepted, False refused (one rejection row), None an unknown job type: the
        CLI refuses it as an operator's mistake and keeps no row (the other ways in keep one)."""
        text_payload = payload if isinstance(payload, str) else _as_json_text(payload, False)
        if text_payload.startswith("@") or text_payload == "-":  # sent as a file's content
            self.payload_file.write_bytes(text_payload.encode("utf-8", "surrogatepass"))
            text_payload = f"@{self.payload_file}"
        args = argparse.Namespace(
            job_type=str(job_type), payload=text_payload, correlation_id=None, url=self.db_url,
            key=key if key is None else str(key), wait=False, json=False, out=None,
        )
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = enqueue_command._enqueue(args)
        assert code in (0, 2), err.getvalue()
        assert len(err.getvalue().splitlines()) == (code == 2), err.getvalue()
        if str(job_type) not in JOB_TYPES:  # an operator's mistake: refused, nothing kept
            assert code == 2 and "SEKALI_JOB_MODULES" in err.getvalue(), err.getvalue()
            return None
        return code == 0

    def run_config(self, job_type: Any, payload: Any, key: Any, request_id: Any,
                   correlation_id: Any) -> bool:
        known = isinstance(job_type, str) and job_type in MATCHING
        name = job_type if known else "charge_payment"  # the op's own type, never the input
        config = types.SimpleNamespace(  # what the op's config object carries
            payload=payload, key=key, request_id=request_id, correlation_id=correlation_id
        )
        try:
            admit_run_config(self.context, self.services, name, config, step=f"{name}_op")
        except dg.Failure as exc:
            assert isinstance(exc.__cause__, ValidationError)
            assert exc.allow_retries is False
            raise exc.__cause__ from None
        return True

    def dlq_replay(self, job_type: Any, payload: Any, key: Any, request_id: Any,
                   correlation_id: Any) -> bool:
        admit_replay(_record(job_type, payload, key, request_id, correlation_id), self.requests)
        return True

    def micro_batch(self, job_type: Any, payload: Any, key: Any, request_id: Any,
                    correlation_id: Any) -> bool:
        row = JobRequest(
            id=request_id, job_type=job_type, key=key, payload=payload, payload_hash="",
            status=RequestStatus.LAUNCHED, queue="light", correlation_id=correlation_id,
            run_key=None, run_id=None, created_at=0.0, updated_at=0.0, attempts=0,
            last_error=None,
        )
        admit_request_row(self.requests, row, source="micro_batch")
        return True


def _record(job_type: Any, payload: Any, key: Any, request_id: Any, cid: Any) -> DlqRecord:
    return DlqRecord(
        id=1, dedupe_key="request:1", job_type=job_type, idempotency_key=key,
        request_id=request_id, run_id="r", step="s", payload=payload, run_config={}, tags={},
        error_class="transient", error_type="E", fingerprint="f", last_error=None, trace=None,
        failure_count=1, replay_count=1, first_failed_at=0.0, last_failed_at=0.0,
        correlation_id=cid, status=DlqStatus.REPLAYING, status_changed_at=0.0, created_at=0.0,
        updated_at=0.0,
    )


def _last_rejection_id(db: Database) -> int:
    with db.statement() as conn:
        return int(conn.execute(text("SELECT COALESCE(MAX(id), 0) FROM job_rejections")).scalar())


@pytest.mark.parametrize("way_in", ["enqueue", "cli", "run_config", "dlq_replay", "micro_batch"])
def test_generated_hostile_input_is_accepted_or_refused_with_one_bounded_row(
    db: Database, db_url: str, way_in: str, tmp_path: Path
) -> None:
    """Catches: any input that makes a way in raise something other than ValidationError,
    leave no rejection row (or two), or keep a row that is not small and storable."""
    entry = Entry(db, db_url, tmp_path / "payload.json")
    call: Callable[..., bool | None] = getattr(entry, way_in)
    outcomes = {"accepted": 0, "refused": 0, "operator": 0}
    seen = [_last_rejection_id(db)]  # the highest rejection id so far: one query per example

    @PROFILE
    @given(request=requests_in())
    def example(request: dict[str, Any]) -> None:
        try:
            accepted = call(**request)
            refused: ValidationError | None = None
        except ValidationError as exc:
            accepted, refused = False, exc
        with db.statement() as conn:
            new = [dict(r._mapping) for r in conn.execute(
                text("SELECT * FROM job_rejections WHERE id > :last ORDER BY id"),
                {"last": seen[0]})]
        seen[0] = max([seen[0], *(r["id"] for r in new)])
        if accepted is None:
            assert new == []
            outcomes["operator"] += 1
            return
        if accepted:
            assert new == []
            outcomes["accepted"] += 1
            with db.statement() as conn:  # the next example may send the same key
                conn.execute(text("DELETE FROM job_requests"))
            return
        assert len(new) == 1, new
        _assert_bounded(new[0])
        assert new[0]["payload_size"] is not None and len(new[0]["payload_sha256"]) == 64
        if refused is not None:
            assert new[0]["field"] == storable_field(refused.field)
            assert new[0]["id"] == refused.rejection_id
        outcomes["refused"] += 1

    started = time.perf_counter()
    example()
    print(f"{way_in}: {outcomes} in {time.perf_counter() - started:.1f}s")
    assert outcomes["accepted"] and outcomes["refused"], outcomes


def storable_field(field: str) -> str:
    return field.encode("utf-8", "backslashreplace").decode()[: LIMITS.excerpt_bytes]
