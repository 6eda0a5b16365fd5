"""A local payment gateway over real HTTP, a stand-in for a third party, that counts every charge.

It keeps its charges in its own database (any SQLAlchemy URL; default a SQLite file under the
state folder) and creates its own table ``gateway_charges``: it is not part of sekali's schema.

Protocol (Stripe-like):

- ``POST /charges`` JSON ``{reference, amount_cents, currency}``, optional headers
  ``Idempotency-Key`` and ``X-Correlation-Id``. 201 with the charge. With key support on, a
  repeated key returns the original charge (200, header ``Idempotent-Replayed: true``) and the
  same key with a different body is refused (422). With key support off every POST charges.
- ``GET /charges?reference=R``: ``{"charges": [...]}`` for that reference, oldest first.
- ``GET /_admin/charges``: every charge; ``GET|POST /_admin/faults``: read or change the faults;
  ``POST /_admin/reset``: delete every charge. Each needs ``Authorization: Bearer <token>``
  (:attr:`GatewayServer.admin_token`: generated, or ``SEKALI_GATEWAY_ADMIN_TOKEN`` for the
  command line; ``sekali dev`` leaves it in ``<state>/gateway-admin-token``, 0600); without it
  401, so a local user cannot read the charges or inject faults.
- ``GET /healthz``: 200 when serving (no token).

Request bodies are bounded: a ``Content-Length`` that is not a non-negative integer is refused
(400), one above :data:`MAX_BODY` (413) before a byte of the body is read.

Faults (set at start, changeable while running): ``error_rate`` (503 before charging, with
``Retry-After`` when ``retry_after_s`` is set), ``latency_ms`` (before handling),
``drop_after_charge_rate`` (commit the charge, then close the connection without an answer:
the client sees a reset although the charge happened), ``charge_delay_ms`` (slow to process: the
charge commits only after this delay, whether or not the client still waits, so a client that
timed out finds nothing by reference until then), ``drip_ms`` (the answers of ``/charges`` are
written one byte every ``drip_ms``: each read sees progress, the whole answer takes minutes),
``honour_idempotency_key``, ``seed``.

Guarantee with key support on: one charge per key even under concurrent duplicates. The charge
and its key are one row inserted with ``ON CONFLICT (dedupe_key) DO NOTHING`` under a unique
index, so the database, not a check-then-insert, decides.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import random
import secrets
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

from sqlalchemy import (
    BigInteger,
    Column,
    Float,
    Index,
    MetaData,
    Table,
    Text,
    select,
    text,
)
from sqlalchemy.engine import Engine

from resources.headers import http_header_text
from resources.storage.db import make_engine
from resources.storage.settings import state_dir
from sandbox.http_server import FaultSet, JsonHandler, RequestRefused, ServedOnThread

log = logging.getLogger(__name__)

gateway_metadata = MetaData()
gateway_charges = Table(
    "gateway_charges",
    gateway_metadata,
    Column("charge_id", Text, primary_key=True),
    Column("reference", Text, nullable=False),
    Column("amount_cents", BigInteger, nullable=False),
    Column("currency", Text, nullable=False),
    Column("idempotency_key", Text),
    Column("dedupe_key", Text, unique=True),
    Column("request_hash", Text, nullable=False),
    Column("correlation_id", Text),
    Column("created_at", Float, nullable=False),
    Index("gateway_charges_reference", "reference"),
)

_PUBLIC = ("charge_id", "reference", "amount_cents", "currency", "idempotency_key",
           "correlation_id", "created_at")


@dataclass
class Faults(FaultSet):
    """The gateway's misbehaviour, all off by default."""

    error_rate: float = 0.0
    latency_ms: float = 0.0
    drop_after_charge_rate: float = 0.0
    charge_delay_ms: float = 0.0
    drip_ms: float = 0.0
    honour_idempotency_key: bool = True
    retry_after_s: float | None = None
    seed: int | None = None


MAX_BODY = 64 * 1024
"""Bytes a request body may have: a charge is a few hundred."""
ADMIN_TOKEN_ENV = "SEKALI_GATEWAY_ADMIN_TOKEN"
ADMIN_TOKEN_FILE = "gateway-admin-token"
"""Where ``sekali dev`` leaves its sandbox gateway's token (0600, in the state folder)."""


_BadRequest = RequestRefused


