-- +goose Up
-- gorm-outbox schema, version 2: dead letters that stay dead.
-- failure_kind says why a failed row failed: 'permanent' (the publisher
-- said so, no handler, an unreadable row) or 'exhausted' (it ran out of
-- attempts). Only exhausted rows are revived by the retry_failed sweep,
-- and at most WithMaxRevivals times, counted in revivals. Rows that failed
-- before this version have no kind: the sweep leaves them, a person's
-- Requeue moves them.
ALTER TABLE outbox_records ADD COLUMN failure_kind TEXT
	CHECK (failure_kind IN ('permanent', 'exhausted'));

ALTER TABLE outbox_records ADD COLUMN revivals INTEGER NOT NULL DEFAULT 0;

-- This version applied.
INSERT INTO outbox_records_migrations (version, name, applied_at)
VALUES (2, 'dead_letters', strftime('%Y-%m-%dT%H:%M:%SZ', 'now'));
