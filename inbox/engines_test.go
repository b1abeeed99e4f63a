package inbox_test

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	gomysql "github.com/go-sql-driver/mysql"
	"gorm.io/driver/mysql"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// engine names a database engine the inbox is tested on.
type engine string

const (
	sqliteEngine          = engine(outboxtest.SQLite)
	postgresEngine        = engine(outboxtest.Postgres)
	mysqlEngine    engine = "MySQL"
)

// engines lists every engine the inbox supports.
var engines = []engine{sqliteEngine, postgresEngine, mysqlEngine}

// outboxEngine reports whether the outbox itself (the plugin and the
// dispatcher) runs on e.
func (e engine) outboxEngine() bool { return e != mysqlEngine }

// defaultMySQLDSN is used when OUTBOX_MYSQL_DSN is not set.
const defaultMySQLDSN = "root@tcp(127.0.0.1:3306)/test?parseTime=true"

func mysqlDSN() string {
	if dsn := os.Getenv("OUTBOX_MYSQL_DSN"); dsn != "" {
		return dsn
	}
	return defaultMySQLDSN
}

// testDB names an isolated test database, so that another pool or process
// can open it again.
type testDB struct {
	engine engine
	dsn    string
}

// openDB returns a fresh, empty database on e, removed when t ends.
func openDB(t testing.TB, e engine) (*gorm.DB, testDB) {
	t.Helper()
	if e == mysqlEngine {
		return openMySQL(t)
	}
	db, info := outboxtest.Open(t, outboxtest.Engine(e), nil)
	return db, testDB{engine: e, dsn: info.DSN}
}

// reopen opens another pool on info's database, closed when t ends.
func reopen(t testing.TB, info testDB) *gorm.DB {
	t.Helper()
	db, err := gorm.Open(dialector(info), &gorm.Config{Logger: logger.Discard})
	if err != nil {
		t.Fatalf("reopen %s: %v", info.engine, err)
	}
	t.Cleanup(func() { closeDB(db) })
	return db
}

func dialector(info testDB) gorm.Dialector {
	if info.engine == mysqlEngine {
		return mysql.Open(info.dsn)
	}
	return outboxtest.Dialector(outboxtest.Engine(info.engine), info.dsn)
}

func closeDB(db *gorm.DB) {
	if sqlDB, err := db.DB(); err == nil {
		sqlDB.Close()
	}
}

var mysqlSeq atomic.Int64

// openMySQL creates a database of its own on the server named by
// OUTBOX_MYSQL_DSN and drops it when t ends, holding the server meanwhile
// against restarts by other packages' tests.
func openMySQL(t testing.TB) (*gorm.DB, testDB) {
	t.Helper()
	outboxtest.UseServer(t, outboxtest.MySQL)
	base := mysqlDSN()
	cfg, err := gomysql.ParseDSN(base)
	if err != nil {
		t.Fatalf("OUTBOX_MYSQL_DSN %q: %v", base, err)
	}
	admin, err := sql.Open("mysql", base)
	if err == nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err = admin.PingContext(ctx)
		cancel()
	}
	if err != nil {
		if admin != nil {
			admin.Close()
		}
		if os.Getenv("CI") == "true" {
			t.Fatalf("MySQL/MariaDB at %q does not answer (CI=true, so this fails instead of skipping): %v", base, err)
		}
		t.Skipf("skipping: no MySQL/MariaDB server at %q (set OUTBOX_MYSQL_DSN): %v", base, err)
	}
	name := fmt.Sprintf("inbox_test_%d_%d_%d", os.Getpid(), time.Now().UnixNano()%1e9, mysqlSeq.Add(1))
	if _, err := admin.Exec("CREATE DATABASE `" + name + "`"); err != nil {
		admin.Close()
		t.Fatalf("create database %s: %v", name, err)
	}
	cfg.DBName = name
	cfg.ParseTime = true
	info := testDB{engine: mysqlEngine, dsn: cfg.FormatDSN()}
	db, err := gorm.Open(mysql.Open(info.dsn), &gorm.Config{Logger: logger.Discard})
	if err != nil {
		admin.Close()
		t.Fatalf("open MySQL database %s: %v", name, err)
	}
	t.Cleanup(func() {
		closeDB(db)
		if _, err := admin.Exec("DROP DATABASE `" + name + "`"); err != nil && !strings.Contains(err.Error(), "doesn't exist") {
			t.Errorf("drop database %s: %v", name, err)
		}
		admin.Close()
	})
	return db, info
}

// forEachEngine runs test once per engine, in parallel subtests.
func forEachEngine(t *testing.T, test func(t *testing.T, e engine)) {
	t.Helper()
	forEngines(t, engines, test)
}

// forEachOutboxEngine runs test once per engine the outbox runs on.
func forEachOutboxEngine(t *testing.T, test func(t *testing.T, e engine)) {
	t.Helper()
	var es []engine
	for _, e := range engines {
		if e.outboxEngine() {
			es = append(es, e)
		}
	}
	forEngines(t, es, test)
}

func forEngines(t *testing.T, es []engine, test func(t *testing.T, e engine)) {
	t.Helper()
	for _, e := range es {
		t.Run(string(e), func(t *testing.T) {
			t.Parallel()
			test(t, e)
		})
	}
}
