-- When a charge of the order last went out (pipelines/jobs/payment.py writes it before the POST).
-- With payment_status 'charged_not_confirmed' and no charge_id the outcome of that send is
-- unknown: nothing charges again until a lookup after charge_sent_at + the settle window.
ALTER TABLE orders ADD COLUMN charge_sent_at DOUBLE PRECISION;
