-- Fenced writes record who wrote with the highest fence, so an equal fence from another holder is
-- refused (resources/locks/fencing.py): a Redis that lost recent writes could once hand one token
-- to two holders. Applied in the same transaction as its record, so no IF NOT EXISTS is needed.
ALTER TABLE fence_registry ADD COLUMN holder TEXT;
