package outbox

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"fmt"
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

func (sqliteDialect) idsIn(ids []int64) (string, []any) {
	args := make([]any, len(ids))
	for i, id := range ids {
		args[i] = id
	}
	return "IN (?" + strings.Repeat(", ?", len(ids)-1) + ")", args
}

func (sqliteDialect) skipLocked() string { return "" }

func (sqliteDialect) serverStart() string { return "NULL" }

// readTime returns the stored text: mattn/go-sqlite3 reads a DATETIME
// column's text that it cannot parse as the zero time, without an error.
func (sqliteDialect) readTime(column string) string { return "CAST(" + column + " AS TEXT)" }

// asyncCommit is empty: how a SQLite commit syncs is the connection's
// synchronous pragma (mattn/go-sqlite3 sets NORMAL unless the DSN's _sync
// says otherwise; in WAL mode NORMAL syncs only at checkpoints).
func (sqliteDialect) asyncCommit() string { return "" }

// planComment is empty: the SQLite driver prepares, and so plans, a
// statement anew for each run of it, and a comment would only multiply
// the statements that GORM's PrepareStmt keeps.
func (sqliteDialect) planComment(int) string { return "" }

func (sqliteDialect) listen(context.Context, *gorm.DB, tables, func()) error { return errNoListen }

// rejectsData: SQLite stores any text it is given; encode has checked it.
func (sqliteDialect) rejectsData(error) bool { return false }

// slotLocks: one writer at a time drains an SQLite database; there is
// nothing to share.
func (sqliteDialect) slotLocks() slotLocks { return nil }

// claimTx runs fn inside immediate, so that the window's read and the
// lease see one state of the database.
func (sqliteDialect) claimTx(ctx context.Context, db *gorm.DB, fn func(claimQuerier) error) error {
	return immediate(ctx, db, func(conn *sql.Conn) error { return fn(sqlQuerier{conn}) })
}

// checkPool: immediate takes a connection of its own from db.DB(), which
// needs a *sql.DB behind the pool.
func (sqliteDialect) checkPool(db *gorm.DB) error {
	if _, err := db.DB(); err != nil {
		return fmt.Errorf("the connection pool (%T) has no *sql.DB behind it, from which a claim takes a connection of its own: %w", db.Statement.ConnPool, err)
	}
	return nil
}

// undeliveredChunk is how many events one lookup statement on SQLite
// names, four arguments each, well within SQLite's limit on arguments.
const undeliveredChunk = 500

// undelivered looks the events up with one statement per chunk of them: a
// VALUES list, one correlated subquery per event through the aggregate
// index.
func (sqliteDialect) undelivered(ctx context.Context, q querier, t tables, events []aggregateSeq) ([]bool, error) {
	out := make([]bool, 0, len(events))
	for start := 0; start < len(events); start += undeliveredChunk {
		chunk := events[start:min(start+undeliveredChunk, len(events))]
		args := make([]any, 0, 4*len(chunk))
		for i, e := range chunk {
			args = append(args, i, e.agg.typ, e.agg.id, e.seq)
		}
		res, err := q.query(ctx, `SELECT EXISTS (
	SELECT 1 FROM `+t.records+` p
	WHERE p.aggregate_type = u.column2 AND p.aggregate_id = u.column3 AND p.aggregate_sequence = u.column4
		AND p.delivery_state <> 'delivered')
FROM (VALUES (?, ?, ?, ?)`+strings.Repeat(", (?, ?, ?, ?)", len(chunk)-1)+`) AS u
ORDER BY u.column1`, args...)
		if err != nil {
			return nil, err
		}
		found, err := scanBools(res, len(chunk))
		if err != nil {
			return nil, err
		}
		out = append(out, found...)
	}
	return out, nil
}

// claimRuns reads the heads inside immediate; takes a head alone when its
// aggregate has nothing undelivered after it, which is the common case and
// costs no further query; follows the run of the others, in sequence order
// until the first row that is not due or not the next sequence; and leases
// what it picked in one statement.
func (d sqliteDialect) claimRuns(ctx context.Context, db *gorm.DB, t tables, a claimArgs, scan func(resultRows) error) error {
	return immediate(ctx, db, func(conn *sql.Conn) error {
		ids, err := d.pick(ctx, conn, t, a)
		if err != nil || len(ids) == 0 {
			return err
		}
		in, idArgs := d.idsIn(ids)
		return queryScan(ctx, sqlQuerier{conn}, a.plan+leaseSQL(d, t, "id "+in), append(leaseArgs(d, a), idArgs...), scan)
	})
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

// pick returns the ids of the rows a claim leases, heads in order, each
// followed by its run. It reads heads lazily, following each run while the
// heads' cursor stays open, so that it stops scanning once the batch is
// full.
func (d sqliteDialect) pick(ctx context.Context, conn *sql.Conn, t tables, a claimArgs) (ids []int64, err error) {
	now := d.timeArg(a.now)
	runs, err := conn.PrepareContext(ctx, `SELECT id, aggregate_sequence,
	delivery_state <> 'failed' AND next_attempt_at <= ?
FROM `+t.records+`
WHERE aggregate_type = ? AND aggregate_id = ? AND aggregate_sequence >= ? AND delivery_state <> 'delivered'
ORDER BY aggregate_sequence
LIMIT ?`)
	if err != nil {
		return nil, err
	}
	defer runs.Close()
	heads, err := conn.QueryContext(ctx, headsSQL(t, `r.id, r.aggregate_type, r.aggregate_id, r.aggregate_sequence,
		EXISTS (SELECT 1 FROM `+t.records+` n
			WHERE n.aggregate_type = r.aggregate_type AND n.aggregate_id = r.aggregate_id
				AND n.aggregate_sequence > r.aggregate_sequence AND n.delivery_state <> 'delivered')`)+`
	LIMIT ?`, now, scanWindow(a.limit), now, a.limit)
	if err != nil {
		return nil, err
	}
	defer heads.Close()
	for len(ids) < a.limit && heads.Next() {
		var (
			id, seq  int64
			typ, agg string
			more     bool
		)
		if err := heads.Scan(&id, &typ, &agg, &seq, &more); err != nil {
			return nil, err
		}
		if !more {
			ids = append(ids, id)
			continue
		}
		if ids, err = followRun(ctx, runs, ids, a.limit, now, typ, agg, seq); err != nil {
			return nil, err
		}
	}
	return ids, heads.Err()
}

// followRun appends to ids the run that starts at sequence seq of the
// aggregate, up to limit ids in all.
func followRun(ctx context.Context, runs *sql.Stmt, ids []int64, limit int, now any, typ, agg string, seq int64) ([]int64, error) {
	run, err := runs.QueryContext(ctx, now, typ, agg, seq, limit-len(ids))
	if err != nil {
		return nil, err
	}
	defer run.Close()
	for next := seq; run.Next(); next++ {
		var (
			id, got int64
			due     bool
		)
		if err := run.Scan(&id, &got, &due); err != nil {
			return nil, err
		}
		if got != next || !due {
			break
		}
		ids = append(ids, id)
	}
	return ids, run.Err()
}
