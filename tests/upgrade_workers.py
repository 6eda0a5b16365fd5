"""Producers, workers and CLI calls of the rolling-upgrade test, runnable on either release.

Run as ``python tests/upgrade_workers.py ROLE CONFIG_JSON`` with ``PYTHONPATH`` pointing at the
release to run (this checkout, or the previous release extracted from ``tests/releases``). It
uses only what both releases have (``enqueue``, ``RequestStore``, ``execute_request``,
``Services.from_settings``), and before it exits it checks that every sekali module it loaded
came from that release (``SEKALI_RELEASE_ROOT``), so an old process never runs new code.

- ``produce``: enqueue ``count`` requests one by one (``kind`` payment or report; every
  ``bad_every``-th payment has an invalid amount), one JSON line per enqueue on ``out``:
  ``accepted`` (key, id), ``rejected`` (field, rejection id), or ``error``: anything else, which
  the test counts as lost.
- ``work``: claim pending requests, and take again those left ``running`` longer than
  ``stale`` seconds (a killed worker's: the run retry a deployment's orchestrator makes),
  run each through ``execute_request``, mark it completed; a transient error leaves it for a
  later try. Ends when ``stop_file`` exists.
- ``cli``: ``sekali`` with the given arguments (the release's own command line).
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import text

_OURS = ("pipelines", "engine", "cli", "resources", "sensors", "sql", "sandbox", "proof",
         "benchmarks")


def _engine_layout() -> bool:
    """Whether the release this process runs has the platform in ``engine/`` (this one) or still
    in ``pipelines/`` (the previous one): decided from the release's own tree, never by trying an
    import, which the editable install of this checkout could answer with new code."""
    root = Path(os.environ.get("SEKALI_RELEASE_ROOT") or Path(__file__).resolve().parents[1])
    return (root / "engine").is_dir()


def _line(out: Path, **fields: Any) -> None:
    with out.open("a") as f:
        f.write(json.dumps({"pid": os.getpid(), "at": time.time(), **fields}) + "\n")


def produce(config: dict[str, Any]) -> None:
    from pipelines.intake import enqueue
    from resources.errors import ValidationError
    from resources.storage.db import Database

    db = Database.from_url(config["db_url"])
    out = Path(config["out"])
    for i in range(int(config["count"])):
        bad = bool(config.get("bad_every")) and i % int(config["bad_every"]) == 0
        if config["kind"] == "report":
            job_type = "rebuild_report_cache"
            payload: dict[str, Any] = {"report": "stock_levels",
                                       "as_of": f"{config['prefix']}-{i}"}
        else:
            job_type = "charge_payment"
            payload = {"order_id": f"{config['prefix']}-{i}",
                       "amount_cents": "lots" if bad else 100 + i, "currency": "EUR"}
        try:
            made = enqueue(job_type, payload, db=db)
            _line(out, i=i, outcome="accepted", job_type=job_type, key=made.key, id=made.id,
                  created=made.created)
        except ValidationError as exc:
            _line(out, i=i, outcome="rejected", job_type=job_type, payload=payload,
                  field=exc.field, rejection_id=getattr(exc, "rejection_id", None))
        except Exception as exc:  # noqa: BLE001 - anything else is the lost request we count
            _line(out, i=i, outcome="error", job_type=job_type, payload=payload,
                  error=f"{type(exc).__name__}: {exc}")
        time.sleep(float(config.get("pace", 0.05)))
    db.dispose()


def work(config: dict[str, Any]) -> None:
    if _engine_layout():
        from engine.requests import RequestStore
    else:
        from pipelines.requests import RequestStore  # type: ignore[no-redef]
    from pipelines.runtime import execute_request
    from pipelines.services import Services
    from resources.retry import classify

    services = Services.from_settings(
        lease_seconds=float(config["lease"]), budget_namespace=config["namespace"],
        cache_namespace=config["namespace"],
    )
    store = RequestStore(services.db)
    out, stop = Path(config["out"]), Path(config["stop_file"])
    stale = float(config["stale"])
    run_id = f"{config['release']}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    _line(out, t="ready", release=config["release"])
    while not stop.exists():
        todo = store.claim_for_launch(5, relaunch_after=stale)
        with services.db.statement() as conn:
            stuck = [int(r.id) for r in conn.execute(
                text("SELECT id FROM job_requests WHERE status = 'running'"
                     " AND updated_at < :t ORDER BY id LIMIT 5"),
                {"t": time.time() - stale},
            )]
        todo += store.get_many(stuck)
        if not todo:
            time.sleep(0.2)
            continue
        for request in todo:
            if not store.mark_running(request.id, run_id=run_id):
                continue
            _line(out, t="start", key=request.key, release=config["release"])
            try:
                outcome = execute_request(
                    request.job_type, request.payload, services=services, key=request.key,
                    run_id=run_id, request_id=request.id,
                    correlation_id=request.correlation_id,
                )
            except Exception as exc:  # noqa: BLE001 - classified below, as the failure path does
                kind = classify(exc)
                _line(out, t="error", key=request.key, kind=str(kind),
                      error=f"{type(exc).__name__}: {exc}", release=config["release"])
                if str(kind) == "permanent":
                    store.mark_failed(request.id, str(exc), error_class="permanent",
                                      run_id=run_id)
                continue
            store.mark_completed(request.id, run_id=run_id)
            _line(out, t="done", key=request.key, status=outcome.status, fence=outcome.fence,
                  release=config["release"])


def cli(argv: list[str]) -> int:
    if _engine_layout():
        from cli.main import main
    else:
        from pipelines.cli import main  # type: ignore[no-redef]

    return int(main(argv) or 0)


def _check_release() -> None:
    """Every sekali module loaded comes from the release this process was started for."""
    root = os.environ.get("SEKALI_RELEASE_ROOT")
    if not root:
        return
    foreign = sorted(
        name for name, module in list(sys.modules.items())
        if name.split(".")[0] in _OURS and getattr(module, "__file__", None)
        and not str(Path(module.__file__ or "").resolve()).startswith(str(Path(root).resolve()))
    )
    if foreign:
        print(f"upgrade_workers: modules from another release: {foreign[:5]}", file=sys.stderr)
        sys.exit(3)


if __name__ == "__main__":
    role = sys.argv[1]
    if role == "cli":
        code = cli(sys.argv[2:])
        _check_release()
        sys.exit(code)
    settings = json.loads(sys.argv[2])
    {"produce": produce, "work": work}[role](settings)
    _check_release()
