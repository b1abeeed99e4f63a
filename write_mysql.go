package outbox

import (
	"context"
	"fmt"
	"reflect"
	"slices"
	"strings"

	gormmysql "gorm.io/driver/mysql"
	"gorm.io/gorm"
	"gorm.io/gorm/clause"
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
// the rows it finds (FOR UPDATE, which also locks the gaps where absent
// keys would go), so that they stay as read until the upsert runs.
//
// ON DUPLICATE KEY UPDATE fires on a clash with any unique key of the
// table, not only with the conflict columns the statement names, so the
// keys read tell inserts from updates only where they are the table's one
// unique key: existingKeys first asks the server for the table's unique
// keys (every one, whether GORM knows of it or not) and refuses the
// upsert, before anything is written, if there is another.
func (d mysqlDialect) existingKeys(ctx context.Context, conn gorm.ConnPool, stmt *gorm.Statement, keys []*schema.Field, models []reflect.Value) (map[string]bool, error) {
	unique, err := mysqlUniqueKeys(ctx, conn, stmt)
	if err != nil {
		return nil, err
	}
	want := make([]string, len(keys))
	for i, f := range keys {
		want[i] = strings.ToLower(f.DBName)
	}
	slices.Sort(want)
	for name, cols := range unique {
		if !slices.Equal(cols, want) {
			return nil, fmt.Errorf("%w: upsert of %s on mysql: the table's unique key %s (%s) is not the conflict key (%s), and ON DUPLICATE KEY UPDATE fires on either; run the statement through outbox.WithoutEvents and record events with outbox.Publish",
				ErrUnidentifiedRows, stmt.Schema.Name, name, strings.Join(cols, ", "), strings.Join(want, ", "))
		}
	}
	return readExistingKeys(ctx, conn, stmt, keys, models, d.bind, " FOR UPDATE", true)
}

// defaultConflictColumns: ON DUPLICATE KEY UPDATE names no columns; the
// primary key stands for them, and existingKeys refuses the upsert if the
// table has another unique key.
func (mysqlDialect) defaultConflictColumns(stmt *gorm.Statement) []clause.Column {
	cols := make([]clause.Column, len(stmt.Schema.PrimaryFields))
	for i, f := range stmt.Schema.PrimaryFields {
		cols[i] = clause.Column{Name: f.DBName}
	}
	return cols
}

// mysqlUniqueKeys returns the unique keys of the statement's table, by
// name, each as its sorted lower-case column names.
func mysqlUniqueKeys(ctx context.Context, conn gorm.ConnPool, stmt *gorm.Statement) (map[string][]string, error) {
	rows, err := conn.QueryContext(ctx, `SELECT INDEX_NAME, COLUMN_NAME FROM information_schema.STATISTICS
WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ? AND NON_UNIQUE = 0`, stmt.Table)
	if err != nil {
		return nil, fmt.Errorf("read the unique keys of %s: %w", stmt.Table, err)
	}
	defer rows.Close()
	keys := map[string][]string{}
	for rows.Next() {
		var name, col string
		if err := rows.Scan(&name, &col); err != nil {
			return nil, err
		}
		keys[name] = append(keys[name], strings.ToLower(col))
	}
	for _, cols := range keys {
		slices.Sort(cols)
	}
	return keys, rows.Err()
}

// errorAbortsTx is false: InnoDB rolls back the failed statement, not its
// transaction (but for a deadlock, which rolls back the whole transaction
// and fails its commit).
func (mysqlDialect) errorAbortsTx() bool { return false }
