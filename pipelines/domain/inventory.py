"""Stock and reservations in the app database: a reservation happens once per (cart, sku).

Guarantees, on SQLite and Postgres:

- ``reserve`` runs inside the caller's transaction, locks the stock rows it touches (``SELECT
  ... FOR UPDATE`` in sku order on Postgres, so two carts never deadlock; ``BEGIN IMMEDIATE``
  serialises writers on SQLite), checks availability and writes the reservations and the
  reserved counts together. ``reserved <= on_hand`` is a CHECK constraint: oversell cannot commit.
- The primary key ``(cart_id, sku)`` makes a second reservation of the same cart impossible; a
  repeated ``reserve`` of a cart that already holds its reservations returns them unchanged.
- ``reserve`` and ``ship`` raise :class:`ReservationsNotHeld` when the cart's rows are no longer
  ``reserved`` (released by compensation, or already shipped): a resumed job must never report
  goods shipped from reservations that no longer hold any stock.

Reservation states (written here, beside their definition)::

    reserved --release--> released        reserved --ship--> shipped
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import BigInteger, Column, Float, Table, Text, text
from sqlalchemy.engine import Connection

from engine import Check
from engine.contract import reject_unknown, require_int, require_str
from resources.errors import PermanentJobError, ValidationError, shown
from resources.locks import lock_row, lock_rows
from resources.storage.db import Database, metadata

stock = Table(
    "stock",
    metadata,
    Column("sku", Text, primary_key=True),
    Column("on_hand", BigInteger, nullable=False),
    Column("reserved", BigInteger, nullable=False),
    Column("updated_at", Float, nullable=False),
)

reservations = Table(
    "reservations",
    metadata,
    Column("cart_id", Text, primary_key=True),
    Column("sku", Text, primary_key=True),
    Column("quantity", BigInteger, nullable=False),
    Column("status", Text, nullable=False),
    Column("fence", BigInteger, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
)


class InsufficientStock(PermanentJobError):
    """Not enough unreserved stock for the cart. Permanent: restock or fix the cart, then replay."""

    def __init__(self, sku: str, requested: int, available: int) -> None:
        super().__init__(
            f"sku {sku!r}: requested {requested}, only {available} available; "
            "restock or change the cart, then replay"
        )
        self.sku = sku
        self.requested = requested
        self.available = available


class UnknownSku(PermanentJobError):
    """The sku has no stock row. Permanent: fix the catalogue or the request, then replay."""

    def __init__(self, sku: str) -> None:
        super().__init__(f"sku {sku!r} is not stocked; fix the request or the catalogue")
        self.sku = sku


class ReservationsNotHeld(PermanentJobError):
    """The cart's reservations are not ``reserved`` (released by compensation, shipped, or never
    made). Permanent: nothing can ship from them; place the order again with a new cart."""

    def __init__(self, cart_id: str, statuses: Mapping[str, str]) -> None:
        found = ", ".join(f"{sku}={st}" for sku, st in statuses.items()) or "none"
        super().__init__(
            f"cart {cart_id!r} holds no live reservations ({found}); they were released by "
            "compensation or never made: nothing ships from them, place the order again"
        )
        self.cart_id = cart_id
        self.statuses = dict(statuses)


@dataclass(frozen=True)
class Reservation:
    cart_id: str
    sku: str
    quantity: int
    status: str


def merge_items(items: Iterable[Mapping[str, Any] | Item]) -> dict[str, int]:
    """Sum quantities per sku, sorted by sku (the lock order)."""
    merged: dict[str, int] = {}
    for item in items:
        sku, quantity = (
            (item.sku, item.quantity) if isinstance(item, Item) else (item["sku"], item["quantity"])
        )
        merged[str(sku)] = merged.get(str(sku), 0) + int(quantity)
    return dict(sorted(merged.items()))


class Inventory:
    """Stock and reservations over the app ``Database``."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def set_stock(self, sku: str, on_hand: int) -> None:
        """Set the stock on hand of ``sku`` (creating it); reserved counts are kept."""
        with self.db.transaction() as conn:
            conn.execute(
                text(
                    "INSERT INTO stock (sku, on_hand, reserved, updated_at)"
                    " VALUES (:sku, :n, 0, :now)"
                    " ON CONFLICT (sku) DO UPDATE SET on_hand = excluded.on_hand,"
                    " updated_at = excluded.updated_at"
                ),
                {"sku": sku, "n": on_hand, "now": time.time()},
            )

    def seed_stock(self, catalogue: Mapping[str, int]) -> list[str]:
        """Create the SKUs of ``catalogue`` that do not exist yet, with that stock on hand; an
        existing SKU is left exactly as it is. Returns the SKUs created."""
        created = []
        with self.db.transaction() as conn:
            for sku, on_hand in sorted(catalogue.items()):
                row = conn.execute(
                    text(
                        "INSERT INTO stock (sku, on_hand, reserved, updated_at)"
                        " VALUES (:sku, :n, 0, :now) ON CONFLICT (sku) DO NOTHING RETURNING sku"
                    ),
                    {"sku": sku, "n": on_hand, "now": time.time()},
                ).first()
                if row is not None:
                    created.append(sku)
        return created

    def stock(self, sku: str) -> tuple[int, int]:
        """``(on_hand, reserved)`` of ``sku``."""
        with self.db.statement() as conn:
            row = conn.execute(
                text("SELECT on_hand, reserved FROM stock WHERE sku = :sku"), {"sku": sku}
            ).first()
        if row is None:
            raise UnknownSku(sku)
        return int(row.on_hand), int(row.reserved)

    def reservations(self, cart_id: str, conn: Connection | None = None) -> list[Reservation]:
        sql = text(
            "SELECT cart_id, sku, quantity, status FROM reservations"
            " WHERE cart_id = :cart ORDER BY sku"
        )
        if conn is None:
            with self.db.statement() as own:
                rows = own.execute(sql, {"cart": cart_id}).all()
        else:
            rows = conn.execute(sql, {"cart": cart_id}).all()
        return [Reservation(r.cart_id, r.sku, int(r.quantity), r.status) for r in rows]

    def lock_stock(self, conn: Connection, skus: Iterable[str]) -> None:
        """Lock the stock rows of ``skus`` in sku order inside the caller's transaction (Postgres;
        SQLite's ``BEGIN IMMEDIATE`` already excludes every other writer). A transaction that
        reserves for several carts takes its locks up front, so two such never deadlock."""
        lock_rows(conn, "stock", "sku", skus)

    def reserve(
        self,
        conn: Connection,
        cart_id: str,
        items: Iterable[Mapping[str, Any] | Item],
        *,
        fence: int = 0,
    ) -> list[Reservation]:
        """Reserve ``items`` for ``cart_id`` inside the caller's transaction ``conn``.

        Returns the cart's reservations. Raises :class:`InsufficientStock` / :class:`UnknownSku`
        (permanent) and leaves the transaction for the caller to roll back. A cart whose rows
        exist but are no longer ``reserved`` raises :class:`ReservationsNotHeld`: returning the
        released rows would let the caller believe it holds stock.
        """
        wanted = merge_items(items)
        existing = self.reservations(cart_id, conn)
        if existing:
            _require_held(cart_id, existing)
            return existing
        now = time.time()
        for sku, quantity in wanted.items():
            row = lock_row(conn, "stock", "sku", sku)
            if row is None:
                raise UnknownSku(sku)
            available = int(row.on_hand) - int(row.reserved)
            if available < quantity:
                raise InsufficientStock(sku, quantity, available)
            conn.execute(
                text(
                    "UPDATE stock SET reserved = reserved + :q, updated_at = :now WHERE sku = :sku"
                ),
                {"q": quantity, "sku": sku, "now": now},
            )
            conn.execute(
                text(
                    "INSERT INTO reservations (cart_id, sku, quantity, status, fence,"
                    " created_at, updated_at)"
                    " VALUES (:cart, :sku, :q, 'reserved', :fence, :now, :now)"
                ),
                {"cart": cart_id, "sku": sku, "q": quantity, "fence": fence, "now": now},
            )
        return self.reservations(cart_id, conn)

    def release(self, conn: Connection, cart_id: str) -> int:
        """Release the cart's live reservations (compensation). Returns how many were released."""
        released = 0
        now = time.time()
        for res in self.reservations(cart_id, conn):
            if res.status != "reserved":
                continue
            # the row moves first: stock is returned only by the writer that moved it
            moved = conn.execute(
                text(
                    "UPDATE reservations SET status = 'released', updated_at = :now"
                    " WHERE cart_id = :cart AND sku = :sku AND status = 'reserved'"
                ),
                {"cart": cart_id, "sku": res.sku, "now": now},
            ).rowcount
            if moved != 1:
                continue
            conn.execute(
                text(
                    "UPDATE stock SET reserved = reserved - :q, updated_at = :now WHERE sku = :sku"
                ),
                {"q": res.quantity, "sku": res.sku, "now": now},
            )
            released += 1
        return released

    def ship(self, conn: Connection, cart_id: str) -> int:
        """Turn the cart's reservations into shipped goods: stock leaves the shelf.

        Raises :class:`ReservationsNotHeld` unless every row of the cart is ``reserved``, so a
        caller never records a shipment that moved no stock.
        """
        shipped = 0
        now = time.time()
        held = self.reservations(cart_id, conn)
        _require_held(cart_id, held)
        for res in held:
            moved = conn.execute(
                text(
                    "UPDATE reservations SET status = 'shipped', updated_at = :now"
                    " WHERE cart_id = :cart AND sku = :sku AND status = 'reserved'"
                ),
                {"cart": cart_id, "sku": res.sku, "now": now},
            ).rowcount
            if moved != 1:  # released since we read it (a concurrent compensation): roll back
                raise ReservationsNotHeld(cart_id, {res.sku: "released"})
            conn.execute(
                text(
                    "UPDATE stock SET reserved = reserved - :q, on_hand = on_hand - :q,"
                    " updated_at = :now WHERE sku = :sku"
                ),
                {"q": res.quantity, "sku": res.sku, "now": now},
            )
            shipped += 1
        return shipped


