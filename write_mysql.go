package outbox

import (
	"context"
	"reflect"
	"strings"

	gormmysql "gorm.io/driver/mysql"
	"gorm.io/gorm"
	"gorm.io/gorm/schema"
)

// mysqlFlavour returns the dialect for db's MySQL server: MariaDB has
// INSERT ... RETURNING and DELETE ... RETURNING (since 10.5), MySQL has no
// RETURNING at all. GORM's dialector learns the server's version when it
// opens (unless told to skip that: the server is then taken for MySQL).
func mysqlFlavour(db *gorm.DB) mysqlDialect {
	var version string
	switch dl := db.Dialector.(type) {
	case *gormmysql.Dialector:
		version = dl.ServerVersion
	case gormmysql.Dialector:
		version = dl.ServerVersion
	}
	return mysqlDialect{mariadb: strings.Contains(strings.ToLower(version), "mariadb")}
}

// returnsRows: on MariaDB, creates and deletes take RETURNING; updates
// never do, on either server: the plugin locks and reads the rows their
// WHERE matches first.
func (d mysqlDialect) returnsRows(op Op) bool { return d.mariadb && op != OpUpdate }

// insertedColumn is empty: nothing in a row tells an upsert's insert from
// its update, so the plugin reads the existing keys first (existingKeys).
func (mysqlDialect) insertedColumn() string { return "" }

// existingKeys reads the keys inside the statement's transaction, locking
// the rows it finds (FOR UPDATE), so that they stay as read until the
// upsert runs.
func (d mysqlDialect) existingKeys(ctx context.Context, conn gorm.ConnPool, stmt *gorm.Statement, keys []*schema.Field, models []reflect.Value) (map[string]bool, error) {
	return readExistingKeys(ctx, conn, stmt, keys, models, d.bind, " FOR UPDATE")
}

// errorAbortsTx is false: InnoDB rolls back the failed statement, not its
// transaction (but for a deadlock, which rolls back the whole transaction
// and fails its commit).
func (mysqlDialect) errorAbortsTx() bool { return false }
