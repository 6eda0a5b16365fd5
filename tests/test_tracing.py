"""Traces: one trace per request, from enqueue to effect, with the seed's fields on its spans.

The traced workload runs in a process of its own (``tests/tracing_workers.py``, the SDK's
in-memory exporter), because turning tracing on instruments SQLAlchemy, Redis and urllib3 for
the whole process. Regressions caught: a run that starts a new trace instead of continuing the
request's, spans that lose their parent across the ledger/lock/DB/provider calls, a duplicate
without a link to the effect, an outbox publication outside the trace that wrote the event, a
provider call without ``traceparent``, and tracing that costs something when it is off.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from resources.telemetry import tracing

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "tracing_workers.py"


def _traced_workload(db_url: str, redis_url: str, namespace: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run(
        [sys.executable, str(WORKER), json.dumps(
            {"db_url": db_url, "redis_url": redis_url, "namespace": namespace})],
        cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _tree(spans: list[dict[str, Any]], trace_id: str) -> dict[str | None, list[dict[str, Any]]]:
    children: dict[str | None, list[dict[str, Any]]] = {}
    for s in spans:
        if s["trace_id"] == trace_id:
            children.setdefault(s["parent_id"], []).append(s)
    return children


def _below(children: dict[str | None, list[dict[str, Any]]], span: dict[str, Any]) -> list[Any]:
    out = []
    for child in children.get(span["span_id"], []):
        out += [child, *_below(children, child)]
    return out


def _one(spans: list[dict[str, Any]], name: str) -> dict[str, Any]:
    found = [s for s in spans if s["name"] == name]
    assert len(found) == 1, (name, [s["name"] for s in spans])
    return found[0]


def test_a_request_is_one_trace_from_enqueue_to_effect(
    db_url: str, redis_url: str, namespace: str, redis_client: Any
) -> None:
    out = _traced_workload(db_url, redis_url, namespace)
    spans, runs = out["spans"], out["run_trace_ids"]
    trace_id = runs["payment"]
    assert trace_id and runs["payment_again"] == trace_id  # the run page's tag, both runs
    children = _tree(spans, trace_id)
    (enqueue,) = children[None]
    assert enqueue["name"] == "sekali.enqueue"
    assert enqueue["attributes"]["sekali.idempotency_key"] == "payment:o-trace"
    first_run, second_run = [s for s in children[enqueue["span_id"]] if s["name"] == "sekali.run"]
    effect = _one(children[first_run["span_id"]], "sekali.execute")
    assert effect["attributes"]["sekali.idempotency_key"] == "payment:o-trace"
    assert effect["attributes"]["sekali.fence"] == 1
    assert effect["attributes"]["sekali.outcome"] == "completed"
    assert effect["attributes"]["sekali.worker"]
    inside = _below(children, effect)
    names = [s["name"] for s in inside]
    assert "ledger.claim" in names and "lock.row" in names
    assert any(s["kind"] == "CLIENT" and s["name"] in ("SELECT", "INSERT", "UPDATE", "BEGIN")
               or s["name"].split()[0] in ("SELECT", "INSERT", "UPDATE") for s in inside)
    charge = _one(inside, "step.gateway_charge")
    http = [s for s in _below(children, charge) if s["kind"] == "CLIENT"]
    assert http and http[0]["name"] == "POST"
    sent = [h["traceparent"] for h in out["provider_headers"] if "traceparent" in h]
    assert sent and all(tp.split("-")[1] == trace_id for tp in sent)
    assert http[0]["span_id"] in {tp.split("-")[2] for tp in sent}
    duplicate_run = _one(children[second_run["span_id"]], "sekali.execute")
    assert duplicate_run["attributes"]["sekali.outcome"] == "duplicate_suppressed"
    link = _one(_below(children, duplicate_run), "sekali.duplicate")
    assert link["links"] == [effect["span_id"]]


def test_outbox_events_are_published_in_the_trace_that_wrote_them(
    db_url: str, redis_url: str, namespace: str, redis_client: Any
) -> None:
    out = _traced_workload(db_url, redis_url, namespace)
    spans = out["spans"]
    trace_id = out["run_trace_ids"]["fulfilment"]
    children = _tree(spans, trace_id)
    (enqueue,) = children[None]
    everything = _below(children, enqueue)
    published = [s for s in spans if s["name"] == "outbox.publish"]
    assert published and all(s["trace_id"] == trace_id for s in published)
    writers = {s["span_id"] for s in everything if s["name"] == "sekali.execute"}
    assert writers
    for span in published:
        assert span["kind"] == "PRODUCER"
        chain, parent = [], span["parent_id"]
        by_id = {s["span_id"]: s for s in everything}
        while parent in by_id:
            chain.append(by_id[parent]["name"])
            parent = by_id[parent]["parent_id"]
        assert "sekali.execute" in chain and chain[-1] == "sekali.run"


def test_a_dead_letter_keeps_its_trace_id(
    db_url: str, redis_url: str, namespace: str, redis_client: Any
) -> None:
    out = _traced_workload(db_url, redis_url, namespace)
    trace_id = out["run_trace_ids"]["dead_letter"]
    assert trace_id and out["dlq_trace_ids"] == [trace_id]


APP_WITH_ITS_OWN_SDK = """
import json, sys
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine.intake import enqueue
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from resources.telemetry import tracing

