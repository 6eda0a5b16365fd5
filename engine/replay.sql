-- Named statements of engine/replay.py (Versions and amend), the owner of request_versions.

-- version_of_key --
-- The version that made one key.
SELECT base_key, version, key, job_type, request_id, previous_key, previous_request_id,
       previous_record_id, actor, reason, diff, created_at
FROM request_versions
WHERE key = :k;

-- version_after_key --
-- The version that superseded one key.
SELECT base_key, version, key, job_type, request_id, previous_key, previous_request_id,
       previous_record_id, actor, reason, diff, created_at
FROM request_versions
WHERE previous_key = :k;

-- chain --
-- Every version of one intent, oldest first.
SELECT base_key, version, key, job_type, request_id, previous_key, previous_request_id,
       previous_record_id, actor, reason, diff, created_at
FROM request_versions
WHERE base_key = :b
ORDER BY version;

-- versions_of_records --
-- The versions made from some DLQ records (:ids expanding), oldest first.
SELECT base_key, version, key, job_type, request_id, previous_key, previous_request_id,
       previous_record_id, actor, reason, diff, created_at
FROM request_versions
WHERE previous_record_id IN :ids
ORDER BY created_at;

-- link_version --
-- One amended version of an intent; nothing when another amendment made it first.
INSERT INTO request_versions (base_key, version, key, job_type, previous_key,
    previous_request_id, previous_record_id, actor, reason, diff, created_at)
VALUES (:base, :version, :key, :jt, :prev, :preq, :prec, :actor, :reason, :diff, :now)
ON CONFLICT DO NOTHING;

-- set_version_request --
-- The request a version was enqueued as.
UPDATE request_versions SET request_id = :rid WHERE key = :key;

-- superseding_version --
-- The key and number of the version that superseded one key.
SELECT key, version FROM request_versions WHERE previous_key = :k;
