// Package dialect is the one seam between gorm-outbox and a database
// engine. Each engine owns its complete statements (Statements, in its own
// file, read top to bottom) and the few procedures that differ between
// engines (how a claim's transaction begins, how lists travel as
// arguments, how a notification is heard). The write and delivery paths
// of package outbox call it with plain values and the types defined here;
// this package imports nothing of them, so the compiler keeps the seam.
// TestDialectConformance holds every engine to the doc comments below.
package dialect

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"gorm.io/gorm"
)

// Dialect is one engine: PostgreSQL, SQLite or MySQL (MariaDB). For
// returns the one for a *gorm.DB.
type Dialect interface {
	// Name is the engine's name in messages and in the migrations' paths:
	// "postgres", "sqlite" or "mysql".
	Name() string
	// Tables returns the quoted names of the outbox tables for the
	// configured table name.
	Tables(name string) Tables
	// Statements returns every statement of the delivery path and of the
	// migrator on t.
	Statements(t Tables) Statements
	// Bind rewrites ? placeholders into the engine's own, for the few
	// statements that are the same on every engine but for them.
	Bind(query string) string
	// TimeArg encodes a timestamp argument so that the engine compares it
	// correctly with stored timestamps.
	TimeArg(t time.Time) any
	// ReturnsRows reports whether a statement that inserts or deletes
	// (update false) or one that updates can return the rows it wrote
	// (RETURNING), which the plugin builds events from. Where it cannot
	// (MySQL has no UPDATE ... RETURNING), the plugin locks and reads the
	// rows first, or refuses the write (outbox.ErrUnidentifiedRows).
	ReturnsRows(update bool) bool
	// InsertedColumn is a RETURNING expression that is true for a row an
	// upsert inserted and false for one it updated; empty where the
	// engine has none, and the plugin then reads the existing keys first
	// as KeyReads says.
	InsertedColumn() string
	// KeyReads says how the plugin reads which of an upsert's conflict
	// keys exist, where InsertedColumn is empty.
	KeyReads() KeyReads
	// ErrorAbortsTx reports whether a failed statement aborts its
	// transaction (PostgreSQL), so that nothing of it can commit; where it
	// does not, the plugin writes inside a savepoint in the caller's
	// transaction and rolls back to it on failure.
	ErrorAbortsTx() bool
	// ReadTime is the expression that returns a timestamp column so that
	// a value the driver cannot read fails to scan (Time) rather than
	// reading as the zero time.
	ReadTime(column string) string
	// IDList, TextList and EventList encode a list as the arguments of one
	// placeholder each (an array where the engine has arrays, JSON text
	// elsewhere), so that a statement's text does not change with the
	// length of the list. Elements arrive byte for byte and in order; an
	// empty list matches nothing, and TextList(nil) is NULL, which a
	// requeue's filter takes as "any".
	IDList(ids []int64) any
	TextList(s []string) any
	EventList(events []Position) []any
	// ClaimTx runs fn, a claim's reads and its lease, in one short
	// transaction in which the rows it reads with the claim statements'
	// locking clauses stay locked until it commits (the rows themselves on
	// PostgreSQL and MySQL, the whole database on SQLite). Each statement
	// of fn sees what committed before it (READ COMMITTED, whatever the
	// session's default); on SQLite nothing commits meanwhile. An error of
	// fn rolls the claim back; after one that LockConflict reports, fn
	// runs again in a new transaction (MySQL), so fn starts from nothing
	// each time.
	ClaimTx(ctx context.Context, db *gorm.DB, fn func(q Querier) error) error
	// MigrateTx runs fn holding a lock that other migrations of t wait
	// for, in one transaction where DDL is transactional (PostgreSQL,
	// SQLite: an error of fn undoes all of it). MySQL commits each DDL
	// statement on its own, so there every migration must be safe to run
	// again after a failure.
	MigrateTx(ctx context.Context, db *gorm.DB, t Tables, fn func(q Querier) error) error
	// Listen calls wake for every notification on t's channel until ctx
	// ends or the connection fails; it returns ErrNoListen where the
	// engine or driver has no notifications.
	Listen(ctx context.Context, db *gorm.DB, t Tables, wake func()) error
	// CheckPool reports why db's connection pool cannot serve a
	// dispatcher's claims, if it cannot.
	CheckPool(db *gorm.DB) error
	// CheckConn returns an error wrapping ErrUnfitConn when conn's
	// connections cannot serve the plugin and the dispatcher (MySQL
	// without parseTime=true), the error of its query when that fails,
	// and nil otherwise.
	CheckConn(ctx context.Context, conn gorm.ConnPool) error
	// Settings reads the settings the documentation says matter and
	// returns a Warning for each that the database runs without, and for
	// each it could not read.
	Settings(ctx context.Context, conn gorm.ConnPool, t Tables) []Warning
	// LockConflict reports whether err is the server ending one of the
	// dispatcher's own statements or transactions for a deadlock or a
	// lock wait, which RetryLocks runs again (MySQL); false elsewhere.
	LockConflict(err error) bool
	// RejectsData reports whether err is the engine refusing a value (bad
	// encoding, a number out of range) rather than a failure of the
	// database: the event is then invalid, not the write.
	RejectsData(err error) bool
	// InsertEvent stores e with the next sequence of its aggregate, unless
	// a row with its idempotency key exists; it reports whether it
	// inserted. With notify, the engine is also asked to tell listeners at
	// commit.
	InsertEvent(ctx context.Context, conn gorm.ConnPool, t Tables, e *Record, now time.Time, notify bool) (bool, error)
}

