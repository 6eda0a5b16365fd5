-- Named statements of engine/tenants.py (Tenants and the fair claim's bookkeeping), the owner of
-- tenants.

-- other_minimums --
-- The minimum shares of every tenant but one, added up.
SELECT COALESCE(SUM(min_share), 0) FROM tenants WHERE name <> :n;

-- set_tenant --
-- One tenant's weight and shares.
INSERT INTO tenants (name, weight, min_share, max_share, set_at, updated_at)
VALUES (:n, :w, :lo, :hi, :now, :now)
ON CONFLICT (name) DO UPDATE
SET weight = :w, min_share = :lo, max_share = :hi, set_at = :now, updated_at = :now;

-- list_tenants --
-- Every tenant set or served (not the scheduler's own rows, named ~...), by name.
SELECT name, weight, min_share, max_share, set_at, claimed FROM tenants
WHERE name NOT LIKE '~%'
ORDER BY name;

-- lock_clock --
-- Take the scheduler's lock (its clock row) and read the virtual clock.
UPDATE tenants SET updated_at = :now WHERE name = :c RETURNING pass;

-- start_clock --
-- The clock row again, in a table emptied by hand.
INSERT INTO tenants (name, updated_at) VALUES (:c, :now);

-- charge --
-- Each served tenant's pass and count, and the virtual clock, in one statement; {values} is
-- one (:nI, :pI, :kI, :now) group per row, placeholders only.
INSERT INTO tenants (name, pass, claimed, updated_at) VALUES {values}
ON CONFLICT (name) DO UPDATE
SET pass = excluded.pass, claimed = tenants.claimed + excluded.claimed,
    updated_at = excluded.updated_at;
