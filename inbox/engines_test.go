package inbox_test

import (
	"testing"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// engine names a database engine the inbox is tested on.
type engine string

const (
	sqliteEngine   = engine(outboxtest.SQLite)
	postgresEngine = engine(outboxtest.Postgres)
	mysqlEngine    = engine(outboxtest.MySQL)
)

// engines lists every engine the inbox supports.
var engines = []engine{sqliteEngine, postgresEngine, mysqlEngine}

// openDB returns a fresh, empty database on e, removed when t ends; its
// info opens it again from another pool or process.
func openDB(t testing.TB, e engine) (*gorm.DB, outboxtest.DB) {
	t.Helper()
	return outboxtest.Open(t, outboxtest.Engine(e), nil)
}

// reopen opens another pool on info's database, closed when t ends.
func reopen(t testing.TB, info outboxtest.DB) *gorm.DB {
	t.Helper()
	return outboxtest.Reopen(t, info, nil)
}

// forEachEngine runs test once per engine, in parallel subtests.
func forEachEngine(t *testing.T, test func(t *testing.T, e engine)) {
	t.Helper()
	for _, e := range engines {
		t.Run(string(e), func(t *testing.T) {
			t.Parallel()
			test(t, e)
		})
	}
}