// Statements are the complete statements of the delivery path and the
// migrator on one engine and table. Each field says its arguments, in
// order, and its result columns; "now" is a TimeArg, lists are the
// dialect's IDList, TextList and EventList. Window, Undelivered, Lease,
// Revive and Requeue run on ClaimTx's querier, where
// an argument may serve twice (numbered placeholders; on MySQL lease,
// revive and requeue are lists of statements that only it runs); the
// others run on the pool. A statement that returns the rows it changes
// (Lease, Revive, Requeue, Claim) must have its rows read: on SQLite it
// changes nothing until the first is.
//
// Claimable means: pending, retry or delivering, due (next_attempt_at has
// come) and not leased (locked_until is empty or has passed). A claim
// sets both next_attempt_at and locked_until to its lease's end; the
// lease is locked_until, and a row whose locked_until lies in the future
// is never claimed, whatever next_attempt_at says.
type Statements struct {
	// A claim is window, order check and lease (the outbox package's
	// claim.go). An engine has either Claim and ClaimShard, which say
	// all three in one statement, or Window, WindowShard, Undelivered
	// and Lease, which the dispatcher runs in ClaimTx, checking the
	// order in Go.

	// Claim (batch id, lease end, now, limit): window, order check and
	// lease in one statement. Result: the window's size, whether it held
	// rows back behind a predecessor that is not in flight, then the
	// lease's columns (NULL when it leased nothing); at least one row.
	Claim string
	// ClaimShard (batch id, lease end, now, limit, shard): claim, with
	// its window limited to the aggregates of one shard (0 to Shards-1,
	// by a hash of aggregate type and id that the engine chooses). Empty
	// where Claim is empty.
	ClaimShard string
	// Window (now, limit): the oldest claimable rows, in due order
	// (next_attempt_at, id), locked, skipping rows another claim holds.
	// Result: id, aggregate_type, aggregate_id, aggregate_sequence.
	Window string
	// WindowShard (now, limit, shard): window, limited to the aggregates
	// of one shard, as in ClaimShard. Empty where claims never read by
	// shard (SQLite: its claims never overlap).
	WindowShard string
	// Undelivered (now, EventList): for each event, in the list's order,
	// NULL when its row is delivered or gone; 'flight' when it is leased
	// (delivering, its lease not passed) or due no later than the event
	// after it (so it came before that one in due order and another claim
	// holds it); 'waits' otherwise: for a retry, a requeue, an expired
	// lease, or a claim that reaches it. Result: one text a row.
	Undelivered string
	// Lease (batch id, lease end, now, ids): leases the listed rows.
	// Result: id, event_id, event_type, aggregate_type, aggregate_id,
	// aggregate_sequence, idempotency_key, payload, headers, occurred_at
	// (ReadTime), delivery_attempts.
	Lease string

	// SettleDelivered (now, batch id, ids) marks delivered those of the
	// listed rows that the batch still leases; SettleOther (state,
	// attempts, next attempt, last error or NULL to keep it, failure kind
	// or NULL, now, batch id, ids) does the same for any other outcome.
	SettleDelivered, SettleOther string

	// Blockers (now, scan, lease end): for each aggregate seen among the
	// scan oldest due rows, its head (first undelivered event) when it
	// holds those rows back where no claim reaches it: failed (until:
	// the lease end), or pending, retry, or delivering past its lease,
	// and due after a seen row of its aggregate (until: its due time).
	// Result: aggregate_type, aggregate_id, aggregate_sequence,
	// delivery_state, until.
	Blockers string
	// Park (until, now, type, id, seq, state): moves
	// the due rows behind a blocker to until, if it is still in state.
	Park string
	// Unpark (now, EventList): makes the waiting rows of the
	// listed aggregates due now.
	Unpark string

	// Revive (now, max revivals, limit): the retry_failed sweep: moves
	// failed rows that ran out of attempts and were revived fewer than max
	// times back to pending, counting the revival. Requeue (now, limit,
	// failed before, ids, types): moves any failed rows the filter
	// selects (a NULL list or time selects all). Both: oldest failure
	// first; result: aggregate_type, aggregate_id.
	Revive, Requeue string
	// Discard (limit, failed before, ids, types): reads, locked until the
	// transaction ends (FOR UPDATE, waiting; SQLite's ClaimTx holds the
	// database), the failed rows Requeue's filter selects, oldest failure
	// first, as Requeue reads them. Result: id, event_id, event_type,
	// aggregate_type, aggregate_id, aggregate_sequence.
	Discard string
	// Cleanup (cutoff, limit) deletes up to limit delivered rows
	// delivered before the cutoff, oldest first.
	Cleanup string

	// Counts: rows per delivery state. Result: delivery_state, count.
	// OldestDue (now): the next_attempt_at of the longest-waiting
	// claimable row, or NULL. LastFailure: the last_error of the most
	// recently failed row.
	Counts, OldestDue, LastFailure string
}