class ChargeLedger:
    """The gateway's own table: charge, replay by key, list. Usable without HTTP."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        gateway_metadata.create_all(engine, checkfirst=True)

    def charge(
        self,
        *,
        reference: str,
        amount_cents: int,
        currency: str,
        idempotency_key: str | None,
        correlation_id: str | None,
        honour_key: bool,
    ) -> tuple[dict[str, Any], bool]:
        """Record a charge; return (charge, replayed). Raises _BadRequest(422) on key reuse."""
        request_hash = hashlib.sha256(
            json.dumps([reference, amount_cents, currency]).encode()
        ).hexdigest()
        dedupe_key = idempotency_key if honour_key else None
        row = {
            "charge_id": "ch_" + uuid.uuid4().hex[:20],
            "reference": reference,
            "amount_cents": amount_cents,
            "currency": currency,
            "idempotency_key": idempotency_key,
            "dedupe_key": dedupe_key,
            "request_hash": request_hash,
            "correlation_id": correlation_id,
            "created_at": time.time(),
        }
        with self.engine.begin() as conn:
            inserted = conn.execute(
                text(
                    "INSERT INTO gateway_charges (charge_id, reference, amount_cents, currency,"
                    " idempotency_key, dedupe_key, request_hash, correlation_id, created_at)"
                    " VALUES (:charge_id, :reference, :amount_cents, :currency,"
                    " :idempotency_key, :dedupe_key, :request_hash, :correlation_id, :created_at)"
                    " ON CONFLICT (dedupe_key) DO NOTHING RETURNING charge_id"
                ),
                row,
            ).first()
            if inserted is not None:
                return _public(row), False
            existing = conn.execute(
                select(gateway_charges).where(gateway_charges.c.dedupe_key == dedupe_key)
            ).first()
        if existing is None:  # pragma: no cover - the conflicting row cannot vanish
            raise _BadRequest(500, "conflict without a row")
        record = dict(existing._mapping)
        if record["request_hash"] != request_hash:
            raise _BadRequest(
                422,
                f"Idempotency-Key {idempotency_key!r} was used with a different request "
                f"(charge {record['charge_id']})",
            )
        return _public(record), True

    def by_reference(self, reference: str) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = conn.execute(
                select(gateway_charges)
                .where(gateway_charges.c.reference == reference)
                .order_by(gateway_charges.c.created_at)
            ).all()
        return [_public(dict(r._mapping)) for r in rows]

    def all(self) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(gateway_charges).order_by(gateway_charges.c.created_at))
            return [_public(dict(r._mapping)) for r in rows]

    def reset(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(gateway_charges.delete())


def _public(row: dict[str, Any]) -> dict[str, Any]:
    return {name: row[name] for name in _PUBLIC}


def _header(raw: str | None) -> str | None:
    """A header value as sekali's client wrote it (percent-encoded UTF-8 outside printable
    ASCII: :mod:`resources.headers`), read back."""
    return None if raw is None else http_header_text(raw)


def _parse_charge(body: Any) -> tuple[str, int, str]:
    if not isinstance(body, dict):
        raise _BadRequest(400, "body must be a JSON object")
    reference, amount, currency = body.get("reference"), body.get("amount_cents"), body.get(
        "currency"
    )
    if not isinstance(reference, str) or not reference:
        raise _BadRequest(400, "reference: a non-empty string is required")
    if not isinstance(amount, int) or isinstance(amount, bool) or amount <= 0:
        raise _BadRequest(400, "amount_cents: a positive integer is required")
    if not isinstance(currency, str) or len(currency) != 3:
        raise _BadRequest(400, "currency: a 3-letter code is required")
    return reference, amount, currency.upper()


class _Handler(JsonHandler):
    def _body(self) -> Any:
        raw = self.read_body(MAX_BODY)
        if not raw:
            return {}
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise _BadRequest(400, f"body is not JSON: {exc}") from exc

    def dispatch(self, method: str) -> None:
        gw: GatewayServer = self.server.owner
        url = urlsplit(self.path)
        try:
            body = self._body() if method == "POST" else None
            if url.path.startswith("/_admin/"):
                if not self.admin_allowed(gw.admin_token):
                    raise _BadRequest(401, "Authorization: Bearer <admin token> required")
                self._admin(method, url.path, body)
                return
            if url.path == "/healthz":
                self.send_json(200, {"ok": True})
                return
            if url.path != "/charges":
                raise _BadRequest(404, f"no route {method} {url.path}")
            faults = gw.faults_snapshot()
            if faults.latency_ms > 0:
                time.sleep(faults.latency_ms / 1000)
            if method == "GET":
                reference = (parse_qs(url.query).get("reference") or [""])[0]
                if not reference:
                    raise _BadRequest(400, "reference: query parameter required")
                self.send_json(
                    200, {"charges": gw.ledger.by_reference(reference)}, drip_ms=faults.drip_ms
                )
                return
            if gw.draw() < faults.error_rate:
                headers = {}
                if faults.retry_after_s is not None:
                    headers["Retry-After"] = str(faults.retry_after_s)
                self.send_json(503, {"error": "injected outage"}, headers)
                return
            reference, amount, currency = _parse_charge(body)
            if faults.charge_delay_ms > 0:
                time.sleep(faults.charge_delay_ms / 1000)
            charge, replayed = gw.ledger.charge(
                reference=reference,
                amount_cents=amount,
                currency=currency,
                idempotency_key=_header(self.headers.get("Idempotency-Key")),
                correlation_id=_header(self.headers.get("X-Correlation-Id")),
                honour_key=faults.honour_idempotency_key,
            )
            if gw.draw() < faults.drop_after_charge_rate:
                log.info("gateway: charged %s, dropping the response", charge["charge_id"])
                self.drop()
                return
            self.send_json(
                200 if replayed else 201,
                charge,
                {"Idempotent-Replayed": "true"} if replayed else None,
                drip_ms=faults.drip_ms,
            )
        except OSError:
            # the client gave up (a timeout, a deadline): the charge stands, nobody hears it
            log.info("gateway: client went away during %s %s", method, url.path)
            self.close_connection = True
        except _BadRequest as exc:
            self.send_json(exc.status, {"error": str(exc)})
        except Exception as exc:  # noqa: BLE001 - a server answers 500, it does not die
            log.exception("gateway error")
            self.send_json(500, {"error": repr(exc)})

    def _admin(self, method: str, path: str, body: Any) -> None:
        gw: GatewayServer = self.server.owner
        if path == "/_admin/charges" and method == "GET":
            self.send_json(200, {"charges": gw.ledger.all()})
        elif path == "/_admin/faults":
            if method == "POST":
                try:
                    gw.set_faults(**body)
                except (ValueError, TypeError) as exc:
                    raise _BadRequest(400, str(exc)) from exc
            self.send_json(200, asdict(gw.faults_snapshot()))
        elif path == "/_admin/reset" and method == "POST":
            gw.ledger.reset()
            self.send_json(200, {"ok": True})
        else:
            raise _BadRequest(404, f"no route {method} {path}")


class GatewayServer(ServedOnThread):
    """The gateway in-process: ``start()`` serves on a background thread; ``stop()`` ends it."""

    handler = _Handler
    thread_name = "sandbox-gateway"

    def __init__(
        self,
        db_url: str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        error_rate: float = 0.0,
        latency_ms: float = 0.0,
        drop_after_charge_rate: float = 0.0,
        charge_delay_ms: float = 0.0,
        drip_ms: float = 0.0,
        honour_idempotency_key: bool = True,
        retry_after_s: float | None = None,
        seed: int | None = None,
        admin_token: str | None = None,
    ) -> None:
        self.admin_token = admin_token or secrets.token_hex(16)
        if db_url is None:

            db_url = f"sqlite:///{state_dir() / 'gateway.db'}"
        self.db_url = db_url
        self.host = host
        self.port = port
        self.faults = Faults()
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self.set_faults(
            error_rate=error_rate,
            latency_ms=latency_ms,
            drop_after_charge_rate=drop_after_charge_rate,
            charge_delay_ms=charge_delay_ms,
            drip_ms=drip_ms,
            honour_idempotency_key=honour_idempotency_key,
            retry_after_s=retry_after_s,
            seed=seed,
        )
        self.ledger = ChargeLedger(make_engine(db_url, pool_size=10))

    def set_faults(self, **changes: Any) -> Faults:
        with self._lock:
            self.faults.update(changes)
            if "seed" in changes:
                self._rng = random.Random(changes["seed"])
            return Faults(**asdict(self.faults))

    def faults_snapshot(self) -> Faults:
        with self._lock:
            return Faults(**asdict(self.faults))

    def draw(self) -> float:
        with self._lock:
            return self._rng.random()

    def charges(self) -> list[dict[str, Any]]:
        return self.ledger.all()

    def reset(self) -> None:
        self.ledger.reset()

    def stop(self) -> None:
        super().stop()
        self.ledger.engine.dispose()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="sekali sandbox payment gateway")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--db-url", default=None, help="SQLAlchemy URL (default: state folder)")
    parser.add_argument("--error-rate", type=float, default=0.0)
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--drop-after-charge-rate", type=float, default=0.0)
    parser.add_argument("--charge-delay-ms", type=float, default=0.0)
    parser.add_argument("--drip-ms", type=float, default=0.0)
    parser.add_argument("--no-idempotency-key", action="store_true")
    parser.add_argument("--retry-after-s", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    server = GatewayServer(
        args.db_url,
        host=args.host,
        port=args.port,
        error_rate=args.error_rate,
        latency_ms=args.latency_ms,
        drop_after_charge_rate=args.drop_after_charge_rate,
        charge_delay_ms=args.charge_delay_ms,
        drip_ms=args.drip_ms,
        honour_idempotency_key=not args.no_idempotency_key,
        retry_after_s=args.retry_after_s,
        seed=args.seed,
        admin_token=os.environ.get(ADMIN_TOKEN_ENV),
    )
    print(f"sandbox gateway listening on http://{args.host}:{args.port}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()


if __name__ == "__main__":
    main()
