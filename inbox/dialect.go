package inbox

import (
	"context"
	"database/sql"
	"fmt"
	"hash/fnv"
	"strconv"
	"time"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
)

// dialect holds every piece of SQL that differs between the engines. A
// further engine is one more implementation and one more case in
// dialectOf.
type dialect interface {
	// quote quotes an identifier.
	quote(ident string) string
	// timeArg encodes a timestamp argument so that the engine compares it
	// correctly with stored timestamps.
	timeArg(t time.Time) any
	// steps returns the schema's migrations: steps(t)[i] takes the schema
	// from version i to version i+1. Every statement is idempotent, so
	// that where DDL does not roll back a step interrupted halfway can run
	// again.
	steps(t tables) [][]string
	// locked runs fn on one connection while holding the migration lock of
	// t, inside a transaction where the engine's DDL is transactional.
	locked(ctx context.Context, db *gorm.DB, t tables, fn func(q execer) error) error
	// bootstrap returns the statements that create the schema version
	// table and its one row, at version 0, unless they exist.
	bootstrap(t tables) []string
	// insert records id in tx and reports whether it did: false when the
	// id was recorded already, once the transaction that recorded it has
	// committed (one still open makes insert wait; one that rolls back
	// lets insert record the id).
	insert(tx *gorm.DB, t tables, id string, typ *string, now time.Time) (bool, error)
	// cleanupSQL deletes at most ? (the second argument) rows whose
	// handled_at is before ? (the first).
	cleanupSQL(t tables) string
}

// execer is a connection or transaction that migrations run on.
type execer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// dialectOf returns the dialect for db's engine.
func dialectOf(db *gorm.DB) (dialect, error) {
	switch name := db.Dialector.Name(); name {
	case "postgres":
		return postgresDialect{}, nil
	case "sqlite":
		return sqliteDialect{}, nil
	case "mysql":
		return mysqlDialect{}, nil
	default:
		return nil, fmt.Errorf("%w: inbox.New: unsupported database %q (PostgreSQL, SQLite and MySQL/MariaDB are supported)", outbox.ErrInvalidOption, name)
	}
}

// tables holds the quoted names derived from the configured table name.
type tables struct {
	name    string // unquoted, as configured
	records string
	schema  string
	index   string // the index on handled_at
}

func tablesFor(d dialect, name string) tables {
	return tables{
		name:    name,
		records: d.quote(name),
		schema:  d.quote(name + "_schema"),
		index:   d.quote(name + "_handled_at"),
	}
}

// lockKey is the number or name under which migrations of t queue.
func lockKey(t tables) uint32 {
	h := fnv.New32a()
	h.Write([]byte("gorm-outbox-inbox:" + t.name))
	return h.Sum32()
}

// cleanupInSQL is the cleanup of the engines whose DELETE has no LIMIT: a
// subquery picks the oldest rows.
func cleanupInSQL(t tables) string {
	return `DELETE FROM ` + t.records + ` WHERE message_id IN (
	SELECT message_id FROM ` + t.records + ` WHERE handled_at < ? ORDER BY handled_at LIMIT ?)`
}

// --- SQLite ---

type sqliteDialect struct{}

// sqliteTime is the text form of timestamps in SQLite, as the outbox
// stores them: fixed width and always UTC, so that text comparison is time
// comparison.
const sqliteTime = "2006-01-02 15:04:05.000000000+00:00"

func (sqliteDialect) quote(ident string) string { return `"` + ident + `"` }

func (sqliteDialect) timeArg(t time.Time) any { return t.UTC().Format(sqliteTime) }

func (sqliteDialect) bootstrap(t tables) []string {
	return []string{
		`CREATE TABLE IF NOT EXISTS ` + t.schema + ` (
	id      INTEGER NOT NULL PRIMARY KEY CHECK (id = 1),
	version INTEGER NOT NULL
)`,
		`INSERT INTO ` + t.schema + ` (id, version) VALUES (1, 0) ON CONFLICT (id) DO NOTHING`,
	}
}

func (sqliteDialect) steps(t tables) [][]string {
	return [][]string{{
		`CREATE TABLE IF NOT EXISTS ` + t.records + ` (
	message_id   TEXT     NOT NULL PRIMARY KEY,
	message_type TEXT,
	handled_at   DATETIME NOT NULL
) WITHOUT ROWID`,
		`CREATE INDEX IF NOT EXISTS ` + t.index + ` ON ` + t.records + ` (handled_at)`,
	}}
}