// Notifier is a Dialect whose engine can tell listeners, from any
// connection, that events were committed. PostgreSQL is one.
type Notifier interface {
	// NotifyCommitted sends one notification on t's channel through pool,
	// in a transaction of its own.
	NotifyCommitted(ctx context.Context, pool *sql.DB, t Tables) error
}

// Aborter is a Dialect whose engine aborts a transaction after a failed
// statement (ErrorAbortsTx), and that can do so on purpose. PostgreSQL is
// one.
type Aborter interface {
	// AbortTx makes the transaction of conn refuse to commit.
	AbortTx(ctx context.Context, conn gorm.ConnPool) error
}

// What each engine is, checked by the compiler.
var (
	_ Dialect  = postgresDialect{}
	_ Notifier = postgresDialect{}
	_ Aborter  = postgresDialect{}
	_ Dialect  = sqliteDialect{}
	_ Dialect  = mysqlDialect{}
)

// KeyReads says how the plugin learns which rows an upsert will update on
// an engine whose RETURNING cannot tell: it reads which of the upsert's
// conflict keys exist first, inside the statement's transaction.
type KeyReads struct {
	// Lock is appended to each read (" FOR UPDATE" where rows lock), so
	// that the keys stay as read until the upsert runs.
	Lock string
	// RowList lists the keys as row constructors rather than VALUES
	// (MariaDB answers `(a) IN (VALUES (?))` with no rows in a prepared
	// statement).
	RowList bool
	// PrimaryKey: an upsert that names no conflict columns conflicts on
	// the primary key (MySQL's ON DUPLICATE KEY UPDATE names none).
	PrimaryKey bool
	// UniqueKeys, where set, returns the unique keys of a table (its
	// name with its schema's or database's before it, where it has one:
	// otherdb.labels), by name, each as its sorted lower-case column
	// names (a part that is not a whole column, a prefix or an
	// expression, has a parenthesis in its name): the upsert fires on a
	// clash with any of them (MySQL), so the plugin reads, locked, the
	// rows that clash with the statement's on any of them, and tells the
	// rows the upsert returns apart by primary key. Nil where an upsert
	// fires only on the key it names.
	UniqueKeys func(ctx context.Context, conn gorm.ConnPool, table string) (map[string][]string, error)
}

// Record is one event as the write path stores it: checked, defaulted
// and encoded (Payload is JSON text, Headers a JSON object or nil).
type Record struct {
	ID, Type, AggregateType, AggregateID, Key string
	Payload                                   string
	Headers                                   *string
	OccurredAt                                time.Time
}

// ErrNoListen says that the engine or driver cannot deliver notifications.
var ErrNoListen = errors.New("outbox: notifications not supported here")

// ErrUnfitConn says that a connection is set up so that the plugin and
// the dispatcher cannot work through it (CheckConn).
var ErrUnfitConn = errors.New("outbox: the connection's settings do not serve the outbox")

// A Warning is a setting that the database runs without: Message says
// what to set and why, Attrs (slog's key-value pairs) what was read. With
// Err, it is a setting Check names that could not be read.
type Warning struct {
	Check   string
	Message string
	Attrs   []any
	Err     error
}

// Shards is how many shards a claim in shard mode divides the aggregates
// into, by a hash of aggregate type and id.
const Shards = 8

// Querier is what a claim's or a migration's transaction runs statements
// on: a *sql.Tx or a *sql.Conn.
type Querier interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
}

// For returns the dialect for db's engine.
func For(db *gorm.DB) (Dialect, error) {
	switch name := db.Dialector.Name(); name {
	case "postgres":
		return postgresDialect{}, nil
	case "sqlite":
		return sqliteDialect{}, nil
	case "mysql":
		return mysqlFlavour(db), nil
	default:
		return nil, fmt.Errorf("outbox: unsupported database %q (PostgreSQL, MySQL and SQLite are supported)", name)
	}
}

