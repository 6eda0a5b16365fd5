"""A signing secret per endpoint, rotation, the lookup's own message type, and endpoint ids that
stay in their path segment, against the sandbox receiver over real HTTP (loopback only)."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from engine.downstreams import ClientOptions
from engine.runtime import execute_request
from pipelines.jobs.webhook import (
    WEBHOOKS,
    WebhookClient,
    body_of,
    folder_key,
    signing_key,
    webhook_id_for,
)
from resources.errors import ValidationError
from resources.http import BoundedHttp, HttpAnswer
from resources.signatures import SigningKeyInvalid, secret_bytes, signed_headers, verify
from resources.storage.db import Database
from resources.storage.settings import Settings
from resources.webhook_secrets import WebhookSecrets
from sandbox.webhooks import WebhookReceiver
from tests.test_webhook import KEY, SECRET, services_for


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def _post(url: str, headers: dict[str, str], body: bytes) -> int:
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:  # nosec B310: our loopback receiver
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _event(endpoint: str, event: str = "evt-1") -> dict[str, Any]:
    return {"endpoint_id": endpoint, "url": "", "event_id": event, "event_type": "order.paid",
            "data": {"order_id": "o-1"}}


def test_a_signature_made_for_one_endpoint_does_not_verify_for_another(db: Database) -> None:
    """Regression caught: one key signed for every endpoint, so customer A, who verifies with
    the secret they were given, could forge a webhook that customer B's endpoint accepted.
    Each endpoint now has its own secret: A's secret verifies A's messages only."""
    secrets = WebhookSecrets(db, lambda: KEY)
    given_to_a = secrets.listing("ep-a", reveal=True)[0]["secret"]
    with WebhookReceiver(secrets.signing_keys) as receiver:
        body = b'{"data":{"refund":true},"id":"evt-forged","type":"order.refunded"}'
        forged = signed_headers(secret_bytes(given_to_a), "msg_forged", body, time.time())
        assert _post(receiver.endpoint("ep-b"), forged, body) == 401
        assert _post(receiver.endpoint("ep-a"), forged, body) == 200
        assert receiver.deliveries("msg_forged", "/hooks/ep-b") == 0
    assert secrets.signing_keys("ep-a") != secrets.signing_keys("ep-b")


def test_rotation_keeps_deliveries_verifiable_through_the_overlap(db: Database) -> None:
    """During a rotation's overlap every message carries a signature per active secret, so a
    customer still verifying with the old secret and one already on the new both accept; after
    the overlap only the new secret signs."""
    clock = Clock()
    secrets = WebhookSecrets(db, lambda: KEY, clock=clock)
    old = secret_bytes(secrets.listing("ep-1", reveal=True)[0]["secret"])
    new = secret_bytes(secrets.rotate("ep-1", overlap=3600, actor="test").secret)
    body = body_of(_event("ep-1"))
    during = signed_headers(secrets.signing_keys("ep-1"), "msg_1", body, clock.now)
    assert len(during["webhook-signature"].split()) == 2
    for key in (old, new):
        assert verify(key, during, body, clock.now) == "msg_1"
    clock.now += 3601
    after = signed_headers(secrets.signing_keys("ep-1"), "msg_2", body, clock.now)
    assert verify(new, after, body, clock.now) == "msg_2"
    with pytest.raises(Exception, match="no v1 signature"):
        verify(old, after, body, clock.now)
    states = [r["state"] for r in secrets.listing("ep-1")]
    assert states == ["active", "expired"]


def test_a_lookups_headers_replayed_as_a_delivery_are_refused(db: Database) -> None:
    """Regression caught: the lookup GET was signed like a delivery over an empty body, so its
    headers replayed as an empty POST were accepted as the delivery (and the real one then
    dropped as a duplicate). A lookup is signed with its own key over its target: the replay
    gets 401 and nothing is delivered; the lookup itself still answers."""
    sent: list[dict[str, str]] = []

    class Recording(BoundedHttp):
        def request(self, method: str, url: str, **kwargs: Any) -> HttpAnswer:
            sent.append(dict(kwargs.get("headers") or {}))
            return super().request(method, url, **kwargs)

    secrets = WebhookSecrets(db, lambda: KEY)
    with WebhookReceiver(secrets.signing_keys) as receiver:
        client = WebhookClient(Recording(timeout=2, deadline=4), secrets.signing_keys)
        webhook_id = webhook_id_for("webhook:ep-1:evt-1")
        url = receiver.endpoint("ep-1")
        assert client.deliveries(url, webhook_id, endpoint_id="ep-1") == []
        replayed = {k: v for k, v in sent[-1].items() if k.startswith("webhook-")}
        assert _post(url, {**replayed, "Content-Type": "application/json"}, b"") == 401
        assert receiver.deliveries(webhook_id) == 0
        assert client.deliver(url, webhook_id, body_of(_event("ep-1")), endpoint_id="ep-1") == 200
        assert receiver.deliveries(webhook_id) == 1


@pytest.mark.parametrize("endpoint", ["../_admin/reset", "x?admin=1", "a/b", "ep 1", "%2e%2e",
                                      ".hidden", "é"])
def test_an_endpoint_id_cannot_walk_out_of_its_path(
    db: Database, db_url: str, redis_url: str, namespace: str, redis_client: Any,
    endpoint: str,
) -> None:
    """Regression caught: ``endpoint_id`` went into the relay URL unencoded, so
    ``../_admin/reset`` reached the relay as ``/_admin/reset`` and ``x?admin=1`` passed a
    query. An id outside the safe alphabet is refused naming the field, nothing sent; and the
    URL is built percent-encoded anyway."""
    services = services_for(db_url, redis_url, namespace)
    with pytest.raises(ValidationError) as refused:
        execute_request("deliver_webhook", _event(endpoint), services=services)
    assert refused.value.field == "endpoint_id"
    built = WebhookClient(BoundedHttp(), lambda ep: [KEY], base_url="http://relay.test")
    url = built.endpoint_url({"endpoint_id": endpoint})
    assert url.startswith("http://relay.test/hooks/") and "/" not in url[len(
        "http://relay.test/hooks/"):] and "?" not in url


def test_an_unsafe_signing_key_file_is_refused(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression caught: an existing ``signing.key`` was read whatever its owner and mode. A
    key another user may read is refused naming the file; so is one named by
    ``SEKALI_WEBHOOKS_SIGNING_KEY_FILE``; 0600 is read."""
    folder = tmp_path / "webhooks"
    made = folder_key(folder)
    assert (folder / "signing.key").stat().st_mode & 0o777 == 0o600
    os.chmod(folder / "signing.key", 0o644)
    with pytest.raises(SigningKeyInvalid, match="mode 644"):
        folder_key(folder)
    named = tmp_path / "key"
    named.write_text(SECRET)
    os.chmod(named, 0o640)
    env = {"SEKALI_WEBHOOKS_SIGNING_KEY_FILE": str(named)}
    with pytest.raises(SigningKeyInvalid, match="SEKALI_WEBHOOKS_SIGNING_KEY_FILE"):
        signing_key(env)
    os.chmod(named, 0o600)
    assert signing_key(env) == KEY and made.startswith("whsec_")


