"""``python tests/tracing_workers.py JSON``: one traced workload in a process of its own.

Tracing installs global instrumentation (SQLAlchemy, Redis, urllib3) that would follow every
later test, so the traced workload runs here, with the SDK's in-memory exporter, and prints the
finished spans as JSON lines for the test to check: a payment enqueued, launched the way the
intake sensor launches it, run twice (the second a duplicate); a fulfilment whose outbox events
are then published; the provider's received ``traceparent`` headers.
"""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import dagster as dg
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine.intake import enqueue
from pipelines import ops
from pipelines.domain.consumers import default_consumers
from pipelines.domain.inventory import Inventory
from resources.dlq import DlqStore
from resources.outbox import InAppPublisher, Inbox, OutboxPublisher
from resources.storage.db import Database
from resources.storage.migrations import upgrade
from resources.telemetry.tracing import use_provider
from sensors.dlq import dead_letter_run
from sensors.intake import IntakeMode, _tags, per_request_run_config
from tests.job_workers import dagster_resources

HEADERS: list[dict[str, str]] = []


class _Gateway(BaseHTTPRequestHandler):
    """A provider that records the headers it receives and charges everything."""

    def log_message(self, format: str, *args: Any) -> None:
        return None

    def do_POST(self) -> None:  # noqa: N802 - http.server naming
        HEADERS.append({k.lower(): v for k, v in self.headers.items()})
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        answer = json.dumps(
            {"charge_id": f"ch_{body['reference']}", "idempotency_key": None,
             "created_at": 0.0, **body}
        ).encode()
        self.send_response(201)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def do_GET(self) -> None:  # noqa: N802 - a lookup by reference finds nothing charged yet
        HEADERS.append({k.lower(): v for k, v in self.headers.items()})
        answer = json.dumps({"charges": []}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)


def _span_json(span: Any) -> dict[str, Any]:
    ctx = span.get_span_context()
    return {
        "name": span.name,
        "trace_id": format(ctx.trace_id, "032x"),
        "span_id": format(ctx.span_id, "016x"),
        "parent_id": format(span.parent.span_id, "016x") if span.parent else None,
        "kind": span.kind.name,
        "attributes": dict(span.attributes or {}),
        "links": [format(link.context.span_id, "016x") for link in span.links],
    }


def main() -> None:
    spec = json.loads(sys.argv[1])
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    use_provider(provider)

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    db = Database.from_url(spec["db_url"])
    upgrade(db)
    Inventory(db).set_stock("box", 5)
    resources = dagster_resources(
        db_url=spec["db_url"], redis_url=spec["redis_url"], namespace=spec["namespace"],
        gateway_url=f"http://127.0.0.1:{server.server_address[1]}",
    )
    instance = dg.DagsterInstance.ephemeral()
    runs: dict[str, str] = {}
    for name, job, job_type, payload in (
        ("payment", ops.charge_payment_job, "charge_payment",
         {"order_id": "o-trace", "amount_cents": 990}),
        ("fulfilment", ops.fulfill_order_job, "fulfill_order",
         {"order_id": "o-ship", "items": [{"sku": "box", "quantity": 2}]}),
    ):
        request = enqueue(job_type, payload, db=db).request
        for attempt in ("", "_again") if name == "payment" else ("",):
            result = job.execute_in_process(
                run_config=per_request_run_config(request),
                tags=_tags(IntakeMode.PER_REQUEST, [request]),
                resources=resources,
                instance=instance,
            )
            assert result.success
            run = instance.get_run_by_id(result.run_id)
            assert run is not None
            runs[name + attempt] = run.tags.get("sekali/trace_id", "")
    publisher = OutboxPublisher(db, InAppPublisher(Inbox(db), default_consumers(None)))
    publisher.publish_pending()
    poison = enqueue(
        "fulfill_order", {"order_id": "o-bad", "items": [{"sku": "nope", "quantity": 1}]}, db=db
    ).request
    failed = ops.fulfill_order_job.execute_in_process(
        run_config=per_request_run_config(poison),
        tags=_tags(IntakeMode.PER_REQUEST, [poison]),
        resources=resources,
        instance=instance,
        raise_on_error=False,
    )
    failed_run = instance.get_run_by_id(failed.run_id)
    assert failed_run is not None and not failed.success
    recorded = dead_letter_run(instance, failed_run, DlqStore(db), actor="tracing-test")
    runs["dead_letter"] = failed_run.tags.get("sekali/trace_id", "")
    dlq_trace_ids = [r.record.trace_id for r in recorded]
    server.shutdown()
    print(json.dumps({
        "spans": [_span_json(s) for s in exporter.get_finished_spans()],
        "run_trace_ids": runs,
        "provider_headers": HEADERS,
        "dlq_trace_ids": dlq_trace_ids,
    }))


if __name__ == "__main__":
    main()