def _require_held(cart_id: str, rows: list[Reservation]) -> None:
    if not rows or any(r.status != "reserved" for r in rows):
        raise ReservationsNotHeld(cart_id, {r.sku: r.status for r in rows})


class Item(BaseModel):
    """One line of what to take from stock."""

    model_config = ConfigDict(frozen=True)

    sku: str = Field(description="The stock keeping unit (no spaces or ':').")
    quantity: int = Field(description="How many, 1 to 100000.")


def require_items(payload: dict[str, Any], field_name: str = "items") -> list[dict[str, Any]]:
    """A non-empty list of ``{sku, quantity}``; errors name the item, e.g. ``items[2].quantity``."""
    items = payload.get(field_name)
    if items is None:
        raise ValidationError(field_name, "required: a non-empty list of {sku, quantity}")
    if not isinstance(items, list) or not items:
        raise ValidationError(
            field_name, f"must be a non-empty list of {{sku, quantity}}, got {shown(items)}",
            items,
        )
    clean = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValidationError(
                f"{field_name}[{i}]", f"must be an object {{sku, quantity}}, got {shown(item)}",
                item,
            )
        try:
            reject_unknown(item, {"sku", "quantity"})
            clean.append(
                {
                    "sku": require_str(item, "sku"),
                    "quantity": require_int(item, "quantity", maximum=100_000),
                }
            )
        except ValidationError as exc:
            field = f"{field_name}[{i}].{exc.field}"
            raise ValidationError(field, exc.problem, exc.value) from None
    return sorted(clean, key=lambda it: it["sku"])


Items = Annotated[list[Item], Check(require_items), Field(
    description="What to take from stock: a non-empty list of {sku, quantity}.")]
"""A payload's ``items`` field: checked by :func:`require_items` (each refusal names the line,
``items[2].quantity``), sorted by sku."""
