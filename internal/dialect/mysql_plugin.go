package dialect

import (
	"context"
	"database/sql"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"time"

	"gorm.io/gorm"
)

// mysqlFlavour returns the dialect for db's MySQL server: MariaDB has
// INSERT ... RETURNING and DELETE ... RETURNING (since 10.5), MySQL has no
// RETURNING at all. GORM's dialector (gorm.io/driver/mysql's Dialector,
// through its embedded *Config) learns the server's version when it opens,
// unless told to skip that: the server is then taken for MySQL. The field
// is read by name, so that this package does not import the MySQL driver.
func mysqlFlavour(db *gorm.DB) mysqlDialect {
	var version string
	v := reflect.ValueOf(db.Dialector)
	if v.Kind() == reflect.Pointer && !v.IsNil() {
		v = v.Elem()
	}
	if v.Kind() == reflect.Struct {
		if f := field(v, "ServerVersion"); f.Kind() == reflect.String {
			version = f.String()
		}
	}
	return mysqlDialect{mariadb: strings.Contains(strings.ToLower(version), "mariadb")}
}

// ReturnsRows: on MariaDB, creates and deletes take RETURNING; updates
// never do, on either server: the plugin locks and reads the rows their
// WHERE matches first.
func (d mysqlDialect) ReturnsRows(update bool) bool { return d.mariadb && !update }

// InsertedColumn is empty: nothing in a row tells an upsert's insert from
// its update, so the plugin reads the existing keys first (KeyReads).
func (mysqlDialect) InsertedColumn() string { return "" }

// KeyReads: ON DUPLICATE KEY UPDATE fires on a clash with any unique key
// of the table, so the plugin asks the server for the table's unique keys
// (every one, whether GORM knows of it or not) and reads, inside the
// statement's transaction, the rows that clash with the statement's rows
// on any of them, locking them (FOR UPDATE, which under REPEATABLE READ
// also locks the gaps where absent keys would go), so that they stay as
// read until the upsert runs. The rows the upsert returns are then told
// apart by primary key (outbox's upsert.go).
func (mysqlDialect) KeyReads() KeyReads {
	return KeyReads{Lock: " FOR UPDATE", RowList: true, PrimaryKey: true, UniqueKeys: mysqlUniqueKeys}
}

// mysqlUniqueKeys returns the unique keys of table, by name, each as its
// sorted lower-case column names: of the table in the database its name
// gives (otherdb.labels), or else in the connection's. A part that indexes
// a prefix of its column is named with the prefix's length, col(10), and
// one that indexes an expression (MySQL 8) is named "(expression)":
// neither is a column. A table the server does not know has none.
func mysqlUniqueKeys(ctx context.Context, conn gorm.ConnPool, table string) (map[string][]string, error) {
	database, name, qualified := strings.Cut(table, ".")
	where, args := "TABLE_SCHEMA = ? AND TABLE_NAME = ?", []any{database, name}
	if !qualified {
		where, args = "TABLE_SCHEMA = DATABASE() AND TABLE_NAME = ?", []any{table}
	}
	rows, err := conn.QueryContext(ctx, `SELECT INDEX_NAME, COLUMN_NAME, SUB_PART FROM information_schema.STATISTICS
WHERE `+where+` AND NON_UNIQUE = 0`, args...)
	if err != nil {
		return nil, fmt.Errorf("read the unique keys of %s: %w", table, err)
	}
	defer rows.Close()
	keys := map[string][]string{}
	for rows.Next() {
		var name string
		var col sql.NullString
		var prefix sql.NullInt64
		if err := rows.Scan(&name, &col, &prefix); err != nil {
			return nil, err
		}
		part := strings.ToLower(col.String)
		switch {
		case !col.Valid:
			part = "(expression)"
		case prefix.Valid:
			part = fmt.Sprintf("%s(%d)", part, prefix.Int64)
		}
		keys[name] = append(keys[name], part)
	}
	for _, cols := range keys {
		slices.Sort(cols)
	}
	return keys, rows.Err()
}

// ErrorAbortsTx is false: InnoDB rolls back the failed statement, not its
// transaction (but for a deadlock, which rolls back the whole transaction
// and fails its commit).
func (mysqlDialect) ErrorAbortsTx() bool { return false }

// CheckConn: the connection must read DATETIME columns as time.Time,
// which go-sql-driver/mysql does only with parseTime=true in the DSN.
// Without it the driver returns text: the plugin, which reads back the
// rows of emitting models, cannot scan their time fields, so their writes
// fail; and the dispatcher reads its own timestamps as UTC whatever the
// DSN's loc, off by loc's offset. It asks the server for one DATETIME and
// looks at what the driver returns, so that this package imports no
// driver.
func (mysqlDialect) CheckConn(ctx context.Context, conn gorm.ConnPool) error {
	var v any
	if err := conn.QueryRowContext(ctx, `SELECT CAST('2000-01-01 00:00:00' AS DATETIME)`).Scan(&v); err != nil {
		return fmt.Errorf("checking that the MySQL DSN has parseTime=true: %w", err)
	}
	if _, ok := v.(time.Time); !ok {
		return fmt.Errorf("%w: the MySQL DSN needs parseTime=true: without it the driver reads DATETIME columns as text, which the plugin cannot scan into a model's time fields and the dispatcher reads in UTC whatever loc says", ErrUnfitConn)
	}
	return nil
}

// Settings: none that the documentation asks for.
func (mysqlDialect) Settings(context.Context, gorm.ConnPool, Tables) []Warning { return nil }
