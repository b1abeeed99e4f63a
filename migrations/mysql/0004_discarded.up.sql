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
-- the row's id in outbox_records. One statement, so that it applies whole
-- or not at all.
CREATE TABLE IF NOT EXISTS outbox_records_discarded (
	id                 BIGINT          NOT NULL,
	event_id           VARBINARY(1020) NOT NULL,
	event_type         VARBINARY(1020) NOT NULL,
	aggregate_type     VARBINARY(1020) NOT NULL,
	aggregate_id       VARBINARY(1020) NOT NULL,
	aggregate_sequence BIGINT          NOT NULL,
	idempotency_key    VARBINARY(1020) NOT NULL,
	payload            JSON            NOT NULL,
	headers            JSON,
	delivery_attempts  INT             NOT NULL,
	last_error         TEXT,
	failure_kind       VARCHAR(16) CHARACTER SET ascii COLLATE ascii_bin,
	occurred_at        DATETIME(6)     NOT NULL,
	created_at         DATETIME(6)     NOT NULL,
	failed_at          DATETIME(6)     NOT NULL,
	discarded_at       DATETIME(6)     NOT NULL,
	PRIMARY KEY (id),
	KEY outbox_records_discarded_event_id (event_id)
) ENGINE = InnoDB DEFAULT CHARACTER SET = utf8mb4;

-- This version applied.
INSERT INTO outbox_records_migrations (version, name, applied_at)
VALUES (4, 'discarded', DATE_FORMAT(UTC_TIMESTAMP(), '%Y-%m-%dT%H:%i:%sZ'));
