-- +goose Up
-- gorm-outbox schema, version 1, for MySQL 8.0+ and MariaDB 10.6+: the
-- outbox table, its per-aggregate sequence table and their indexes. The
-- names are those of the default table, outbox_records; AutoMigrate
-- replaces them for outbox.WithTable. DDL commits on its own in MySQL, so
-- each table comes with its indexes in one statement.
--
-- Identifiers and keys are VARBINARY: compared byte for byte, as text is
-- on PostgreSQL and SQLite. A character column compares under a collation,
-- and every _ci one makes 'Key' the idempotency key 'key'; even the _bin
-- ones pad, making 'key ' a duplicate of 'key' in a unique index. Widths
-- are in bytes: 1020, the UTF-8 of the 255 characters that event
-- validation allows, and within InnoDB's 3072-byte index keys.
--
-- MySQL has no partial indexes. In their place, generated columns that are
-- NULL outside the rows an index serves. The claim reads due_at <= now in
-- the due index's order (due_at, id) and stops after the batch, locking
-- only the rows it keeps; an index on (delivery_state, next_attempt_at,
-- id) would read every due row of the three states and sort them, locking
-- all of them. A lookup by (aggregate_type, undelivered_id) reads only the
-- undelivered rows of the aggregate, not its delivered history. A column
-- that stays NULL costs no index write when other columns change.

-- The version table, in which each version records itself at its end, so
-- that AutoMigrate knows what applied, whichever tool applied it.
-- AutoMigrate creates it first, the same.
CREATE TABLE IF NOT EXISTS outbox_records_migrations (
	version    integer PRIMARY KEY,
	name       varchar(200) NOT NULL,
	applied_at varchar(40)  NOT NULL
);

CREATE TABLE IF NOT EXISTS outbox_records (
	id                 BIGINT        NOT NULL AUTO_INCREMENT,
	event_id           VARBINARY(1020) NOT NULL,
	event_type         VARBINARY(1020) NOT NULL,
	aggregate_type     VARBINARY(1020) NOT NULL,
	aggregate_id       VARBINARY(1020) NOT NULL,
	aggregate_sequence BIGINT        NOT NULL,
	idempotency_key    VARBINARY(1020) NOT NULL,
	payload            JSON          NOT NULL,
	headers            JSON,
	delivery_state     VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin NOT NULL DEFAULT 'pending'
		CHECK (delivery_state IN ('pending', 'delivering', 'delivered', 'retry', 'failed')),
	delivery_attempts  INT           NOT NULL DEFAULT 0,
	next_attempt_at    DATETIME(6)   NOT NULL,
	batch_id           VARCHAR(64) CHARACTER SET ascii COLLATE ascii_bin,
	last_error         TEXT,
	locked_until       DATETIME(6),
	occurred_at        DATETIME(6)   NOT NULL,
	created_at         DATETIME(6)   NOT NULL,
	updated_at         DATETIME(6)   NOT NULL,
	delivered_at       DATETIME(6),
	-- due_at: when a claimable row became claimable (due, and its lease,
	-- if any, passed); NULL for delivered and failed rows.
	due_at             DATETIME(6) GENERATED ALWAYS AS (CASE
		WHEN delivery_state IN ('pending', 'retry', 'delivering')
		THEN GREATEST(next_attempt_at, COALESCE(locked_until, next_attempt_at)) END) STORED,
	-- undelivered_id: the aggregate of a row not delivered yet; NULL once
	-- delivered, which takes the row out of its aggregate's index prefix.
	undelivered_id     VARBINARY(1020) GENERATED ALWAYS AS (CASE
		WHEN delivery_state <> 'delivered' THEN aggregate_id END) STORED,
	-- failed_at: when a failed row failed; NULL for every other row.
	failed_at          DATETIME(6) GENERATED ALWAYS AS (CASE
		WHEN delivery_state = 'failed' THEN updated_at END) STORED,
	PRIMARY KEY (id),
	UNIQUE KEY outbox_records_event_id_key (event_id),
	UNIQUE KEY outbox_records_idempotency_key_key (idempotency_key),
	-- due: the claim's scan, in its order.
	KEY outbox_records_due (due_at, id),
	-- aggregate: the per-aggregate order check and parking, over undelivered
	-- rows: a lookup by (aggregate_type, undelivered_id) reads none of the
	-- delivered history of the aggregate.
	KEY outbox_records_aggregate (aggregate_type, undelivered_id, aggregate_sequence),
	-- delivered: cleanup by age (only delivered rows have delivered_at).
	KEY outbox_records_delivered (delivered_at),
	-- failed: the retry_failed sweep and the requeue, oldest failure first.
	KEY outbox_records_failed (failed_at, id)
) ENGINE = InnoDB DEFAULT CHARACTER SET = utf8mb4;

CREATE TABLE IF NOT EXISTS outbox_records_sequences (
	aggregate_type VARBINARY(1020) NOT NULL,
	aggregate_id   VARBINARY(1020) NOT NULL,
	last_sequence  BIGINT NOT NULL,
	PRIMARY KEY (aggregate_type, aggregate_id)
) ENGINE = InnoDB DEFAULT CHARACTER SET = utf8mb4;

-- This version applied.
INSERT INTO outbox_records_migrations (version, name, applied_at)
VALUES (1, 'init', DATE_FORMAT(UTC_TIMESTAMP(), '%Y-%m-%dT%H:%i:%sZ'));
