-- Business tables the job types change: orders (payment and fulfilment states beside the
-- technical ones in idempotency_records), stock and reservations, shipments, report snapshots.
-- Status transitions live beside the enums in pipelines/jobs/payment.py, fulfilment.py and
-- resources/inventory.py. Invariants are unique keys, so a duplicate effect cannot commit.
CREATE TABLE IF NOT EXISTS orders (
    order_id           TEXT PRIMARY KEY,
    amount_cents       BIGINT,
    currency           TEXT,
    payment_status     TEXT NOT NULL DEFAULT 'payment_pending'
        CHECK (payment_status IN ('payment_pending', 'charged_not_confirmed', 'paid',
                                  'payment_failed')),
    payment_reference  TEXT UNIQUE,
    charge_id          TEXT UNIQUE,
    fulfilment_status  TEXT NOT NULL DEFAULT 'new'
        CHECK (fulfilment_status IN ('new', 'processing', 'reserved', 'fulfilled',
                                     'needs_compensation')),
    payment_fence      BIGINT NOT NULL DEFAULT 0,
    fulfilment_fence   BIGINT NOT NULL DEFAULT 0,
    created_at         DOUBLE PRECISION NOT NULL,
    updated_at         DOUBLE PRECISION NOT NULL
);

CREATE INDEX IF NOT EXISTS orders_payment_status ON orders (payment_status, updated_at);

CREATE INDEX IF NOT EXISTS orders_fulfilment_status ON orders (fulfilment_status, updated_at);

CREATE TABLE IF NOT EXISTS stock (
    sku        TEXT PRIMARY KEY,
    on_hand    BIGINT NOT NULL CHECK (on_hand >= 0),
    reserved   BIGINT NOT NULL DEFAULT 0 CHECK (reserved >= 0 AND reserved <= on_hand),
    updated_at DOUBLE PRECISION NOT NULL
);

CREATE TABLE IF NOT EXISTS reservations (
    cart_id    TEXT NOT NULL,
    sku        TEXT NOT NULL,
    quantity   BIGINT NOT NULL CHECK (quantity > 0),
    status     TEXT NOT NULL DEFAULT 'reserved'
        CHECK (status IN ('reserved', 'released', 'shipped')),
    fence      BIGINT NOT NULL DEFAULT 0,
    created_at DOUBLE PRECISION NOT NULL,
    updated_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (cart_id, sku)
);

CREATE INDEX IF NOT EXISTS reservations_status ON reservations (status, updated_at);

CREATE TABLE IF NOT EXISTS shipments (
    order_id   TEXT PRIMARY KEY,
    shipped_at DOUBLE PRECISION NOT NULL,
    fence      BIGINT NOT NULL
);

CREATE TABLE IF NOT EXISTS report_snapshots (
    report     TEXT NOT NULL,
    as_of      TEXT NOT NULL,
    built_at   DOUBLE PRECISION NOT NULL,
    builder    TEXT NOT NULL,
    data       TEXT NOT NULL
);

CREATE INDEX IF NOT EXISTS report_snapshots_report ON report_snapshots (report, as_of);
