package outbox

import (
	"context"
	"strings"
	"time"

	"gorm.io/gorm"
)

type sqliteDialect struct{}

// sqliteTime is the one text form of timestamps in SQLite: fixed width and
// always UTC, so that text comparison is time comparison.
const sqliteTime = "2006-01-02 15:04:05.000000000+00:00"

func (sqliteDialect) bind(query string) string { return query }

func (sqliteDialect) timeArg(t time.Time) any { return t.UTC().Format(sqliteTime) }

func (sqliteDialect) schema(t tables) []string {
	return append([]string{
		// AUTOINCREMENT: ids are never reused after cleanup deletes the newest
		// rows, so id order stays insertion order.
		`CREATE TABLE IF NOT EXISTS ` + t.records + ` (
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
)`,
		`CREATE TABLE IF NOT EXISTS ` + t.sequences + ` (
	aggregate_type TEXT    NOT NULL,
	aggregate_id   TEXT    NOT NULL,
	last_sequence  INTEGER NOT NULL,
	PRIMARY KEY (aggregate_type, aggregate_id)
) WITHOUT ROWID`,
	}, commonIndexes(t)...)
}

func (d sqliteDialect) insertEvent(ctx context.Context, conn gorm.ConnPool, t tables, e *encodedEvent, now time.Time, _ bool) (bool, error) {
	var seq int64
	if err := conn.QueryRowContext(ctx, `INSERT INTO `+t.sequences+` (aggregate_type, aggregate_id, last_sequence)
VALUES (?, ?, 1)
ON CONFLICT (aggregate_type, aggregate_id) DO UPDATE SET last_sequence = last_sequence + 1
RETURNING last_sequence`, e.aggregateType, e.aggregateID).Scan(&seq); err != nil {
		return false, err
	}
	ts := d.timeArg(now)
	res, err := conn.ExecContext(ctx, `INSERT INTO `+t.records+` (event_id, event_type, aggregate_type,
	aggregate_id, aggregate_sequence, idempotency_key, payload, headers, delivery_state,
	delivery_attempts, next_attempt_at, occurred_at, created_at, updated_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'pending', 0, ?, ?, ?, ?)
ON CONFLICT (idempotency_key) DO NOTHING`,
		e.id, e.typ, e.aggregateType, e.aggregateID, seq, e.key, e.payload, e.headers,
		ts, d.timeArg(e.occurredAt), ts, ts)
	if err != nil {
		return false, err
	}
	if n, err := res.RowsAffected(); err != nil || n == 1 {
		return err == nil, err
	}
	return false, releaseSequence(ctx, d, conn, t, e)
}

func (sqliteDialect) skipLocked() string { return "" }

func (sqliteDialect) row(types ...string) string {
	return "(?" + strings.Repeat(", ?", len(types)-1) + ")"
}

func (sqliteDialect) listen(context.Context, *gorm.DB, tables, func()) error { return errNoListen }

// rejectsData: SQLite stores any text it is given; encode has checked it.
func (sqliteDialect) rejectsData(error) bool { return false }

// heldAt: claims on SQLite run one at a time, so a held row's predecessor is
// in flight in another batch, and a short recheck suffices.
func (sqliteDialect) heldAt(recheck string) string { return recheck }

func (sqliteDialect) greatest(a, b string) string { return "max(" + a + ", " + b + ")" }
