-- Named statements of engine/upkeep/reconciliation.py (Reconciler), the owner of
-- reconciliation_actions.

-- action_done --
-- Whether one compensation was recorded.
SELECT 1 FROM reconciliation_actions WHERE action_key = :k;

-- record_action --
-- Record one compensation, once, in the transaction that applied it.
INSERT INTO reconciliation_actions (action_key, kind, subject, detail, created_at)
VALUES (:k, :kind, :s, :d, :now)
ON CONFLICT (action_key) DO NOTHING;

-- stuck_claims --
-- Claims whose lease ran out before :cutoff, but the reconciler's own and compensations.
SELECT key, fence FROM idempotency_records
WHERE status = 'in_progress' AND lease_expires_at <= :cutoff
  AND key NOT LIKE 'reconcile:%' AND key NOT LIKE 'compensate:%'
ORDER BY key;
