-- +goose Up
-- gorm-outbox schema, version 3: the shards' window.
-- Dispatchers that hold each other back claim by shard: the due rows of
-- one eighth of the aggregates, by a hash of aggregate type and id
-- (docs/design.md, "Shards"). This index serves that window in its order,
-- so that a shard's claim reads the rows it takes and stops, as the
-- unsharded claim does on outbox_records_due; without it the claim
-- filtered every due row. The statistics tell the planner how many rows a
-- shard holds (those of a partial index's expression are not used), so
-- that it chooses the index over reading and sorting the whole shard.
CREATE INDEX IF NOT EXISTS outbox_records_due_shard ON outbox_records
	((hashtext(aggregate_type || '/' || aggregate_id) & 7), next_attempt_at, id)
	WHERE delivery_state IN ('pending', 'retry', 'delivering');

CREATE STATISTICS IF NOT EXISTS outbox_records_shard
	ON (hashtext(aggregate_type || '/' || aggregate_id) & 7) FROM outbox_records;

-- This version applied.
INSERT INTO outbox_records_migrations (version, name, applied_at)
VALUES (3, 'shard_window', to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"'));
