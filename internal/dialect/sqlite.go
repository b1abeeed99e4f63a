package dialect

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"fmt"
	"strings"
	"time"

	"gorm.io/gorm"
)

// sqliteDialect is SQLite, through mattn/go-sqlite3 (gorm.io/driver/sqlite,
// cgo) or the pure-Go modernc.org/sqlite (github.com/glebarez/sqlite).
// A claim holds the database's write lock from its first read to its
// lease (BEGIN IMMEDIATE), so it needs no row locks; lists travel as JSON
// text, read with json_each; timestamps are text in one fixed-width UTC
// form; there are no notifications.
type sqliteDialect struct{}

// sqliteTime is the one text form of timestamps in SQLite: fixed width and
// always UTC, so that text comparison is time comparison.
const sqliteTime = "2006-01-02 15:04:05.000000000+00:00"

func (sqliteDialect) Name() string { return "sqlite" }

func (sqliteDialect) Tables(name string) Tables { return TablesFor(name) }

func (sqliteDialect) Bind(query string) string { return query }

func (sqliteDialect) TimeArg(t time.Time) any { return t.UTC().Format(sqliteTime) }

// ReadTime returns the stored text: mattn/go-sqlite3 reads a DATETIME
// column's text that it cannot parse as the zero time, without an error.
func (sqliteDialect) ReadTime(column string) string { return "CAST(" + column + " AS TEXT)" }

func (sqliteDialect) IDList(ids []int64) any { return jsonList(ids) }

func (sqliteDialect) TextList(s []string) any { return jsonTexts(s) }

func (sqliteDialect) EventList(events []Position) []any { return jsonEvents(events) }

