"""What a user sees in the Dagster UI, in a real browser (Debian's chromium driven by
Playwright; never a downloaded browser build).

A real ``dagster-webserver`` and ``dagster-daemon`` run on a private Dagster home, a free port,
a private SQLite app database, the test Redis and the sandbox gateway (the stack of
:mod:`tests.test_e2e`). The test opens the Launchpad of ``charge_payment``, launches the default
example twice, and checks that the runs list shows one ``effect`` and one ``duplicate`` and that
the duplicate links to the run that charged; then, after a permanent failure, that the
``dead_letters`` asset shows its row and its check fails, the failed run names its dead letter
(``sekali/dlq_id``), and a cancelled request's run runs nothing and says who cancelled it.
Screenshots go to
``test-results/ui/`` (gitignored; CI leaves them there).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from playwright.sync_api import sync_playwright

from engine import tags as tag
from engine.intake import enqueue
from engine.requests import CancelState, RequestStore
from resources.dlq import DlqStore
from resources.storage.db import Database
from tests.test_e2e import ROOT, Stack, _location_loaded, stack, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.dagster, pytest.mark.timeout(600)]

CHROMIUM = Path(os.environ.get("SEKALI_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
SHOTS = ROOT / "test-results" / "ui"
WAIT_MS = 60_000

__all__ = ["stack"]  # the fixture, shared with the GraphQL end-to-end test

RUNS = """
query Runs($filter: RunsFilter) {
  runsOrError(filter: $filter) {
    ... on Runs { results { runId status tags { key value } } }
  }
}
"""
SENSOR_TICKS = """
query Ticks($selector: SensorSelector!) {
  sensorOrError(sensorSelector: $selector) {
    ... on Sensor { sensorState { ticks(limit: 1) { status } } }
  }
}
"""
DEAD_LETTERS = """
{ assetOrError(assetKey: {path: ["dead_letters"]}) {
    ... on Asset { assetMaterializations(limit: 1) { metadataEntries { label } } } } }
"""


@pytest.fixture
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (.ci/run does)")
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


def _runs(stack: Stack, **tags: str) -> list[dict[str, Any]]:
    filter_: dict[str, Any] = {"pipelineName": "charge_payment"}
    if tags:
        filter_["tags"] = [{"key": k, "value": v} for k, v in tags.items()]
    data = stack.graphql(RUNS, {"filter": filter_})
    return list(data["runsOrError"]["results"])


def _finished(stack: Stack, count: int) -> list[dict[str, Any]] | None:
    runs = _runs(stack)
    if len(runs) < count:
        return None
    if any(r["status"] in ("FAILURE", "CANCELED") for r in runs):
        raise AssertionError(f"a run failed: {runs}")
    done = [r for r in runs if r["status"] == "SUCCESS"]
    tagged = [r for r in done if any(t["key"] == tag.OUTCOME for t in r["tags"])]
    return tagged if len(tagged) >= count else None


def _sensor_ticked(stack: Stack, name: str) -> bool:
    selector = {
        "repositoryName": "__repository__",
        "repositoryLocationName": "sekali",
        "sensorName": name,
    }
    data = stack.graphql(SENSOR_TICKS, {"selector": selector})
    state = data["sensorOrError"].get("sensorState") or {}
    return bool(state.get("ticks"))


def _dismiss_welcome(page: Any) -> None:
    """A fresh browser profile gets Dagster's "Join the community" dialog once: skip it."""
    with contextlib.suppress(PlaywrightTimeout):
        page.get_by_role("button", name="Skip").click(timeout=10_000)


def _launch_from_launchpad(page: Any, base: str, shot: str) -> None:
    page.goto(f"{base}/locations/sekali/jobs/charge_payment/playground")
    page.get_by_text("o-example-1").first.wait_for(timeout=WAIT_MS)  # the example is there
    _dismiss_welcome(page)
    page.screenshot(path=str(SHOTS / shot), full_page=True)
    page.get_by_role("button", name=re.compile("Launch Run")).click(timeout=WAIT_MS)
    page.wait_for_url(re.compile(r".*/runs/[0-9a-f-]{36}.*"), timeout=WAIT_MS)


def _see_run_tag(page: Any, base: str, run_id: str, pattern: str) -> None:
    """A run's page lists its tags only in the "View tags and config" dialog (Dagster 1.13):
    open it and wait for ``pattern`` (``key: value``) there."""
    page.goto(f"{base}/runs/{run_id}")
    page.get_by_role("button", name=re.compile("View tags and config")).click(timeout=WAIT_MS)
    page.get_by_text(re.compile(pattern)).first.wait_for(timeout=WAIT_MS)