// locked runs fn in BEGIN IMMEDIATE on a connection of its own: the
// database's write lock, taken before anything is read, queues concurrent
// migrations (for as long as the busy timeout allows) whatever the DSN's
// _txlock says.
func (sqliteDialect) locked(ctx context.Context, db *gorm.DB, _ tables, fn func(q execer) error) (err error) {
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
	if err := fn(conn); err != nil {
		// A fresh context: the rollback must run even when ctx has ended.
		_, _ = conn.ExecContext(context.Background(), "ROLLBACK")
		return err
	}
	_, err = conn.ExecContext(ctx, "COMMIT")
	return err
}

// insert needs no lock of its own: the insert is the transaction's first
// statement, so it takes the database's write lock (at BEGIN with
// _txlock=immediate, here otherwise), waiting for a concurrent delivery's
// transaction to end, and then sees its row or its absence.
func (d sqliteDialect) insert(tx *gorm.DB, t tables, id string, typ *string, now time.Time) (bool, error) {
	res := tx.Exec(`INSERT INTO `+t.records+` (message_id, message_type, handled_at) VALUES (?, ?, ?)
ON CONFLICT (message_id) DO NOTHING`, id, typ, d.timeArg(now))
	return res.RowsAffected == 1, res.Error
}

func (sqliteDialect) cleanupSQL(t tables) string { return cleanupInSQL(t) }

// --- PostgreSQL ---

type postgresDialect struct{}

func (postgresDialect) quote(ident string) string { return `"` + ident + `"` }

func (postgresDialect) timeArg(t time.Time) any { return t.UTC() }

func (postgresDialect) bootstrap(t tables) []string {
	return []string{
		`CREATE TABLE IF NOT EXISTS ` + t.schema + ` (
	id      integer NOT NULL PRIMARY KEY CHECK (id = 1),
	version integer NOT NULL
)`,
		`INSERT INTO ` + t.schema + ` (id, version) VALUES (1, 0) ON CONFLICT (id) DO NOTHING`,
	}
}

func (postgresDialect) steps(t tables) [][]string {
	return [][]string{{
		`CREATE TABLE IF NOT EXISTS ` + t.records + ` (
	message_id   text        NOT NULL PRIMARY KEY,
	message_type text,
	handled_at   timestamptz NOT NULL
)`,
		`CREATE INDEX IF NOT EXISTS ` + t.index + ` ON ` + t.records + ` (handled_at)`,
	}}
}

// locked runs fn in a transaction that first takes a transaction-level
// advisory lock, so that replicas migrating at the same start-up queue
// instead of racing on the catalog.
func (postgresDialect) locked(ctx context.Context, db *gorm.DB, t tables, fn func(q execer) error) error {
	return db.WithContext(ctx).Transaction(func(tx *gorm.DB) error {
		q, ok := tx.Statement.ConnPool.(execer)
		if !ok {
			return fmt.Errorf("the transaction's connection (%T) cannot run statements", tx.Statement.ConnPool)
		}
		if _, err := q.ExecContext(ctx, `SELECT pg_advisory_xact_lock(`+strconv.FormatUint(uint64(lockKey(t)), 10)+`)`); err != nil {
			return err
		}
		return fn(q)
	})
}

// insert relies on the primary key: ON CONFLICT DO NOTHING waits for a
// concurrent transaction that inserted the same id, then does nothing if
// it committed and inserts if it rolled back (under READ COMMITTED, the
// default; under REPEATABLE READ or SERIALIZABLE a conflict with a
// transaction that committed after ours began is a serialization failure
// instead, which Handle returns).
func (postgresDialect) insert(tx *gorm.DB, t tables, id string, typ *string, now time.Time) (bool, error) {
	res := tx.Exec(`INSERT INTO `+t.records+` (message_id, message_type, handled_at) VALUES (?, ?, ?)
ON CONFLICT (message_id) DO NOTHING`, id, typ, now.UTC())
	return res.RowsAffected == 1, res.Error
}

func (postgresDialect) cleanupSQL(t tables) string { return cleanupInSQL(t) }
