package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/go-sql-driver/mysql"
	"gorm.io/gorm"
)

// lockRetries is how many times the dispatcher's own transactions and
// statements on MySQL run again after the server ended them for a
// deadlock or a lock wait timeout.
const lockRetries = 5

// lockConflict reports whether err is the server ending a statement or
// a transaction that waited for a lock: a deadlock (1213, which rolls the
// transaction back) or a lock wait timeout (1205, which rolls back the
// statement, or the transaction under innodb_rollback_on_timeout).
func lockConflict(err error) bool {
	var me *mysql.MySQLError
	return errors.As(err, &me) && (me.Number == 1213 || me.Number == 1205)
}

// retryLocks runs fn, again after a short pause while it fails with a lock
// conflict, up to lockRetries more times. fn must be a whole transaction
// or a statement that runs on its own: one that failed left nothing
// behind. Business transactions are never retried here: their caller
// gets the driver's error.
func retryLocks(ctx context.Context, fn func() error) error {
	for attempt := 0; ; attempt++ {
		err := fn()
		if err == nil || !lockConflict(err) || attempt == lockRetries {
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

// readCommittedTx runs fn in a READ COMMITTED transaction on a connection
// of db's pool, and again when the server ends it for a lock conflict
// (retryLocks). READ COMMITTED takes no gap locks, so that a claim's
// locking reads do not block the writers' inserts, and each statement
// sees what committed before it. go-sql-driver sets the level for the
// one transaction (SET TRANSACTION ISOLATION LEVEL before START
// TRANSACTION, on the same connection), leaving the session's as it was.
func readCommittedTx(ctx context.Context, db *gorm.DB, fn func(tx *sql.Tx) error) error {
	sqlDB, err := db.DB()
	if err != nil {
		return err
	}
	return retryLocks(ctx, func() error {
		tx, err := sqlDB.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
		if err != nil {
			return err
		}
		if err := fn(tx); err != nil {
			if rerr := tx.Rollback(); rerr != nil {
				return errors.Join(err, rerr)
			}
			return err
		}
		return tx.Commit()
	})
}

// mysqlCheckPool: a claim takes a connection of the *sql.DB behind the
// pool for its transaction.
func mysqlCheckPool(db *gorm.DB) error {
	if _, err := db.DB(); err != nil {
		return fmt.Errorf("the connection pool (%T) has no *sql.DB behind it, from which a claim takes a connection of its own: %w", db.Statement.ConnPool, err)
	}
	return nil
}
