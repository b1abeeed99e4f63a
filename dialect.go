package outbox

import (
	"context"
	"database/sql"
	"fmt"
	"strconv"
	"strings"
	"time"

	"gorm.io/gorm"
)

// dialect is the one seam between the library and a database engine: every
// piece of SQL that differs between PostgreSQL and SQLite (DDL, upserts,
// RETURNING, row locking, time encoding) sits behind it. Statements common
// to both are written once with ? placeholders and passed through bind.
type dialect interface {
	// schema returns the statements that create the outbox tables and
	// indexes; they are idempotent and run in one transaction.
	schema(t tables) []string
	// bind rewrites ? placeholders into the engine's own.
	bind(query string) string
	// timeArg encodes a timestamp argument so that the engine compares it
	// correctly with stored timestamps.
	timeArg(t time.Time) any
	// insertEvent stores e with the next sequence of its aggregate, unless
	// a row with its idempotency key exists; it reports whether it inserted.
	// With notify, the engine is also asked to tell listeners at commit.
	insertEvent(ctx context.Context, conn gorm.ConnPool, t tables, e *encodedEvent, now time.Time, notify bool) (bool, error)
	// returnsRows reports whether a statement of kind op can return the
	// rows it wrote (RETURNING), which the plugin builds events from.
	// Where it cannot (MySQL has no UPDATE ... RETURNING), a write of an
	// emitting model of that kind is refused with ErrUnidentifiedRows
	// before it runs.
	returnsRows(op Op) bool
	// insertedColumn is a RETURNING expression that is true for a row an
	// upsert inserted and false for one it updated; empty where the
	// engine has none, and the dialect then implements existingKeyReader.
	insertedColumn() string
	// errorAbortsTx reports whether a failed statement aborts its
	// transaction (PostgreSQL), so that nothing of it can commit; where it
	// does not, the plugin writes inside a savepoint in the caller's
	// transaction and rolls back to it on failure.
	errorAbortsTx() bool
	// listen calls wake for every notification of t's channel until ctx
	// ends or the connection fails; it returns errNoListen where the
	// engine or driver has no notifications.
	listen(ctx context.Context, db *gorm.DB, t tables, wake func()) error
	// claimTx runs fn, an oldest-first claim's window read, order check
	// and lease, in one short transaction in which the rows the window
	// read stay locked (FOR UPDATE on PostgreSQL, the database's write
	// lock on SQLite) until it commits. An error in fn before the lease
	// rolls the whole claim back; see claimQuerier for one after it.
	claimTx(ctx context.Context, db *gorm.DB, fn func(q claimQuerier) error) error
	// undelivered reports, for each event, whether its row exists and is
	// not delivered, in one statement on q (or a few, for a long list on
	// SQLite), each lookup through the aggregate index.
	undelivered(ctx context.Context, q querier, t tables, events []aggregateSeq) ([]bool, error)
	// claimRuns leases up to a.limit due rows as runs (see claim.go) in
	// one short transaction, and hands the rows that leaseSQL returns to
	// scan. On PostgreSQL the lease has committed by then, so rows that
	// scan fails on (the driver failing, not a row that cannot be read
	// into a message: scanLeased returns that one) stay leased until their
	// lease passes; on SQLite a scan error rolls the claim back.
	claimRuns(ctx context.Context, db *gorm.DB, t tables, a claimArgs, scan func(resultRows) error) error
	// idsIn returns the condition that a bigint column is one of ids, to
	// follow the column's name, and its arguments: one array argument
	// where the engine has arrays, so that the statement's text and plan
	// do not change with the number of ids.
	idsIn(ids []int64) (string, []any)
	// skipLocked is the row-locking clause of a sweep's scan and of the
	// oldest-first claim's window (windowSQL): FOR UPDATE SKIP LOCKED
	// where the engine has row locks, nothing where the claim's
	// transaction holds the whole database.
	skipLocked() string
	// serverStart is a text expression that changes whenever the database
	// server starts or recovers from a crash, so that a claim learns of any
	// event that may have lost committed transactions (acceptedSeqs); NULL
	// where the database lives in the process.
	serverStart() string
	// readTime is the expression that returns a timestamp column so that
	// a value the driver cannot read fails to scan (scanTime) rather than
	// reading as the zero time.
	readTime(column string) string
	// planComment returns what leads the text of the dispatcher's
	// windows, leases, settles, parking and sweeps when the highest row
	// id its claims have read is below 2^k: a comment naming k where the
	// driver or the engine keeps plans of prepared statements, so that
	// they are planned anew as the ids double (plan.go); nothing
	// elsewhere.
	planComment(k int) string
	// checkPool reports why db's connection pool cannot serve a
	// dispatcher's claims, if it cannot.
	checkPool(db *gorm.DB) error
	// asyncCommit is a condition, always true, to append to the WHERE of
	// a claim's lease and of a settle (and of no other statement) so that
	// the statement's own transaction commits without waiting for its WAL
	// to reach disk, where the engine allows that per transaction; empty
	// elsewhere. A crash of the server may then forget the last leases and
	// settles before it, and their events are delivered again: at least
	// once allows that, and the events themselves were written by the
	// caller's transaction, with its durability.
	asyncCommit() string
	// slotLocks returns how dispatchers agree on slots (slots.go), or
	// nil where the engine has no locks that outlive a transaction.
	slotLocks() slotLocks
	// rejectsData reports whether err is the engine refusing a value (bad
	// encoding, a number out of range) rather than a failure of the
	// database: the event is then invalid, not the write.
	rejectsData(err error) bool
}

