"""What a user sees in the Dagster UI, in a real browser (Debian's chromium driven by
Playwright; never a downloaded browser build).

A real ``dagster-webserver`` and ``dagster-daemon`` run on a private Dagster home, a free port,
a private SQLite app database, the test Redis and the sandbox gateway (the stack of
:mod:`tests.test_e2e`). The first test opens the Launchpad of ``charge_payment``, launches the
default example twice, and checks that the runs list shows one ``effect`` and one ``duplicate``
and that the duplicate links to the run that charged; then, after a permanent failure, that the
``dead_letters`` asset shows its row and its check fails, the failed run names its dead letter
(``sekali/dlq_id``), and a cancelled request's run runs nothing and says who cancelled it.

The second test goes through docs/job-types.md's example as a user would: the guide's module
written to a package outside the tree, ``sekali dev`` started with it (``SEKALI_JOB_MODULES``),
its Launchpad filled and launched, the failed run's page reading one line (no stack trace), and
the dead letter reached from the run's ``sekali/dlq_id`` tag.

The third runs a payment and an email, materialises ``sekali_durations`` with the asset page's
"Materialize" button, and opens its pictures from the page's Metadata table (Dagster 1.13 puts
a markdown value of 1,000 characters or more behind ``[Show Markdown]``, rendered in a dialog):
each is the materialisation's PNG, loaded, with a panel per job type that ran; the leases entry
prints the lease and percentiles behind the lines. No test ever sees Dagster's "Join the
community" dialog.

Screenshots go to ``test-results/ui/`` (gitignored; CI leaves them there).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import sync_playwright

from engine import tags as tag
from engine.intake import enqueue
from engine.requests import CancelState, RequestStore
from pipelines.assets.durations import DURATIONS_ASSET
from resources.dlq import DlqStore
from resources.storage.db import Database
from tests.guide_example import JOB_TYPE as GUIDE_JOB_TYPE
from tests.guide_example import install_example
from tests.test_dev import SEKALI, _ui_answers, descendants, dev_env, free_port, wait_gone
from tests.test_e2e import ROOT, Stack, _location_loaded, _status, stack, wait_for

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


COMMUNITY_DIALOG = "Join the Dagster community"


def _no_community_dialog(page: Any) -> None:
    """Dagster's first-open dialog (shown a second after the page loads, on a localhost UI
    whose instance has not turned it off) never covers the UI."""
    page.wait_for_timeout(2_000)
    assert page.get_by_text(COMMUNITY_DIALOG).count() == 0, "the community dialog is shown"


def _launch_from_launchpad(page: Any, base: str, shot: str) -> None:
    page.goto(f"{base}/locations/sekali/jobs/charge_payment/playground")
    page.get_by_text("o-example-1").first.wait_for(timeout=WAIT_MS)  # the example is there
    _no_community_dialog(page)
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
    assert bad_tags[tag.OUTCOME] == "failed"  # refused for good; a sick downstream: dead_lettered

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


@dataclass
class GuideDev:
    """``sekali dev`` serving the guide's job type from a package outside the tree."""

    process: subprocess.Popen[bytes]
    port: int
    env: dict[str, str]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def sekali(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([SEKALI, *args], env=self.env, capture_output=True, text=True,
                              timeout=120)


@pytest.fixture
def guide_dev(tmp_path: Path) -> Iterator[GuideDev]:
    code = tmp_path / "code"
    module = install_example(code)
    port = free_port()
    env = dev_env(tmp_path / "state", free_port(), free_port())
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in (str(code), env.get("PYTHONPATH", "")) if p),
        SEKALI_JOB_MODULES=module,
        SEKALI_LOYALTY_LEDGER_URL=f"http://127.0.0.1:{free_port()}",
    )
    log = tmp_path / "dev.log"
    with log.open("wb") as out:
        process = subprocess.Popen([SEKALI, "dev", "--port", str(port)], env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    dev = GuideDev(process, port, env, log)
    try:
        ready = f"sekali dev: Dagster UI ready on http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while not (ready in dev.output() and _ui_answers(port)):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"sekali dev did not serve its UI:\n{dev.output()[-4000:]}")
            time.sleep(1)
        yield dev
    finally:
        tree = descendants(process.pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGTERM)
        for pid in wait_gone(tree, 30.0):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.wait(30)


GUIDE_RUNS = """
query Runs($filter: RunsFilter) {
  runsOrError(filter: $filter) {
    ... on Runs { results { runId status tags { key value } } }
  }
}
"""


def _guide_runs(dev: GuideDev) -> list[dict[str, Any]]:
    body = json.dumps({"query": GUIDE_RUNS,
                       "variables": {"filter": {"pipelineName": GUIDE_JOB_TYPE}}}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{dev.port}/graphql", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as answer:  # nosec B310: our own UI
        return list(json.load(answer)["data"]["runsOrError"]["results"])


def test_the_guides_job_type_from_the_launchpad_to_its_dead_letter(
    guide_dev: GuideDev, browser: Any
) -> None:
    """Catches, for a job type a user wrote from the guide: a Launchpad that does not list it
    or opens without its example, Dagster's community dialog over the UI, a refused request
    whose run page shows stack traces under the one line that says what was wrong, and a failed
    run that does not lead to its dead letter."""
    base = f"http://127.0.0.1:{guide_dev.port}"
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(WAIT_MS)

    # 1. The Launchpad of the guide's job type opens on its example.
    page.goto(f"{base}/locations/sekali/jobs/{GUIDE_JOB_TYPE}/playground")
    page.get_by_text("acct-1").first.wait_for(timeout=WAIT_MS)
    _no_community_dialog(page)
    page.screenshot(path=str(SHOTS / "guide-01-launchpad.png"), full_page=True)

    # 2. Fill it with an award above the model's maximum, and launch it.
    editor = page.locator(".CodeMirror").first
    editor.click()
    page.keyboard.press("Control+A")
    page.keyboard.press("Delete")
    page.keyboard.insert_text(
        "ops:\n  award_loyalty_points_op:\n    config:\n      payload:\n"
        "        account_id: acct-browser\n        points: 500000\n        reason: signup\n")
    page.get_by_text("acct-browser").first.wait_for(timeout=WAIT_MS)
    page.screenshot(path=str(SHOTS / "guide-02-launchpad-filled.png"), full_page=True)
    page.get_by_role("button", name=re.compile("Launch Run")).click(timeout=WAIT_MS)
    page.wait_for_url(re.compile(r".*/runs/[0-9a-f-]{36}.*"), timeout=WAIT_MS)
    run_id = re.findall(r"/runs/([0-9a-f-]{36})", page.url)[0]

    def failed() -> dict[str, str] | None:
        for run in _guide_runs(guide_dev):
            if run["runId"] == run_id and run["status"] == "FAILURE":
                return {t["key"]: t["value"] for t in run["tags"]}
        return None

    tags = wait_for("the launched run to fail", failed, 180, guide_dev.log.parent)

    # 3. Its page says what was wrong in one line: the class and the reason, no stack trace.
    page.goto(f"{base}/runs/{run_id}")
    line = page.get_by_text(re.compile(r"permanent: ValidationError: points: ")).first
    line.wait_for(timeout=WAIT_MS)
    page.screenshot(path=str(SHOTS / "guide-03-failed-run.png"), full_page=True)
    assert page.get_by_text("Stack Trace").count() == 0
    assert page.get_by_text("The above exception was caused by").count() == 0

    # 4. The run names its dead letter; that record is the request refused, with its key.
    dlq_id = tags[tag.DLQ_ID]
    _see_run_tag(page, base, run_id, rf"{re.escape(tag.DLQ_ID)}\W+{dlq_id}\b")
    page.screenshot(path=str(SHOTS / "guide-04-run-tags.png"), full_page=True)
    shown = guide_dev.sekali("dlq", "show", dlq_id, "--json")
    assert shown.returncode == 0, shown.stderr
    record = json.loads(shown.stdout)
    assert record["run_id"] == run_id
    assert record["job_type"] == GUIDE_JOB_TYPE
    assert record["idempotency_key"] == "loyalty:acct-browser:signup"
    said = guide_dev.sekali("dlq", "show", dlq_id)
    assert said.returncode == 0, said.stderr
    first = said.stdout.splitlines()[0]
    assert f"dead letter {dlq_id} (open): permanent: " in first and "points" in first, first
    assert "Traceback" not in said.stdout


DURATIONS = """
{ assetOrError(assetKey: {path: ["sekali_durations"]}) {
    ... on Asset { assetMaterializations(limit: 1) { runId metadataEntries { label
      ... on MarkdownMetadataEntry { mdStr }
      ... on JsonMetadataEntry { jsonString } } } } } }
"""
PANEL_PX = (720, 216)  # one panel of the asset's figures: 8 x 2.4 inches at 90 dpi


def _durations(stack: Stack, run: str) -> dict[str, str] | None:
    """The materialisation of ``sekali_durations`` by the run whose id starts with ``run``:
    label -> markdown or JSON text."""
    found = stack.graphql(DURATIONS, {})["assetOrError"].get("assetMaterializations") or []
    if not found or not found[0]["runId"].startswith(run):
        return None
    return {e["label"]: e.get("mdStr") or e.get("jsonString") or ""
            for e in found[0]["metadataEntries"]}


def _picture(markdown: str) -> tuple[str, tuple[int, int]]:
    """The ``data:`` URL of the PNG in a markdown image, and the width and height its header
    (IHDR) gives."""
    found = re.fullmatch(r"!\[[^\]]*\]\((data:image/png;base64,([A-Za-z0-9+/=]+))\)", markdown)
    assert found, markdown[:80]
    head = base64.b64decode(found.group(2))[:24]
    assert head.startswith(b"\x89PNG\r\n\x1a\n"), head
    return found.group(1), (int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big"))


def _open_metadata(page: Any, label: str, action: str) -> Any:
    """Dagster 1.13 shows a markdown (or JSON) value of 1,000 characters or more as a link
    (``[Show Markdown]``) in the asset's Metadata table; the value is rendered in a dialog
    titled with the entry's label. Open it and return the dialog."""
    row = page.locator("tr").filter(has=page.get_by_text(label, exact=True))
    row.get_by_text(action).first.click(timeout=WAIT_MS)
    dialog = page.get_by_role("dialog").filter(has_text=label)
    dialog.wait_for(timeout=WAIT_MS)
    return dialog


def _close(page: Any, dialog: Any) -> None:
    dialog.get_by_role("button", name="Close").click(timeout=WAIT_MS)
    dialog.wait_for(state="detached", timeout=WAIT_MS)


def test_the_durations_picture_of_real_attempts_shows_on_the_asset_page(
    stack: Stack, browser: Any
) -> None:
    """Catches a ``sekali_durations`` picture that a user does not see on the asset's page:
    an image the UI's markdown drops or sanitises away (a ``data:`` URL rewritten or stripped),
    one that does not decode (a broken image has no natural width), one that is not the
    materialisation's picture or not drawn from the attempts recorded (a panel per job type
    that ran), and lease and percentile numbers the page does not show."""
    wait_for("the webserver and code location", lambda: _location_loaded(stack), 240, stack.logs)
    base = f"http://127.0.0.1:{stack.port}"
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(WAIT_MS)

    # 1. Attempts of two job types, recorded by the platform as it runs them.
    client = stack.client()
    ran = [
        client.submit_job_execution("charge_payment", run_config={"ops": {"charge_payment_op": {
            "config": {"payload": {"order_id": "o-picture", "amount_cents": 900,
                                   "currency": "EUR"}}}}}),
        client.submit_job_execution("send_email", run_config={"ops": {"send_email_op": {
            "config": {"payload": {"template": "welcome", "user_id": "picture-1",
                                   "date": "2026-11-29", "to": "p1@example.com"}}}}}),
    ]
    for run_id in ran:
        wait_for(f"run {run_id} to succeed", lambda r=run_id: _status(stack, r), 240, stack.logs)

    # 2. Materialise the asset from its page, as a user would: the toast names the run.
    page.goto(f"{base}/assets/{DURATIONS_ASSET}")
    materialize = page.get_by_role("button", name=re.compile(r"\bMaterialize$")).first
    materialize.wait_for(timeout=WAIT_MS)
    _no_community_dialog(page)
    materialize.click(timeout=WAIT_MS)
    toast = page.get_by_text(re.compile(r"Launched run [0-9a-f]{8}")).first
    toast.wait_for(timeout=WAIT_MS)
    launched = toast.inner_text().split()[-1]
    page.screenshot(path=str(SHOTS / "09-durations-launched.png"), full_page=True)
    stored = wait_for("the asset's materialisation", lambda: _durations(stack, launched), 240,
                      stack.logs)
    assert {"durations", "arrivals_vs_capacity", "leases"} <= set(stored), sorted(stored)
    leases = json.loads(stored["leases"])
    ran_types = [jt for jt, row in leases.items() if row["samples"]]
    assert {"charge_payment", "send_email"} <= set(ran_types), leases

    # 3. Its page: each picture opens from the Metadata table and is an image that loaded.
    page.goto(f"{base}/assets/{DURATIONS_ASSET}")
    sizes: dict[str, tuple[int, int]] = {}
    for label, shot in (("durations", "10-durations.png"),
                        ("arrivals_vs_capacity", "11-arrivals-vs-capacity.png")):
        dialog = _open_metadata(page, label, "[Show Markdown]")
        image = dialog.locator(".dagster-markdown img").first
        image.wait_for(timeout=WAIT_MS)
        page.wait_for_function("img => img.complete", arg=image.element_handle(),
                               timeout=WAIT_MS)
        shown = image.evaluate(
            "img => ({src: img.getAttribute('src'), width: img.naturalWidth,"
            " height: img.naturalHeight, seen: img.getBoundingClientRect().width})")
        dialog.screenshot(path=str(SHOTS / shot))
        url, size = _picture(stored[label])
        assert shown["src"] == url, f"{label}: not the materialisation's ({shown['src'][:40]})"
        assert (shown["width"], shown["height"]) == size and shown["seen"] > 0, (label, shown)
        _close(page, dialog)
        sizes[label] = size
    # a panel per job type that ran (720 x 216 px each); a queue's panel is as wide
    assert sizes["durations"] == (PANEL_PX[0], PANEL_PX[1] * len(ran_types)), (sizes, ran_types)
    assert sizes["arrivals_vs_capacity"][0] == PANEL_PX[0], sizes

    # 4. The numbers behind the lines: the leases entry, as the page prints it.
    dialog = _open_metadata(page, "leases", "[Show JSON]")
    text = dialog.inner_text()
    printed = json.loads(text[text.index("{"):text.rindex("}") + 1])
    page.screenshot(path=str(SHOTS / "12-leases.png"))
    assert printed == leases
    for jt in ("charge_payment", "send_email"):
        row = printed[jt]
        assert row["samples"] >= 1 and row["p99"] > 0 and row["p999"] >= row["p99"], row
        assert row["lease_seconds"] > 0 and row["lease_why"], row
