package outbox

import (
	"context"

	"gorm.io/gorm"
)

// insertedColumn: a row version that an INSERT ... ON CONFLICT DO UPDATE
// inserted has no deleting transaction yet (xmax = 0); one it updated
// carries the updating transaction's id in xmax.
func (postgresDialect) insertedColumn() string { return "(xmax = 0)" }

// errorAbortsTx is true: after a failed statement, a PostgreSQL
// transaction refuses every other statement and its COMMIT rolls back.
func (postgresDialect) errorAbortsTx() bool { return true }

// abortTx makes the caller's transaction fail on purpose, after a write on
// an emitting model failed once its rows were written: as after any
// failed statement, PostgreSQL then refuses the transaction's other
// statements, and its COMMIT rolls back, so the rows cannot commit
// without their events. (A savepoint would cost two more round trips for
// every write in the caller's transaction.)
func (postgresDialect) abortTx(ctx context.Context, conn gorm.ConnPool) error {
	_, err := conn.ExecContext(ctx, `DO $$BEGIN RAISE EXCEPTION 'outbox: a write on an emitting model failed; this transaction cannot commit'; END$$`)
	return err
}

// returnsRows: INSERT, UPDATE and DELETE all take RETURNING.
func (postgresDialect) returnsRows(bool) bool { return true }

// keyReads is never needed: insertedColumn tells an upsert's inserts.
func (postgresDialect) keyReads() keyReads { return keyReads{} }