def test_launch_twice_from_the_launchpad_then_see_outcomes_and_the_dlq(
    stack: Stack, browser: Any
) -> None:
    """Catches: a Launchpad that opens on a config error, a duplicate that looks like the run
    that charged (no outcome, no link to it), and a DLQ that the UI does not show."""
    wait_for("the webserver and code location", lambda: _location_loaded(stack), 240, stack.logs)
    base = f"http://127.0.0.1:{stack.port}"
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(WAIT_MS)

    # 1. The Launchpad opens on the example; launch it, then launch the same again.
    _launch_from_launchpad(page, base, "01-launchpad.png")
    wait_for("the first run", lambda: _finished(stack, 1), 240, stack.logs)
    _launch_from_launchpad(page, base, "02-launchpad-again.png")
    runs = wait_for("both runs", lambda: _finished(stack, 2), 240, stack.logs)
    outcome = {
        r["runId"]: {t["key"]: t["value"] for t in r["tags"]} for r in runs
    }
    (effect,) = [i for i, t in outcome.items() if t[tag.OUTCOME] == "effect"]
    (duplicate,) = [i for i, t in outcome.items() if t[tag.OUTCOME] == "duplicate"]
    assert outcome[duplicate][tag.ORIGINAL_RUN] == effect
    assert len(stack.gateway.charges()) == 1

    # 2. The runs list, filtered by outcome as a user would (the tag filter in the URL): the
    # effect alone, then the duplicate alone, whose row names the effect's run.
    page.goto(f"{base}/runs?q%5B%5D=tag%3A{tag.OUTCOME}%3Deffect")
    page.get_by_text(effect[:8]).first.wait_for(timeout=WAIT_MS)
    assert page.get_by_text(duplicate[:8]).count() == 0
    page.screenshot(path=str(SHOTS / "03-runs-effect.png"), full_page=True)
    page.goto(f"{base}/runs?q%5B%5D=tag%3A{tag.OUTCOME}%3Dduplicate")
    page.get_by_text(duplicate[:8]).first.wait_for(timeout=WAIT_MS)
    page.screenshot(path=str(SHOTS / "03-runs-duplicate.png"), full_page=True)
    assert page.get_by_text(f"{tag.ORIGINAL_RUN}").count() >= 1

    # 3. The duplicate's page says which run charged, and links to it.
    page.goto(f"{base}/runs/{duplicate}")
    link = page.locator(f'a[href$="/runs/{effect}"]').first
    link.wait_for(timeout=WAIT_MS)
    page.screenshot(path=str(SHOTS / "04-duplicate-run.png"), full_page=True)
    page.goto(base + link.get_attribute("href"))  # the link opens a new tab: follow it here
    page.get_by_text("effect").first.wait_for(timeout=WAIT_MS)

    # 4. A permanent failure lands in dead_letters, shown as a row; its check fails.
    wait_for("the DLQ sensor's first tick", lambda: _sensor_ticked(stack, "dlq_sensor"), 120,
             stack.logs)
    bad = stack.client().submit_job_execution(
        "charge_payment",
        run_config={"ops": {"charge_payment_op": {"config": {"payload": {
            "order_id": "o-browser-bad", "amount_cents": 500, "currency": "EURO"}}}}},
    )
    wait_for(
        "dead_letters to be published",
        lambda: stack.graphql(DEAD_LETTERS, {})["assetOrError"].get("assetMaterializations"),
        180,
        stack.logs,
    )
    page.goto(f"{base}/assets/dead_letters")
    page.get_by_text("currency: must be").first.wait_for(timeout=WAIT_MS)
    page.screenshot(path=str(SHOTS / "05-dead-letters.png"), full_page=True)
    assert page.get_by_text("permanent").count() >= 1
    page.goto(f"{base}/assets/dead_letters?view=checks")
    page.get_by_text("no_permanent_dead_letters").first.wait_for(timeout=WAIT_MS)
    page.screenshot(path=str(SHOTS / "06-dead-letters-check.png"), full_page=True)
    bad_tags = {t["key"]: t["value"] for r in _runs(stack) if r["runId"] == bad for t in r["tags"]}
    assert bad_tags[tag.OUTCOME] == "dead_lettered"

    # 5. The failed run points at its dead letter, and the record names the run back.
    dlq_id = bad_tags[tag.DLQ_ID]
    app = Database.from_url(stack.app_url)
    try:
        record = DlqStore(app).get(int(dlq_id))
        assert record.run_id == bad
        _see_run_tag(page, base, bad, rf"{re.escape(tag.DLQ_ID)}\W+{dlq_id}\b")
        page.screenshot(path=str(SHOTS / "07-dead-lettered-run.png"), full_page=True)

        # 6. A request cancelled before it ran: launched again by hand, its run runs nothing
        # and says so (outcome, who cancelled); the runs list finds it by that tag.
        cancel_me = {"order_id": "o-browser-cancel", "amount_cents": 700, "currency": "EUR"}
        waiting = enqueue("charge_payment", cancel_me, db=app).request
        decided = RequestStore(app).cancel(waiting.id, by="browser-test", reason="by mistake")
        assert decided.state is CancelState.CANCELLED
        again = stack.client().submit_job_execution(
            "charge_payment",
            run_config={"ops": {"charge_payment_op": {"config": {"payload": cancel_me}}}},
        )
        wait_for("the cancelled run", lambda: any(
            r["runId"] == again and r["status"] == "SUCCESS"
            for r in _runs(stack, **{tag.OUTCOME: "cancelled"})), 240, stack.logs)
    finally:
        app.dispose()
    page.goto(f"{base}/runs?q%5B%5D=tag%3A{tag.OUTCOME}%3Dcancelled")
    page.get_by_text(again[:8]).first.wait_for(timeout=WAIT_MS)
    _see_run_tag(page, base, again, rf"{re.escape(tag.CANCELLED_BY)}\W+browser-test")
    page.screenshot(path=str(SHOTS / "08-cancelled-run.png"), full_page=True)
    assert len(stack.gateway.charges()) == 1  # nothing charged for the cancelled order
