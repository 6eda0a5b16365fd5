-- Named statements of resources/storage/replication.py: what a Postgres primary says of its
-- replication (read only).

-- commit_mode --
-- synchronous_commit, synchronous_standby_names, and whether this server is a standby.
SELECT current_setting('synchronous_commit'), current_setting('synchronous_standby_names'),
       pg_is_in_recovery();

-- standbys --
-- The standbys streaming from this server.
SELECT application_name, state, sync_state, replay_lag FROM pg_stat_replication;

-- managed_settings --
-- Settings a managed service adds (names starting with one of :patterns, an array).
SELECT name, setting FROM pg_settings WHERE name LIKE ANY (:patterns);