def test_a_signing_key_in_resource_config_is_refused(db_url: str) -> None:
    """A secret typed into a resource's config (``extra.signing_key``) is stored with every
    run: refused, naming the variables that keep it out of run storage."""
    settings = Settings(database_url=db_url, redis_url="redis://127.0.0.1:1/0",
                        dagster_home=Path("/nonexistent"), gateway_url="http://127.0.0.1:9",
                        smtp_host="127.0.0.1", smtp_port=9)
    with pytest.raises(SigningKeyInvalid, match="SEKALI_WEBHOOKS_SIGNING_KEY"):
        WEBHOOKS.build(settings, ClientOptions(extra={"signing_key": SECRET}))


def test_the_cli_rotates_and_lists_masked(db_url: str, db: Database,
                                          monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """``sekali webhooks secret rotate`` prints the new secret once; ``list`` masks every
    secret unless ``--reveal``."""
    from cli.main import main

    monkeypatch.setenv("SEKALI_WEBHOOKS_SIGNING_KEY", SECRET)
    monkeypatch.setenv("DATABASE_URL", db_url)
    assert main(["webhooks", "secret", "rotate", "ep-9", "--overlap", "1h"]) == 0
    new = capsys.readouterr().out.strip()
    assert new.startswith("whsec_")
    assert main(["webhooks", "secret", "list", "ep-9", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["state"] for r in rows] == ["active", "active"]
    assert all(r["secret"].endswith("...") and new not in r["secret"] for r in rows)
