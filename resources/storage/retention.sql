-- The statements of resources/storage/retention.py (Expiry): templates over a table its owner
-- names, with {table}, {key}, {where} (the owner's condition), {child} and {column} filled
-- from the owners' code, never from input. A block in retention.postgresql.sql wins there.

-- choose_batch --
-- Up to :_batch_size expired rows' keys.
SELECT {key} FROM {table} WHERE {where} LIMIT :_batch_size;

-- delete_children --
-- The rows of a child table that point at the chosen keys (:_keys expanding).
DELETE FROM {child} WHERE {column} IN :_keys;

-- delete_rows --
-- The chosen rows (:_keys expanding), while the condition still holds.
DELETE FROM {table} WHERE ({key}) IN :_keys AND ({where});

-- count_expired --
-- How many rows the condition holds for.
SELECT COUNT(*) FROM {table} WHERE {where};

-- count_rows --
-- Every row of a table.
SELECT COUNT(*) FROM {table};
