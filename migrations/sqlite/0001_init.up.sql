-- +goose Up
-- gorm-outbox schema, version 1: the outbox table, its per-aggregate
-- sequence table and their indexes, as AutoMigrate created them before
-- migrations were versioned (hence IF NOT EXISTS: a table made then is
-- taken as it is). The names are those of the default table,
-- outbox_records; AutoMigrate replaces them for outbox.WithTable.
-- Timestamps are text in one fixed-width UTC form, so that text order is
-- time order. AUTOINCREMENT: ids are never reused, so id order stays
-- insertion order after cleanup.

-- The version table, in which each version records itself at its end, so
-- that AutoMigrate knows what applied, whichever tool applied it.
-- AutoMigrate creates it first, the same.
CREATE TABLE IF NOT EXISTS outbox_records_migrations (
	version    integer PRIMARY KEY,
	name       varchar(200) NOT NULL,
	applied_at varchar(40)  NOT NULL
);

CREATE TABLE IF NOT EXISTS outbox_records (
	id                 INTEGER  PRIMARY KEY AUTOINCREMENT,
	event_id           TEXT     NOT NULL UNIQUE,
	event_type         TEXT     NOT NULL,
	aggregate_type     TEXT     NOT NULL,
	aggregate_id       TEXT     NOT NULL,
	aggregate_sequence INTEGER  NOT NULL,
	idempotency_key    TEXT     NOT NULL UNIQUE,
	payload            TEXT     NOT NULL CHECK (json_valid(payload)),
	headers            TEXT     CHECK (headers IS NULL OR json_valid(headers)),
	delivery_state     TEXT     NOT NULL DEFAULT 'pending'
		CHECK (delivery_state IN ('pending', 'delivering', 'delivered', 'retry', 'failed')),
	delivery_attempts  INTEGER  NOT NULL DEFAULT 0,
	next_attempt_at    DATETIME NOT NULL,
	batch_id           TEXT,
	last_error         TEXT,
	locked_until       DATETIME,
	occurred_at        DATETIME NOT NULL,
	created_at         DATETIME NOT NULL,
	updated_at         DATETIME NOT NULL,
	delivered_at       DATETIME
);

CREATE TABLE IF NOT EXISTS outbox_records_sequences (
	aggregate_type TEXT    NOT NULL,
	aggregate_id   TEXT    NOT NULL,
	last_sequence  INTEGER NOT NULL,
	PRIMARY KEY (aggregate_type, aggregate_id)
) WITHOUT ROWID;

-- All indexes are partial, so that their size follows the live rows.
CREATE INDEX IF NOT EXISTS outbox_records_due ON outbox_records (next_attempt_at, id)
	WHERE delivery_state IN ('pending', 'retry', 'delivering');

CREATE INDEX IF NOT EXISTS outbox_records_aggregate ON outbox_records (aggregate_type, aggregate_id, aggregate_sequence)
	WHERE delivery_state <> 'delivered';

CREATE INDEX IF NOT EXISTS outbox_records_delivered ON outbox_records (delivered_at)
	WHERE delivery_state = 'delivered';

CREATE INDEX IF NOT EXISTS outbox_records_failed ON outbox_records (updated_at, id)
	WHERE delivery_state = 'failed';

-- This version applied.
INSERT INTO outbox_records_migrations (version, name, applied_at)
VALUES (1, 'init', strftime('%Y-%m-%dT%H:%M:%SZ', 'now'));
