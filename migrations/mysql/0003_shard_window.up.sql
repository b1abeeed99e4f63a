-- +goose Up
-- gorm-outbox schema, version 3: the shards' window.
-- Dispatchers that hold each other back claim by shard: the due rows of
-- one eighth of the aggregates, by a hash of aggregate type and id
-- (docs/design.md, "Shards"). shard is that hash, and the index serves a
-- shard's window in its order, so that its claim reads and locks the rows
-- it takes and stops, as the unsharded claim does on outbox_records_due;
-- without it the claim read, locked and filtered eight rows for each it
-- took. One statement, so that it applies whole or not at all.
ALTER TABLE outbox_records
	ADD COLUMN shard TINYINT UNSIGNED GENERATED ALWAYS AS (CRC32(CONCAT(aggregate_type, '/', aggregate_id)) & 7) STORED,
	ADD KEY outbox_records_due_shard (shard, due_at, id);

-- This version applied.
INSERT INTO outbox_records_migrations (version, name, applied_at)
VALUES (3, 'shard_window', DATE_FORMAT(UTC_TIMESTAMP(), '%Y-%m-%dT%H:%i:%sZ'));