// Statements. Placeholders are numbered (?1, ?2, ...) so that an argument
// serves twice. Nothing locks rows: ClaimTx holds the database.
func (d sqliteDialect) Statements(t Tables) Statements {
	r := t.Records
	return Statements{
		Window: `SELECT id, aggregate_type, aggregate_id, aggregate_sequence FROM ` + r + `
WHERE delivery_state IN ('pending', 'retry', 'delivering') AND next_attempt_at <= ?1
	AND (locked_until IS NULL OR locked_until <= ?1)
ORDER BY next_attempt_at, id
LIMIT ?2`,

		Undelivered: `SELECT (
	SELECT CASE
		WHEN p.delivery_state = 'delivering' AND p.locked_until > ?1 THEN 'flight'
		WHEN p.delivery_state IN ('pending', 'retry') AND p.next_attempt_at <= ?1 AND p.next_attempt_at <= (
			SELECT n.next_attempt_at FROM ` + r + ` n
			WHERE n.aggregate_type = p.aggregate_type AND n.aggregate_id = p.aggregate_id
				AND n.aggregate_sequence = p.aggregate_sequence + 1 AND n.delivery_state <> 'delivered') THEN 'flight'
		ELSE 'waits' END
	FROM ` + r + ` p
	WHERE p.aggregate_type = json_extract(u.value, '$[0]') AND p.aggregate_id = json_extract(u.value, '$[1]') AND p.aggregate_sequence = json_extract(u.value, '$[2]')
		AND p.delivery_state <> 'delivered')
FROM json_each(?2) AS u
ORDER BY u.key`,

		Lease: `UPDATE ` + r + ` SET
	delivery_state = 'delivering', batch_id = ?1, locked_until = ?2, next_attempt_at = ?2, updated_at = ?3
WHERE id IN (SELECT value FROM json_each(?4))
RETURNING id, event_id, event_type, aggregate_type, aggregate_id, aggregate_sequence,
	idempotency_key, payload, headers, CAST(occurred_at AS TEXT), delivery_attempts`,

		SettleDelivered: `UPDATE ` + r + ` SET
	delivery_state = 'delivered', delivery_attempts = delivery_attempts + 1, next_attempt_at = ?1,
	last_error = NULL, failure_kind = NULL, locked_until = NULL, delivered_at = ?1, updated_at = ?1
WHERE id IN (SELECT value FROM json_each(?3)) AND batch_id = ?2 AND delivery_state = 'delivering'`,

		SettleOther: `UPDATE ` + r + ` SET
	delivery_state = ?1, delivery_attempts = ?2, next_attempt_at = ?3,
	last_error = coalesce(?4, last_error), failure_kind = ?5, locked_until = NULL, updated_at = ?6
WHERE id IN (SELECT value FROM json_each(?8)) AND batch_id = ?7 AND delivery_state = 'delivering'`,

		Blockers: `WITH seen AS MATERIALIZED (
	SELECT c.aggregate_type AS bt, c.aggregate_id AS ba, min(c.next_attempt_at) AS fn FROM (
		SELECT aggregate_type, aggregate_id, aggregate_sequence, next_attempt_at FROM ` + r + `
		WHERE delivery_state IN ('pending', 'retry', 'delivering') AND next_attempt_at <= ?1
		ORDER BY next_attempt_at, id
		LIMIT ?2
	) c
	GROUP BY c.aggregate_type, c.aggregate_id
	HAVING max(c.aggregate_sequence) > 1
), heads AS MATERIALIZED (
	SELECT bt, ba, fn, (SELECT min(m.aggregate_sequence) FROM ` + r + ` m
		WHERE m.aggregate_type = bt AND m.aggregate_id = ba AND m.delivery_state <> 'delivered') AS hs
	FROM seen
), waits AS MATERIALIZED (
	SELECT bt, ba, hs, (SELECT CASE
			WHEN h.delivery_state = 'failed' THEN 'failed'
			WHEN h.delivery_state IN ('pending', 'retry') AND h.next_attempt_at > fn THEN h.delivery_state
			WHEN h.delivery_state = 'delivering' AND h.locked_until <= ?1 AND h.next_attempt_at > fn THEN 'delivering'
		END FROM ` + r + ` h
		WHERE h.aggregate_type = bt AND h.aggregate_id = ba AND h.aggregate_sequence = hs
			AND h.delivery_state <> 'delivered') AS state
	FROM heads
	WHERE hs IS NOT NULL
)
SELECT bt, ba, hs, state, CASE WHEN state = 'failed' THEN ?3 ELSE (SELECT CAST(h.next_attempt_at AS TEXT) FROM ` + r + ` h
		WHERE h.aggregate_type = bt AND h.aggregate_id = ba AND h.aggregate_sequence = hs) END
FROM waits WHERE state IS NOT NULL`,

		Park: `UPDATE ` + r + ` SET next_attempt_at = ?1, updated_at = ?2
WHERE aggregate_type = ?3 AND aggregate_id = ?4 AND aggregate_sequence > ?5
	AND delivery_state IN ('pending', 'retry') AND next_attempt_at < ?1
	AND EXISTS (SELECT 1 FROM ` + r + ` h
		WHERE h.aggregate_type = ?3 AND h.aggregate_id = ?4 AND h.aggregate_sequence = ?5
			AND h.delivery_state = ?6)`,

		Unpark: `UPDATE ` + r + ` SET next_attempt_at = ?1, updated_at = ?1
WHERE delivery_state IN ('pending', 'retry') AND next_attempt_at > ?1
	AND (aggregate_type, aggregate_id) IN (
		SELECT json_extract(value, '$[0]'), json_extract(value, '$[1]') FROM json_each(?2))`,

		Revive: `UPDATE ` + r + ` SET
	delivery_state = 'pending', delivery_attempts = 0, revivals = revivals + 1, failure_kind = NULL,
	next_attempt_at = ?1, updated_at = ?1, locked_until = NULL, batch_id = NULL
WHERE id IN (
	SELECT id FROM ` + r + `
	WHERE delivery_state = 'failed' AND failure_kind = 'exhausted' AND revivals < ?2
	ORDER BY updated_at, id
	LIMIT ?3
)
RETURNING aggregate_type, aggregate_id`,

		Requeue: `UPDATE ` + r + ` SET
	delivery_state = 'pending', delivery_attempts = 0, revivals = 0, failure_kind = NULL,
	next_attempt_at = ?1, updated_at = ?1, locked_until = NULL, batch_id = NULL
WHERE id IN (
	SELECT id FROM ` + r + `
	WHERE delivery_state = 'failed'
		AND (?3 IS NULL OR updated_at < ?3)
		AND (?4 IS NULL OR event_id IN (SELECT value FROM json_each(?4)))
		AND (?5 IS NULL OR event_type IN (SELECT value FROM json_each(?5)))
	ORDER BY updated_at, id
	LIMIT ?2
)
RETURNING aggregate_type, aggregate_id`,

		Discard: `SELECT id, event_id, event_type, aggregate_type, aggregate_id, aggregate_sequence
FROM ` + r + `
WHERE delivery_state = 'failed'
	AND (?2 IS NULL OR updated_at < ?2)
	AND (?3 IS NULL OR event_id IN (SELECT value FROM json_each(?3)))
	AND (?4 IS NULL OR event_type IN (SELECT value FROM json_each(?4)))
ORDER BY updated_at, id
LIMIT ?1`,

		Cleanup: `DELETE FROM ` + r + ` WHERE id IN (
	SELECT id FROM ` + r + ` WHERE delivery_state = 'delivered' AND delivered_at < ?1
	ORDER BY delivered_at
	LIMIT ?2
)`,

		Counts: `SELECT delivery_state, count(*) FROM ` + r + ` GROUP BY delivery_state`,
		OldestDue: `SELECT CAST(min(next_attempt_at) AS TEXT) FROM ` + r + `
WHERE delivery_state IN ('pending', 'retry', 'delivering') AND next_attempt_at <= ?1
	AND (locked_until IS NULL OR locked_until <= ?1)`,
		LastFailure: `SELECT last_error FROM ` + r + ` WHERE delivery_state = 'failed' ORDER BY updated_at DESC, id DESC LIMIT 1`,
	}
}

