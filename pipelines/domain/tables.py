"""The business tables the job types change, declared for ``resources.storage.db.metadata``.

``sql/0030_business.sql`` creates them (the schema's only truth); stock and reservations are
declared beside their logic in ``resources/inventory.py``.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Float, Table, Text

from resources.storage.db import metadata

orders = Table(
    "orders",
    metadata,
    Column("order_id", Text, primary_key=True),
    Column("amount_cents", BigInteger),
    Column("currency", Text),
    Column("payment_status", Text, nullable=False),
    Column("payment_reference", Text, unique=True),
    Column("charge_id", Text, unique=True),
    Column("charge_sent_at", Float),
    Column("fulfilment_status", Text, nullable=False),
    Column("payment_fence", BigInteger, nullable=False),
    Column("fulfilment_fence", BigInteger, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
)

payment_references = Table(
    "payment_references",
    metadata,
    Column("order_id", Text, primary_key=True),
    Column("reference", Text, primary_key=True),
    Column("key", Text),
    Column("first_sent_at", Float, nullable=False),
)
"""Every reference a charge of an order went out under (owner: ``pipelines/jobs/payment.py``)."""

shipments = Table(
    "shipments",
    metadata,
    Column("order_id", Text, primary_key=True),
    Column("shipped_at", Float, nullable=False),
    Column("fence", BigInteger, nullable=False),
)

report_snapshots = Table(
    "report_snapshots",
    metadata,
    Column("report", Text, nullable=False),
    Column("as_of", Text, nullable=False),
    Column("built_at", Float, nullable=False),
    Column("builder", Text, nullable=False),
    Column("data", Text, nullable=False),
)
