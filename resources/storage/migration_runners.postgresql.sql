-- The statements of resources/storage/migration_runners.sql whose Postgres text differs.

-- add_replaced_by --
-- replaced_by where a previous release's records table lacks it (another upgrader may add it
-- meanwhile).
ALTER TABLE sekali_schema_migrations ADD COLUMN IF NOT EXISTS replaced_by TEXT;
