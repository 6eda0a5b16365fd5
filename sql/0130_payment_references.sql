-- Every reference a charge of an order went out under (pipelines/jobs/payment.py writes it in the
-- transaction that writes the send down). A lookup before charging again, and reconciliation's
-- double_charged, read the charges under all of them, not only the order's current
-- payment_reference: a run under another key of the same order (a replay under a key stored cut
-- short by an older release, a version) charges under another reference.
CREATE TABLE IF NOT EXISTS payment_references (
    order_id      TEXT NOT NULL,
    reference     TEXT NOT NULL,
    key           TEXT,
    first_sent_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (order_id, reference)
);