// ClaimTx runs fn inside immediate, so that the claim's reads and its
// lease see one state of the database.
func (sqliteDialect) ClaimTx(ctx context.Context, db *gorm.DB, fn func(q Querier) error) error {
	return immediate(ctx, db, func(conn *sql.Conn) error { return fn(conn) })
}

// MigrateTx: SQLite's DDL is transactional, and the write lock that
// immediate takes first makes concurrent migrations queue.
func (sqliteDialect) MigrateTx(ctx context.Context, db *gorm.DB, _ Tables, fn func(q Querier) error) error {
	return immediate(ctx, db, func(conn *sql.Conn) error { return fn(conn) })
}

// CheckPool: immediate takes a connection of its own from db.DB(), which
// needs a *sql.DB behind the pool.
func (sqliteDialect) CheckPool(db *gorm.DB) error {
	if _, err := db.DB(); err != nil {
		return fmt.Errorf("the connection pool (%T) has no *sql.DB behind it, from which a claim takes a connection of its own: %w", db.Statement.ConnPool, err)
	}
	return nil
}

func (sqliteDialect) Listen(context.Context, *gorm.DB, Tables, func()) error { return ErrNoListen }

// LockConflict: the dispatcher's statements never wait for a lock
// long enough to be ended for it.
func (sqliteDialect) LockConflict(error) bool { return false }

// sqliteConstraintCheck is SQLITE_CONSTRAINT_CHECK, the extended result
// code of a CHECK constraint's failure.
const sqliteConstraintCheck = 19 | 1<<8

// RejectsData: SQLite stores any text and number it is given; the values
// it refuses are those the schema's CHECK constraints refuse, such as a
// payload that encoding/json accepts and SQLite's JSON parser does not
// (nested deeper than its limit of 1000).
func (sqliteDialect) RejectsData(err error) bool {
	code, ok := sqliteCode(err)
	return ok && code == sqliteConstraintCheck
}

// immediate runs fn in a transaction that holds the database's write lock
// from start to end (BEGIN IMMEDIATE on a connection of its own), so that
// no other claim or writer runs between a claim's reads and its lease: in
// a deferred transaction, a write after another connection's commit fails
// with SQLITE_BUSY instead of waiting.
func immediate(ctx context.Context, db *gorm.DB, fn func(conn *sql.Conn) error) (err error) {
	sqlDB, err := db.DB()
	if err != nil {
		return err
	}
	conn, err := sqlDB.Conn(ctx)
	if err != nil {
		return err
	}
	defer conn.Close()
	if _, err := conn.ExecContext(ctx, "BEGIN IMMEDIATE"); err != nil {
		return err
	}
	defer func() {
		if err == nil {
			return
		}
		if _, rerr := conn.ExecContext(context.WithoutCancel(ctx), "ROLLBACK"); rerr != nil {
			// A connection that may still be inside the transaction must
			// not go back to the pool, holding the write lock.
			_ = conn.Raw(func(any) error { return driver.ErrBadConn })
		}
	}()
	if err := fn(conn); err != nil {
		return err
	}
	_, err = conn.ExecContext(ctx, "COMMIT")
	return err
}

