package dialect

import (
	"context"

	"gorm.io/gorm"
)

// InsertedColumn: a row version that an INSERT ... ON CONFLICT DO UPDATE
// inserted has no deleting transaction yet (xmax = 0); one it updated
// carries the updating transaction's id in xmax.
func (postgresDialect) InsertedColumn() string { return "(xmax = 0)" }

// ErrorAbortsTx is true: after a failed statement, a PostgreSQL
// transaction refuses every other statement and its COMMIT rolls back.
func (postgresDialect) ErrorAbortsTx() bool { return true }

// AbortTx makes the caller's transaction fail on purpose, after a write on
// an emitting model failed once its rows were written: as after any
// failed statement, PostgreSQL then refuses the transaction's other
// statements, and its COMMIT rolls back, so the rows cannot commit
// without their events. (A savepoint would cost two more round trips for
// every write in the caller's transaction.)
func (postgresDialect) AbortTx(ctx context.Context, conn gorm.ConnPool) error {
	_, err := conn.ExecContext(ctx, `DO $$BEGIN RAISE EXCEPTION 'outbox: a write on an emitting model failed; this transaction cannot commit'; END$$`)
	return err
}

// ReturnsRows: INSERT, UPDATE and DELETE all take RETURNING.
func (postgresDialect) ReturnsRows(bool) bool { return true }

// KeyReads is never needed: InsertedColumn tells an upsert's inserts.
func (postgresDialect) KeyReads() KeyReads { return KeyReads{} }
