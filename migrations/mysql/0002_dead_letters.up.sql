-- +goose Up
-- gorm-outbox schema, version 2: dead letters that stay dead.
-- failure_kind says why a failed row failed: 'permanent' (the publisher
-- said so, no handler, an unreadable row) or 'exhausted' (it ran out of
-- attempts). Only exhausted rows are revived by the retry_failed sweep,
-- and at most WithMaxRevivals times, counted in revivals.
ALTER TABLE outbox_records
	ADD COLUMN failure_kind VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin
		CHECK (failure_kind IN ('permanent', 'exhausted')),
	ADD COLUMN revivals INT NOT NULL DEFAULT 0;

-- This version applied.
INSERT INTO outbox_records_migrations (version, name, applied_at)
VALUES (2, 'dead_letters', DATE_FORMAT(UTC_TIMESTAMP(), '%Y-%m-%dT%H:%i:%sZ'));
