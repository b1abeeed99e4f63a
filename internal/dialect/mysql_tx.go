package dialect

import (
	"context"
	"database/sql"
	"errors"
	"fmt"

	"gorm.io/gorm"
)

// LockConflict reports whether err is the server ending a statement or
// a transaction that waited for a lock (dialect.LockConflict): a deadlock (1213, which rolls the
// transaction back) or a lock wait timeout (1205, which rolls back the
// statement, or the transaction under innodb_rollback_on_timeout).
func (mysqlDialect) LockConflict(err error) bool {
	n, _, ok := mysqlError(err)
	return ok && (n == 1213 || n == 1205)
}

// readCommittedTx runs fn in a READ COMMITTED transaction on a connection
// of db's pool, and again when the server ends it for a lock conflict
// (RetryLocks). READ COMMITTED takes no gap locks, so that a claim's
// locking reads do not block the writers' inserts, and each statement
// sees what committed before it. go-sql-driver sets the level for the
// one transaction (SET TRANSACTION ISOLATION LEVEL before START
// TRANSACTION, on the same connection), leaving the session's as it was.
func readCommittedTx(ctx context.Context, db *gorm.DB, fn func(tx *sql.Tx) error) error {
	sqlDB, err := db.DB()
	if err != nil {
		return err
	}
	return RetryLocks(ctx, mysqlDialect{}, func() error {
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
