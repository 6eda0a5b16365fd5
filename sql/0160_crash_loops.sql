-- Crash loops (resources/idempotency/store.py): the ledger counts the takeovers of a key whose
-- previous holder was running its handler alone when its lease expired (``crashes``), so a key
-- that kills its worker every time is dead-lettered as ``crash_loop`` after a bounded number of
-- deaths. ``solo_fence`` is the fence of the claim that runs its handler alone (a per-request
-- claim, or a suspect isolated in a batch); a claim of a micro-batch or fan-out group leaves it
-- behind, so a group's death counts against none of its members. The previous release writes
-- neither: its claims never count, which only delays the bound.
ALTER TABLE idempotency_records ADD COLUMN IF NOT EXISTS crashes INTEGER NOT NULL DEFAULT 0;
ALTER TABLE idempotency_records ADD COLUMN IF NOT EXISTS solo_fence BIGINT;