func (d sqliteDialect) InsertEvent(ctx context.Context, conn gorm.ConnPool, t Tables, e *Record, now time.Time, _ bool) (bool, error) {
	var seq int64
	if err := conn.QueryRowContext(ctx, `INSERT INTO `+t.Sequences+` (aggregate_type, aggregate_id, last_sequence)
VALUES (?, ?, 1)
ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET last_sequence = last_sequence + 1
RETURNING last_sequence`, e.AggregateType, e.AggregateID).Scan(&seq); err != nil {
		return false, err
	}
	ts := d.TimeArg(now)
	res, err := conn.ExecContext(ctx, `INSERT INTO `+t.Records+` (event_id, event_type, aggregate_type,
	aggregate_id, aggregate_sequence, idempotency_key, payload, headers, delivery_state,
	delivery_attempts, next_attempt_at, occurred_at, created_at, updated_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'pending', 0, ?, ?, ?, ?)
ON CONFLICT (idempotency_key) DO NOTHING`,
		e.ID, e.Type, e.AggregateType, e.AggregateID, seq, e.Key, e.Payload, e.Headers,
		ts, d.TimeArg(e.OccurredAt), ts, ts)
	if err != nil {
		return false, err
	}
	if n, err := res.RowsAffected(); err != nil || n == 1 {
		return err == nil, err
	}
	return false, releaseSequence(ctx, d, conn, t, e)
}

// Settings: a database file (not one in memory) needs the WAL journal
// mode, and a busy timeout.
func (sqliteDialect) Settings(ctx context.Context, conn gorm.ConnPool, _ Tables) []Warning {
	var ws []Warning
	var file string
	if err := conn.QueryRowContext(ctx, `SELECT file FROM pragma_database_list WHERE name = 'main'`).Scan(&file); err != nil {
		ws = append(ws, Warning{Check: "sqlite database file", Err: err})
		return ws
	}
	if file == "" {
		return ws // in memory, or temporary: no WAL, and no other process
	}
	var mode string
	if err := conn.QueryRowContext(ctx, `PRAGMA journal_mode`).Scan(&mode); err != nil {
		ws = append(ws, Warning{Check: "sqlite journal_mode", Err: err})
	} else if !strings.EqualFold(mode, "wal") {
		ws = append(ws, Warning{Message: "outbox: SQLite runs without the WAL journal mode: the dispatcher's reads and the writers' transactions then block each other, and writes fail with \"database is locked\"; open the database with _journal_mode=WAL, as in file:app.db?_busy_timeout=5000&_journal_mode=WAL&_txlock=immediate (mattn/go-sqlite3) or file:app.db?_pragma=busy_timeout(5000)&_pragma=journal_mode(WAL)&_txlock=immediate (glebarez/sqlite, modernc.org/sqlite)", Attrs: []any{"journal_mode", mode, "file", file}})
	}
	var timeout int
	if err := conn.QueryRowContext(ctx, `PRAGMA busy_timeout`).Scan(&timeout); err != nil {
		ws = append(ws, Warning{Check: "sqlite busy_timeout", Err: err})
	} else if timeout <= 0 {
		ws = append(ws, Warning{Message: "outbox: SQLite runs without a busy timeout: a transaction that meets another's lock fails at once with \"database is locked\" instead of waiting for it; open the database with a busy timeout, as in file:app.db?_busy_timeout=5000&_journal_mode=WAL&_txlock=immediate (mattn/go-sqlite3) or file:app.db?_pragma=busy_timeout(5000)&_pragma=journal_mode(WAL)&_txlock=immediate (glebarez/sqlite, modernc.org/sqlite)", Attrs: []any{"busy_timeout", timeout, "file", file}})
	}
	return ws
}

// CheckConn: nothing to check.
func (sqliteDialect) CheckConn(context.Context, gorm.ConnPool) error { return nil }
