"""Personal data and secrets out of the places nothing masked: rejections, URLs in errors, the
operator's terminal, argv, the Postgres statement log; and a TLS handshake that failed is
"not delivered", never "maybe delivered"."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from cli.main import main
from engine.privacy import mask_text
from pipelines.jobs.webhook import JOB_TYPE as WEBHOOK
from resources.dlq import DlqStore, FailureInfo
from resources.http import BoundedHttp, HttpUnreachable
from resources.storage.db import Database
from sandbox.postgres_server import PostgresServer, scram_verifier
from tests.test_security import private_pg  # noqa: F401 - the private server fixture

ESC = "\x1b"


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_rejections_show_holds_no_payload_value(
    db: Database, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression caught: ``sekali rejections show`` printed the stored payload excerpt (an
    e-mail address, a name, a tokenised URL) unmasked. The rejection keeps the payload's shape,
    size and hash: no value of it is stored or shown."""
    payload = {"to": "ann.smith@example.com", "template": "welcome", "user_id": "Ann Smith",
               "url": "https://hooks.example/x?token=s3cr3t", "amount_cents": "lots"}
    code, _, _ = _run(capsys, "enqueue", "send_email", "--payload", json.dumps(payload),
                      "--url", db_url)
    assert code == 2
    code, out, _ = _run(capsys, "rejections", "list", "--json", "--url", db_url)
    [row] = json.loads(out)
    for extra in ([], ["--json"]):
        code, out, _ = _run(capsys, "rejections", "show", str(row["id"]), *extra,
                            "--url", db_url)
        assert code == 0
        for value in ("ann.smith", "Ann Smith", "s3cr3t", "hooks.example", "welcome"):
            assert value not in out, value
        assert "<str 21>" in out and len(json.loads(out)["payload_sha256"] if extra else "x")


def test_a_url_is_masked_by_its_prefix_and_host_in_errors() -> None:
    """Regression caught: a webhook URL with a query string escaped the error masking, since
    errors name it without its query. Its prefix and its host are masked too."""
    payload = {"endpoint_id": "ep-1", "url": "https://cust.example/h/abc?token=s3cr3t",
               "event_id": "e", "event_type": "t"}
    for text in ("egress refused (private): https://cust.example/h/abc: ...",
                 "no connection to https://cust.example: NewConnectionError"):
        masked = mask_text(text, WEBHOOK, payload)
        assert "cust.example" not in masked and "<redacted>" in masked


def test_control_characters_never_reach_the_terminal(
    db: Database, db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression caught: ESC sequences from an endpoint's answer or a payload reached the
    operator's terminal through ``dlq list/show``, ``rejections`` and ``requests``. Every
    human view prints them escaped (``\\x1b``); JSON escapes them as JSON does."""
    hostile = f"{ESC}]0;owned{ESC}\\{ESC}[2J{ESC}[31mred\x9b"
    recorded = DlqStore(db).record_failure(FailureInfo(
        job_type=f"x{ESC}[1m", dedupe_key="request:1", error_type="WebhookRejected",
        message=f"endpoint said {hostile}", run_id="r-1", payload={"note": hostile}))
    _run(capsys, "enqueue", "charge_payment", "--payload",
         json.dumps({"order_id": hostile, "amount_cents": "x"}), "--url", db_url)
    for argv in (["dlq", "list"], ["dlq", "show", str(recorded.record.id)],
                 ["rejections", "list"], ["requests", "list"],
                 ["dlq", "list", "--json"], ["rejections", "list", "--json"]):
        code, out, err = _run(capsys, *argv, "--url", db_url)
        assert code == 0, (argv, err)
        assert ESC not in out and ESC not in err and "\x9b" not in out, argv


def test_a_password_in_a_url_option_is_warned_about(
    db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``--url`` holding a password is visible to every local user in the process list: the
    command warns and names the variable to use instead; ``cluster up --env SECRET=...`` too,
    while ``--env NAME`` takes the value from the environment."""
    from cli.commands.cluster import _parse_env

    with pytest.raises(Exception, match="unavailable"):  # nothing listens there
        _run(capsys, "rejections", "list", "--url",
             "postgresql+psycopg://app:hunter2@127.0.0.1:1/none")
    err = capsys.readouterr().err
    assert "--url carries a password" in err and "DATABASE_URL" in err
    assert "hunter2" not in err
    monkeypatch.setenv("SEKALI_API_TOKEN", "t0ken")
    assert _parse_env(["SEKALI_API_TOKEN"]) == {"SEKALI_API_TOKEN": "t0ken"}
    assert "warning" not in capsys.readouterr().err
    assert _parse_env(["SEKALI_API_TOKEN=typed"]) == {"SEKALI_API_TOKEN": "typed"}
    assert "export SEKALI_API_TOKEN" in capsys.readouterr().err


def test_role_passwords_reach_postgres_only_as_scram_verifiers(
    private_pg: PostgresServer,  # noqa: F811 - the fixture imported above
) -> None:
    """Regression caught: ``CREATE ROLE ... PASSWORD '<plain text>'`` put role passwords in the
    server's statement text (``pg_stat_statements``, the log). The verifier made client-side
    authenticates the role, and the statement holds no password."""
    verifier = scram_verifier("pw-of-the-role")
    assert "pw-of-the-role" not in verifier and verifier.startswith("SCRAM-SHA-256$4096:")
    with psycopg.connect(private_pg.conninfo() if hasattr(private_pg, "conninfo")
                         else private_pg.url().replace("postgresql+psycopg", "postgresql"),
                         autocommit=True) as conn:
        conn.execute(f"CREATE ROLE verified LOGIN PASSWORD '{verifier}'")
    psycopg.connect(host="127.0.0.1", port=private_pg.port, user="verified",
                    password="pw-of-the-role", dbname="postgres", connect_timeout=5).close()
    with pytest.raises(psycopg.OperationalError, match="password authentication failed"):
        psycopg.connect(host="127.0.0.1", port=private_pg.port, user="verified",
                        password="wrong", dbname="postgres", connect_timeout=5).close()


@pytest.fixture
def not_tls() -> Iterator[int]:
    """A loopback server that answers a TLS hello with plain text and hangs up."""
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            with conn:
                conn.recv(4096)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(2)
    server.close()


def test_a_failed_tls_handshake_is_not_delivered(not_tls: int) -> None:
    """Regression caught: a TLS handshake failure was classed "maybe delivered" (settle-window
    waits and lookups for a message that never left). No byte of the request was written:
    ``HttpUnreachable``, nothing sent, retried at once."""
    http = BoundedHttp(timeout=2.0, deadline=4.0)
    with pytest.raises(HttpUnreachable) as failed:
        http.request("POST", f"https://127.0.0.1:{not_tls}/hooks/ep-1", body=b"{}")
    assert not getattr(failed.value, "maybe_received", False)


def test_the_concurrency_cap_is_keyed_on_the_destination() -> None:
    """Regression caught: the per-endpoint cap was keyed on the caller-chosen ``endpoint_id``,
    so many ids naming one host each got four slots. The key is the destination."""
    def key(endpoint: str, url: str) -> Any:
        return WEBHOOK.concurrency_key_for({"endpoint_id": endpoint, "url": url})

    assert key("a", "https://Host.example/x") == key("b", "https://host.example:443/y?q=1")
    assert key("a", "https://host.example/x") != key("a", "https://other.example/x")
    assert key("a", "") != key("b", "")