// Tables holds the names of the outbox tables derived from the configured
// table name, quoted for one engine.
type Tables struct {
	Name      string // unquoted records table name, as configured
	Records   string
	Sequences string
	Quote     func(ident string) string
}

// Aggregate names an aggregate.
type Aggregate struct{ Type, ID string }

// Position is one event of an aggregate, by its sequence.
type Position struct {
	Aggregate Aggregate
	Seq       int64
}

// TablesFor returns the names derived from name, quoted with double
// quotes, as PostgreSQL and SQLite quote identifiers.
func TablesFor(name string) Tables {
	return Tables{
		Name:      name,
		Records:   quote(name),
		Sequences: quote(name + "_sequences"),
		Quote:     quote,
	}
}

func quote(ident string) string { return `"` + ident + `"` }

// jsonList encodes a list as JSON text, for the engines that read lists
// with json_each (SQLite) or JSON_TABLE (MySQL).
func jsonList(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		panic(fmt.Sprintf("outbox: encode a list: %v", err)) // lists of ids and strings always encode
	}
	return string(b)
}

// jsonTexts is TextList as JSON text: nil (any) stays NULL.
func jsonTexts(s []string) any {
	if s == nil {
		return nil
	}
	return jsonList(s)
}

// jsonEvents is EventList as JSON text: one [type, id, seq] per event.
func jsonEvents(events []Position) []any {
	list := make([][3]any, len(events))
	for i, e := range events {
		list[i] = [3]any{e.Aggregate.Type, e.Aggregate.ID, e.Seq}
	}
	return []any{jsonList(list)}
}

// bindNumbered rewrites ? placeholders into $1, $2, ... The statements it
// is given never contain a literal question mark.
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
func releaseSequence(ctx context.Context, d Dialect, conn gorm.ConnPool, t Tables, e *Record) error {
	_, err := conn.ExecContext(ctx, d.Bind(`UPDATE `+t.Sequences+
		` SET last_sequence = last_sequence - 1 WHERE aggregate_type = ? AND aggregate_id = ?`),
		e.AggregateType, e.AggregateID)
	return err
}

// inTx runs fn in a transaction begun on db's pool (with opts, nil for the
// defaults): a *sql.DB, or a pool of the user's own that can begin one.
// It commits when fn succeeds and rolls back otherwise; a rollback that
// fails discards the connection where the pool can tell.
func inTx(ctx context.Context, db *gorm.DB, opts *sql.TxOptions, fn func(q Querier) error) (err error) {
	var (
		tx interface {
			Querier
			Commit() error
			Rollback() error
		}
	)
	switch pool := db.Statement.ConnPool.(type) {
	case gorm.TxBeginner:
		t, err := pool.BeginTx(ctx, opts)
		if err != nil {
			return err
		}
		tx = t
	case gorm.ConnPoolBeginner:
		t, err := pool.BeginTx(ctx, opts)
		if err != nil {
			return err
		}
		c, ok := t.(interface {
			Querier
			Commit() error
			Rollback() error
		})
		if !ok {
			return fmt.Errorf("outbox: the transaction of %T cannot commit", pool)
		}
		tx = c
	default:
		return fmt.Errorf("outbox: the connection pool (%T) cannot begin transactions", db.Statement.ConnPool)
	}
	if err := fn(tx); err != nil {
		if rerr := tx.Rollback(); rerr != nil && rerr != sql.ErrTxDone {
			return fmt.Errorf("%w (and the rollback failed: %v)", err, rerr)
		}
		return err
	}
	return tx.Commit()
}

// lockRetries is how many times the dispatcher's own transactions and
// statements run again after the server ended them for a
// deadlock or a lock wait timeout.
const lockRetries = 5

// RetryLocks runs fn, again after a short pause while it fails with a lock
// conflict that d reports (dialect.LockConflict; never on PostgreSQL or
// SQLite), up to lockRetries more times. fn must be a whole transaction
// or a statement that runs on its own: one that failed left nothing
// behind. Business transactions are never retried here: their caller
// gets the driver's error.
func RetryLocks(ctx context.Context, d Dialect, fn func() error) error {
	for attempt := 0; ; attempt++ {
		err := fn()
		if err == nil || !d.LockConflict(err) || attempt == lockRetries {
			return err
		}
		// A pause that grows, and differs between the two sides of a
		// deadlock, which both run again otherwise at once.
		pause := time.Duration(attempt+1)*time.Millisecond + time.Duration(time.Now().UnixNano()%int64(time.Millisecond))
		select {
		case <-ctx.Done():
			return errors.Join(err, ctx.Err())
		case <-time.After(pause):
		}
	}
}
