// Package outboxtest opens real databases for the library's tests: a
// temporary SQLite file, a PostgreSQL schema of its own on the server
// named by OUTBOX_POSTGRES_DSN, and a MySQL database of its own on the
// server named by OUTBOX_MYSQL_DSN (mysql.go). Each call returns an
// isolated database that is removed when the test ends, and keeps tests
// in other processes from restarting that server meanwhile
// (serverlock.go).
package outboxtest

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"gorm.io/driver/mysql"
	"gorm.io/driver/postgres"
	"gorm.io/driver/sqlite"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver
)

// DefaultPostgresDSN is used when OUTBOX_POSTGRES_DSN is not set.
const DefaultPostgresDSN = "host=127.0.0.1 port=5432 user=postgres dbname=test sslmode=disable"

// PostgresDSN returns the server to test against.
func PostgresDSN() string {
	if dsn := os.Getenv("OUTBOX_POSTGRES_DSN"); dsn != "" {
		return dsn
	}
	return DefaultPostgresDSN
}

// Engine names a database engine the tests run against.
type Engine string

// The engines.
const (
	SQLite   Engine = "SQLite"
	Postgres Engine = "Postgres"
)

// Engines lists every engine, for tests that run one suite against each.
var Engines = []Engine{SQLite, Postgres, MySQL}

// ForEachEngine runs fn as a parallel subtest of t per engine in Engines,
// named after the engine.
func ForEachEngine(t *testing.T, fn func(t *testing.T, e Engine)) {
	t.Helper()
	for _, e := range Engines {
		t.Run(string(e), func(t *testing.T) {
			t.Parallel()
			fn(t, e)
		})
	}
}

// DB is an isolated test database.
type DB struct {
	Engine Engine
	// DSN opens the same database again, for example from a second
	// process.
	DSN string
	// Config is the gorm.Config DB was opened with.
	Config *gorm.Config
}

// Open returns a fresh, empty database on engine e, opened with cfg (nil
// for the defaults), and removes it when t ends. On a server, t holds it
// until then (UseServer).
func Open(t testing.TB, e Engine, cfg *gorm.Config) (*gorm.DB, DB) {
	t.Helper()
	switch e {
	case SQLite:
		return openSQLite(t, cfg)
	case Postgres:
		return openPostgres(t, cfg)
	case MySQL:
		return OpenMySQL(t, cfg)
	}
	t.Fatalf("outboxtest: unknown engine %q", e)
	return nil, DB{}
}

// Reopen opens another *gorm.DB (another pool) on the database info names.
func Reopen(t testing.TB, info DB, cfg *gorm.Config) *gorm.DB {
	t.Helper()
	db, err := gorm.Open(dialector(info.Engine, info.DSN), config(cfg))
	if err != nil {
		t.Fatalf("outboxtest: reopen %s: %v", info.Engine, err)
	}
	t.Cleanup(func() { closeDB(db) })
	return db
}

// Dialector returns the GORM dialector for engine e and dsn, for code
// outside tests (helper processes) that opens a database a test made.
func Dialector(e Engine, dsn string) gorm.Dialector { return dialector(e, dsn) }

func dialector(e Engine, dsn string) gorm.Dialector {
	switch e {
	case Postgres:
		return postgres.Open(dsn)
	case MySQL:
		return mysql.Open(dsn)
	}
	return sqlite.Open(dsn)
}

func config(cfg *gorm.Config) *gorm.Config {
	if cfg == nil {
		cfg = &gorm.Config{}
	}
	c := *cfg
	if c.Logger == nil {
		c.Logger = logger.Discard
	}
	return &c
}

// SQLiteDSN returns the DSN the tests use for a SQLite file: WAL, a busy
// timeout, and BEGIN IMMEDIATE so that concurrent writers queue instead of
// failing.
func SQLiteDSN(path string) string {
	// A file: URI ends its path at ? or #, and decodes %: escape them, as
	// t.TempDir keeps them from test names.
	path = strings.NewReplacer("%", "%25", "?", "%3f", "#", "%23").Replace(path)
	return "file:" + path + "?_busy_timeout=10000&_journal_mode=WAL&_txlock=immediate&_foreign_keys=1"
}

func openSQLite(t testing.TB, cfg *gorm.Config) (*gorm.DB, DB) {
	t.Helper()
	dsn := SQLiteDSN(filepath.Join(t.TempDir(), "outbox.db"))
	db, err := gorm.Open(sqlite.Open(dsn), config(cfg))
	if err != nil {
		t.Fatalf("outboxtest: open SQLite: %v", err)
	}
	t.Cleanup(func() { closeDB(db) })
	return db, DB{Engine: SQLite, DSN: dsn, Config: cfg}
}

func openPostgres(t testing.TB, cfg *gorm.Config) (*gorm.DB, DB) {
	t.Helper()
	UseServer(t, Postgres)
	base := PostgresDSN()
	admin := openAdmin(t, "pgx", base, "PostgreSQL", "OUTBOX_POSTGRES_DSN")
	schema := uniqueName()
	if _, err := admin.Exec(`CREATE SCHEMA ` + schema); err != nil {
		admin.Close()
		t.Fatalf("outboxtest: create schema: %v", err)
	}
	dsn := base + " search_path=" + schema
	db, err := gorm.Open(postgres.Open(dsn), config(cfg))
	if err != nil {
		admin.Close()
		t.Fatalf("outboxtest: open PostgreSQL: %v", err)
	}
	t.Cleanup(func() {
		closeDB(db)
		if _, err := admin.Exec(`DROP SCHEMA ` + schema + ` CASCADE`); err != nil && !strings.Contains(err.Error(), "does not exist") {
			t.Errorf("outboxtest: drop schema %s: %v", schema, err)
		}
		admin.Close()
	})
	return db, DB{Engine: Postgres, DSN: dsn, Config: cfg}
}

func closeDB(db *gorm.DB) {
	if sqlDB, err := db.DB(); err == nil {
		sqlDB.Close()
	}
}

// WaitUntil polls cond every millisecond and fails t if it does not hold
// within ten seconds; what names the awaited condition in the failure.
func WaitUntil(t testing.TB, cond func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}