// resultRows is the result of one of a claim's statements: *sql.Rows, or,
// in a claim on a pgx connection, pgx's rows (dialect_postgres_claim.go).
type resultRows interface {
	Next() bool
	Scan(dest ...any) error
	Err() error
	Close() error
}

// querier runs one of a claim's statements and returns its rows.
type querier interface {
	query(ctx context.Context, query string, args ...any) (resultRows, error)
}

// claimQuerier is the transaction of an oldest-first claim (claimTx).
type claimQuerier interface {
	querier
	// lease runs the claim's last statement, the lease. Where the dialect
	// can, the commit travels with it, and Close of its rows reports the
	// commit: the lease has then committed once its rows can be read, and
	// rows that fail to scan (the driver failing) stay leased until the
	// lease passes, as with claimRuns on PostgreSQL.
	lease(ctx context.Context, query string, args ...any) (resultRows, error)
}

// sqlQuerier is a querier, and a claimQuerier that commits after fn, on
// a database/sql pool, connection or transaction.
type sqlQuerier struct {
	q interface {
		QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	}
}

func (s sqlQuerier) query(ctx context.Context, query string, args ...any) (resultRows, error) {
	res, err := s.q.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, err // not a nil *sql.Rows in a non-nil interface
	}
	return res, nil
}

func (s sqlQuerier) lease(ctx context.Context, query string, args ...any) (resultRows, error) {
	return s.query(ctx, query, args...)
}

// dialectOf returns the dialect for db's engine.
func dialectOf(db *gorm.DB) (dialect, error) {
	switch name := db.Dialector.Name(); name {
	case "postgres":
		return postgresDialect{}, nil
	case "sqlite":
		return sqliteDialect{}, nil
	default:
		return nil, fmt.Errorf("outbox: unsupported database %q (PostgreSQL and SQLite are supported)", name)
	}
}

// tables holds the quoted names of the outbox tables and indexes derived
// from the configured table name.
type tables struct {
	name      string // unquoted records table name, as configured
	records   string
	sequences string
	index     func(suffix string) string
}

func tablesFor(name string) tables {
	return tables{
		name:      name,
		records:   quote(name),
		sequences: quote(name + "_sequences"),
		index:     func(suffix string) string { return quote(name + "_" + suffix) },
	}
}

func quote(ident string) string { return `"` + ident + `"` }

// bindNumbered rewrites ? placeholders into $1, $2, ... Our statements
// never contain a literal question mark.
func bindNumbered(query string) string {
	var b strings.Builder
	b.Grow(len(query) + 16)
	n := 0
	for i := 0; i < len(query); i++ {
		if query[i] == '?' {
			n++
			b.WriteByte('$')
			b.WriteString(strconv.Itoa(n))
			continue
		}
		b.WriteByte(query[i])
	}
	return b.String()
}

// releaseSequence undoes the sequence increment of an event that turned
// out to be a duplicate. The caller still holds the row lock its own
// increment took, so no other transaction has moved the sequence since.
func releaseSequence(ctx context.Context, d dialect, conn gorm.ConnPool, t tables, e *encodedEvent) error {
	_, err := conn.ExecContext(ctx, d.bind(`UPDATE `+t.sequences+
		` SET last_sequence = last_sequence - 1 WHERE aggregate_type = ? AND aggregate_id = ?`),
		e.aggregateType, e.aggregateID)
	return err
}

// commonIndexes are the indexes both engines create, all partial so that
// their size follows the live rows, not the delivered history:
//   - due: the claim's scan, in its ORDER BY (next_attempt_at, id);
//   - aggregate: the per-aggregate order check, over undelivered rows;
//   - delivered: cleanup by age;
//   - failed: the retry_failed sweep.
func commonIndexes(t tables) []string {
	return []string{
		`CREATE INDEX IF NOT EXISTS ` + t.index("due") + ` ON ` + t.records +
			` (next_attempt_at, id) WHERE delivery_state IN ('pending', 'retry', 'delivering')`,
		`CREATE INDEX IF NOT EXISTS ` + t.index("aggregate") + ` ON ` + t.records +
			` (aggregate_type, aggregate_id, aggregate_sequence) WHERE delivery_state <> 'delivered'`,
		`CREATE INDEX IF NOT EXISTS ` + t.index("delivered") + ` ON ` + t.records +
			` (delivered_at) WHERE delivery_state = 'delivered'`,
		`CREATE INDEX IF NOT EXISTS ` + t.index("failed") + ` ON ` + t.records +
			` (updated_at, id) WHERE delivery_state = 'failed'`,
	}
}
