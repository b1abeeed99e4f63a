package outbox

import (
	"context"
	"reflect"

	"gorm.io/gorm"
	"gorm.io/gorm/clause"
	"gorm.io/gorm/schema"
)

// insertedColumn is empty: SQLite's RETURNING cannot tell a row an upsert
// inserted from one it updated, so the plugin reads the existing keys
// first (existingKeys).
func (sqliteDialect) insertedColumn() string { return "" }

// existingKeys reads the keys inside the statement's transaction. SQLite
// has one writer at a time, and a transaction that read the database can
// only write if nobody wrote in between (in WAL mode its write fails with
// SQLITE_BUSY otherwise), so what it reads is still true when the upsert
// runs.
func (d sqliteDialect) existingKeys(ctx context.Context, conn gorm.ConnPool, stmt *gorm.Statement, keys []*schema.Field, models []reflect.Value) (map[string]bool, error) {
	return readExistingKeys(ctx, conn, stmt, keys, models, d.bind, "", false)
}

// errorAbortsTx is false: after a failed statement a SQLite transaction
// goes on, and commits what came before the failure.
func (sqliteDialect) errorAbortsTx() bool { return false }

// returnsRows: INSERT, UPDATE and DELETE all take RETURNING.
func (sqliteDialect) returnsRows(Op) bool { return true }

// defaultConflictColumns: SQLite's ON CONFLICT DO UPDATE names its target.
func (sqliteDialect) defaultConflictColumns(*gorm.Statement) []clause.Column { return nil }
