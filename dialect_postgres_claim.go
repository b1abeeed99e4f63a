package outbox

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"gorm.io/gorm"
)

// An oldest-first claim on PostgreSQL is a transaction of two or three
// statements (the window, at times the order lookup, the lease), and on a
// connection of the pgx driver it costs two round trips where it would
// cost four: BEGIN travels with the window, and COMMIT with the lease,
// each pair as one pgx batch. (Under pgx's QueryExecModeDescribeExec
// each batch is described first, a round trip more each.) With the
// settle, a batch is three round trips instead of five.
//
// The statements, their order and the transaction are those that
// database/sql would send one by one, so locking and visibility do not
// change; what changes is when a failure is seen. COMMIT is sent before
// the lease's rows are read: a lease that fails leaves COMMIT unexecuted
// and the transaction aborted, which pipelinedClaim then rolls back; and
// rows that the driver fails to read after a successful lease stay leased
// until their lease passes, as with the runs claim, which is a single
// statement. A pool of another driver (a *sql.DB opened by a driver that
// wraps pgx's, or a pool that is not a *sql.DB) gets a GORM transaction,
// one statement per round trip.

// claimTx runs fn in a transaction of its own: pipelined on a connection
// of db's *sql.DB where its driver is pgx's, a GORM transaction on any
// other pool GORM can begin one on (checkPool). The window's FOR UPDATE
// SKIP LOCKED keeps its rows from other claims until the commit, so that
// claims running side by side read disjoint windows; a row of an
// aggregate that another claim's window holds leaves a gap, or its
// predecessor is undelivered.
func (postgresDialect) claimTx(ctx context.Context, db *gorm.DB, fn func(claimQuerier) error) error {
	sqlDB, err := db.DB()
	if err != nil || !isPgx(sqlDB) {
		return db.WithContext(ctx).Transaction(func(tx *gorm.DB) error { return fn(sqlQuerier{tx.Statement.ConnPool}) })
	}
	return onPgxConn(ctx, sqlDB, errors.New("outbox: the pgx driver handed out a connection that is not pgx's"), func(conn *pgx.Conn) error {
		return pipelinedClaim(ctx, conn, fn)
	})
}

// isPgx reports whether db's connections are pgx's own.
func isPgx(db *sql.DB) bool {
	_, ok := db.Driver().(*stdlib.Driver)
	return ok
}

// pipelinedClaim runs fn in a transaction on conn whose BEGIN goes with
// fn's first statement and whose COMMIT goes with its lease, and makes
// sure the transaction has ended when it returns. It returns an error
// that wraps driver.ErrBadConn, so that database/sql discards conn, when
// it cannot tell that the transaction ended.
func pipelinedClaim(ctx context.Context, conn *pgx.Conn, fn func(claimQuerier) error) error {
	c := &pgxClaim{conn: conn}
	err := fn(c)
	if err == nil && c.begun && !c.ended {
		// Nothing to lease: end the transaction that the window began.
		err = c.end(ctx, "COMMIT")
	}
	if err != nil && conn.PgConn().TxStatus() != 'I' {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rollbackTimeout)
		defer cancel()
		if rerr := c.end(rctx, "ROLLBACK"); rerr != nil || conn.PgConn().TxStatus() != 'I' {
			return errors.Join(err, driver.ErrBadConn)
		}
	}
	if err != nil && conn.IsClosed() {
		return errors.Join(err, driver.ErrBadConn)
	}
	return err
}

// rollbackTimeout bounds the ROLLBACK of a claim that failed; a connection
// that does not answer in time is discarded instead.
const rollbackTimeout = 5 * time.Second

// pgxClaim is a claim's transaction on a pgx connection.
type pgxClaim struct {
	conn  *pgx.Conn
	begun bool // BEGIN was sent
	ended bool // COMMIT or ROLLBACK was sent
}

// query sends BEGIN with the claim's first statement, alone after that.
func (c *pgxClaim) query(ctx context.Context, query string, args ...any) (resultRows, error) {
	if c.begun {
		res, err := c.conn.Query(ctx, query, args...)
		if err != nil {
			return nil, err
		}
		return pgxRows{res}, nil
	}
	c.begun = true
	b := &pgx.Batch{}
	b.Queue("BEGIN")
	b.Queue(query, args...)
	br := c.conn.SendBatch(ctx, b)
	if _, err := br.Exec(); err != nil {
		br.Close() // returns err again
		return nil, err
	}
	return batchRows(br, "")
}

// lease sends the lease with COMMIT.
func (c *pgxClaim) lease(ctx context.Context, query string, args ...any) (resultRows, error) {
	if !c.begun {
		return nil, errors.New("outbox: a claim's lease must follow its window")
	}
	c.ended = true
	b := &pgx.Batch{}
	b.Queue(query, args...)
	b.Queue("COMMIT")
	return batchRows(c.conn.SendBatch(ctx, b), "COMMIT")
}

// end sends COMMIT or ROLLBACK alone, and checks that the server did that.
func (c *pgxClaim) end(ctx context.Context, verb string) error {
	c.ended = true
	tag, err := c.conn.Exec(ctx, verb)
	if err == nil && tag.String() != verb {
		err = fmt.Errorf("outbox: %s of a claim answered %q", verb, tag.String())
	}
	return err
}

// pgxRows is the rows of a statement of a claim sent alone (the lookup).
type pgxRows struct{ pgx.Rows }

func (r pgxRows) Close() error {
	r.Rows.Close()
	return r.Rows.Err()
}

// batchRows reads the rows of the next statement of br, then, on Close,
// the statement after it, if then is set, and checks that its command tag
// is then (COMMIT answers ROLLBACK in a transaction that failed earlier;
// a claim returns at its first error, so this is a safeguard).
func batchRows(br pgx.BatchResults, then string) (resultRows, error) {
	res, err := br.Query()
	if err != nil {
		br.Close() // returns err again
		return nil, err
	}
	return &pipelinedRows{Rows: res, br: br, then: then}, nil
}

type pipelinedRows struct {
	pgx.Rows
	br     pgx.BatchResults
	then   string
	closed bool
}

func (r *pipelinedRows) Close() error {
	if r.closed {
		return nil
	}
	r.closed = true
	r.Rows.Close()
	err := r.Rows.Err()
	if r.then != "" && err == nil {
		tag, terr := r.br.Exec()
		switch {
		case terr != nil:
			err = terr
		case tag.String() != r.then:
			err = fmt.Errorf("outbox: %s of a claim answered %q", r.then, tag.String())
		}
	}
	// Close returns the batch's first error again, or its own.
	if cerr := r.br.Close(); err == nil {
		err = cerr
	}
	return err
}