db = Database.from_url(sys.argv[1])
upgrade(db)  # the engine exists before the application sets its provider up
off = tracing.span("before") is tracing.span("before, too")
exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)
with trace.get_tracer("app").start_as_current_span("POST /orders"):
    request = enqueue("charge_payment", {"order_id": "o-app", "amount_cents": 990,
                                          "currency": "EUR"}, db=db).request
print(json.dumps({
    "off_before": off,
    "traceparent": request.traceparent,
    "spans": [{"name": s.name, "trace_id": format(s.context.trace_id, "032x"),
               "parent": format(s.parent.span_id, "016x") if s.parent else None,
               "span_id": format(s.context.span_id, "016x"), "kind": s.kind.name}
              for s in exporter.get_finished_spans()],
}))
"""


def test_an_application_s_global_provider_gets_sekali_spans(sqlite_url: str) -> None:
    """Catches: spans only after ``use_provider``/``OTEL_*``, when the application set the SDK's
    provider globally the way the OpenTelemetry docs say (sekali as a library in a web app)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run(
        [sys.executable, "-c", APP_WITH_ITS_OWN_SDK, sqlite_url], cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["off_before"]  # no provider yet: the shared no-op, as before
    spans = {s["name"]: s for s in seen["spans"]}
    app, enqueued = spans["POST /orders"], spans["sekali.enqueue"]
    assert enqueued["trace_id"] == app["trace_id"] and enqueued["parent"] == app["span_id"]
    assert seen["traceparent"].split("-")[1] == app["trace_id"]  # stored for the run to continue
    statements = [s for s in seen["spans"] if s["kind"] == "CLIENT"]
    assert statements and all(s["trace_id"] == app["trace_id"] for s in statements)


def test_tracing_off_is_a_shared_no_op() -> None:
    assert not tracing.configure_tracing(env={})
    assert not tracing.configure_tracing(env={"OTEL_TRACES_EXPORTER": "none"})
    assert not tracing.tracing_enabled()
    first = tracing.span("a", key="k")
    assert first is tracing.span("b") and tracing.inject() is None
    with first:
        tracing.set_attributes(key="ignored")


@pytest.mark.parametrize(
    ("traceparent", "expected"),
    [
        ("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
         "0af7651916cd43dd8448eb211c80319c"),
        ("garbage", None),
        (None, None),
    ],
)
def test_trace_id_of(traceparent: str | None, expected: str | None) -> None:
    assert tracing.trace_id_of(traceparent) == expected
    assert (tracing.extract(traceparent) is None) is (expected is None)
