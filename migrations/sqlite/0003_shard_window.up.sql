-- +goose Up
-- gorm-outbox schema, version 3: the shards' window.
-- Nothing changes on SQLite: its claims hold the database's write lock,
-- never overlap, and never claim by shard. The version is kept so that
-- every engine's schema has the same versions.

-- This version applied.
INSERT INTO outbox_records_migrations (version, name, applied_at)
VALUES (3, 'shard_window', strftime('%Y-%m-%dT%H:%M:%SZ', 'now'));
