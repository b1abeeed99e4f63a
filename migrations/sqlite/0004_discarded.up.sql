-- +goose Up
-- gorm-outbox schema, version 4: discarded events.
-- Dispatcher.Discard takes dead letters (failed rows) out of delivery for
-- good: it moves each into this table, with when it failed and when it
-- was discarded, and deletes it from outbox_records, in one transaction.
-- A row that is gone no longer holds back the later events of its
-- aggregate (the claim's order check takes a missing predecessor for a
-- delivered one, as after cleanup), and nothing requeues or delivers it.
-- The rows stay here for people to read, and for the check of sequences,
-- until someone deletes them; nothing in the library deletes them. id is
-- the row's id in outbox_records, which AUTOINCREMENT never reuses.
CREATE TABLE IF NOT EXISTS outbox_records_discarded (
	id                 INTEGER  PRIMARY KEY,
	event_id           TEXT     NOT NULL,
	event_type         TEXT     NOT NULL,
	aggregate_type     TEXT     NOT NULL,
	aggregate_id       TEXT     NOT NULL,
	aggregate_sequence INTEGER  NOT NULL,
	idempotency_key    TEXT     NOT NULL,
	payload            TEXT     NOT NULL,
	headers            TEXT,
	delivery_attempts  INTEGER  NOT NULL,
	last_error         TEXT,
	failure_kind       TEXT,
	occurred_at        DATETIME NOT NULL,
	created_at         DATETIME NOT NULL,
	failed_at          DATETIME NOT NULL,
	discarded_at       DATETIME NOT NULL
);

CREATE INDEX IF NOT EXISTS outbox_records_discarded_event_id ON outbox_records_discarded (event_id);

-- This version applied.
INSERT INTO outbox_records_migrations (version, name, applied_at)
VALUES (4, 'discarded', strftime('%Y-%m-%dT%H:%M:%SZ', 'now'));
