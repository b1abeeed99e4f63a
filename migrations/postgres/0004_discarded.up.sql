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
-- the row's id in outbox_records, which is never reused.
CREATE TABLE IF NOT EXISTS outbox_records_discarded (
	id                 bigint      PRIMARY KEY,
	event_id           text        NOT NULL,
	event_type         text        NOT NULL,
	aggregate_type     text        NOT NULL,
	aggregate_id       text        NOT NULL,
	aggregate_sequence bigint      NOT NULL,
	idempotency_key    text        NOT NULL,
	payload            jsonb       NOT NULL,
	headers            jsonb,
	delivery_attempts  integer     NOT NULL,
	last_error         text,
	failure_kind       text,
	occurred_at        timestamptz NOT NULL,
	created_at         timestamptz NOT NULL,
	failed_at          timestamptz NOT NULL,
	discarded_at       timestamptz NOT NULL
);

CREATE INDEX IF NOT EXISTS outbox_records_discarded_event_id ON outbox_records_discarded (event_id);

-- This version applied.
INSERT INTO outbox_records_migrations (version, name, applied_at)
VALUES (4, 'discarded', to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"'));
