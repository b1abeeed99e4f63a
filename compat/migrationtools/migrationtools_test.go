package migrationtools_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io/fs"
	"slices"
	"strings"
	"testing"

	"github.com/golang-migrate/migrate/v4"
	migratedb "github.com/golang-migrate/migrate/v4/database"
	migratemysql "github.com/golang-migrate/migrate/v4/database/mysql"
	migratepgx "github.com/golang-migrate/migrate/v4/database/pgx/v5"
	migratesqlite "github.com/golang-migrate/migrate/v4/database/sqlite3"
	"github.com/golang-migrate/migrate/v4/source/iofs"
	"github.com/pressly/goose/v3"
	goosedb "github.com/pressly/goose/v3/database"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

var ctx = context.Background()

// engine is how each tool reaches one engine's database.
type engine struct {
	engine outboxtest.Engine
	dir    string // of outbox.Migrations
	// sqlDriver and toolDSN open the *sql.DB the tools work on, from the
	// DSN of an outboxtest database.
	sqlDriver    string
	toolDSN      func(dsn string) string
	migrateWith  func(db *sql.DB) (migratedb.Driver, error)
	gooseDialect goosedb.Dialect
}

var engines = []engine{
	{
		engine: outboxtest.Postgres, dir: "postgres", sqlDriver: "pgx",
		toolDSN: func(dsn string) string { return dsn },
		migrateWith: func(db *sql.DB) (migratedb.Driver, error) {
			return migratepgx.WithInstance(db, &migratepgx.Config{MigrationsTable: migrateTable})
		},
		gooseDialect: goosedb.DialectPostgres,
	},
	{
		engine: outboxtest.MySQL, dir: "mysql", sqlDriver: "mysql",
		// golang-migrate sends a file as one multi-statement query.
		toolDSN: func(dsn string) string { return dsn + "&multiStatements=true" },
		migrateWith: func(db *sql.DB) (migratedb.Driver, error) {
			return migratemysql.WithInstance(db, &migratemysql.Config{MigrationsTable: migrateTable})
		},
		gooseDialect: goosedb.DialectMySQL,
	},
	{
		engine: outboxtest.SQLite, dir: "sqlite", sqlDriver: "sqlite3",
		toolDSN: func(dsn string) string { return dsn },
		migrateWith: func(db *sql.DB) (migratedb.Driver, error) {
			return migratesqlite.WithInstance(db, &migratesqlite.Config{MigrationsTable: migrateTable})
		},
		gooseDialect: goosedb.DialectSQLite3,
	},
}

// The tools' version tables for the outbox's migrations, apart from any of
// the application's own (docs/design.md).
const (
	migrateTable = "outbox_schema_migrations"
	gooseTable   = "outbox_goose_db_version"
)

// newest is the newest schema version, as the files name it.
const newest = 4

// tool is a migration tool as a user runs it on outbox.Migrations.
type tool struct {
	name string
	// up applies the versions the tool has not recorded, up to version (0
	// for all), on db, and reports whether it applied any.
	up func(e engine, db *sql.DB, version int) (bool, error)
	// handOver tells the tool that the database is at version, as the
	// docs say to for a database that AutoMigrate migrated.
	handOver func(e engine, db *sql.DB, version int) error
}

var tools = []tool{
	{name: "golang-migrate", up: migrateUp, handOver: migrateForce},
	{name: "goose", up: gooseUp, handOver: gooseRecord},
}

// openSQL opens the *sql.DB a tool works on, for the database dsn names.
func openSQL(t *testing.T, e engine, dsn string) *sql.DB {
	t.Helper()
	db, err := sql.Open(e.sqlDriver, e.toolDSN(dsn))
	must(t, err)
	t.Cleanup(func() { db.Close() })
	return db
}

// up runs tl on the database dsn names and fails t if it fails.
func up(t *testing.T, tl tool, e engine, dsn string, version int) bool {
	t.Helper()
	applied, err := tl.up(e, openSQL(t, e, dsn), version)
	if err != nil {
		t.Fatalf("%s up: %v", tl.name, err)
	}
	return applied
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// newMigrate returns golang-migrate on db with outbox.Migrations as its
// source. Its Close closes db.
func newMigrate(e engine, db *sql.DB) (*migrate.Migrate, error) {
	drv, err := e.migrateWith(db)
	if err != nil {
		return nil, err
	}
	src, err := iofs.New(outbox.Migrations, "migrations/"+e.dir)
	if err != nil {
		return nil, err
	}
	return migrate.NewWithInstance("iofs", src, e.dir, drv)
}

func migrateUp(e engine, db *sql.DB, version int) (bool, error) {
	m, err := newMigrate(e, db)
	if err != nil {
		return false, err
	}
	defer m.Close()
	if version == 0 {
		err = m.Up()
	} else {
		err = m.Migrate(uint(version))
	}
	if errors.Is(err, migrate.ErrNoChange) {
		return false, nil
	}
	return err == nil, err
}

func migrateForce(e engine, db *sql.DB, version int) error {
	m, err := newMigrate(e, db)
	if err != nil {
		return err
	}
	defer m.Close()
	return m.Force(version)
}

func gooseProvider(e engine, db *sql.DB) (*goose.Provider, error) {
	dir, err := fs.Sub(outbox.Migrations, "migrations/"+e.dir)
	if err != nil {
		return nil, err
	}
	return goose.NewProvider(e.gooseDialect, db, dir, goose.WithTableName(gooseTable))
}

func gooseUp(e engine, db *sql.DB, version int) (bool, error) {
	p, err := gooseProvider(e, db)
	if err != nil {
		return false, err
	}
	var res []*goose.MigrationResult
	if version == 0 {
		res, err = p.Up(ctx)
	} else {
		res, err = p.UpTo(ctx, int64(version))
	}
	return len(res) > 0, err
}

func gooseRecord(e engine, db *sql.DB, version int) error {
	p, err := gooseProvider(e, db)
	if err != nil {
		return err
	}
	// GetDBVersion creates goose's version table, with its version 0.
	if _, err := p.GetDBVersion(ctx); err != nil {
		return err
	}
	store, err := goosedb.NewStore(e.gooseDialect, gooseTable)
	if err != nil {
		return err
	}
	for v := 1; v <= version; v++ {
		if err := store.Insert(ctx, db, goosedb.InsertRequest{Version: int64(v)}); err != nil {
			return err
		}
	}
	return nil
}

// forEach runs fn as a parallel subtest per tool and engine.
func forEach(t *testing.T, fn func(t *testing.T, tl tool, e engine)) {
	for _, tl := range tools {
		for _, e := range engines {
			t.Run(tl.name+"/"+string(e.engine), func(t *testing.T) {
				t.Parallel()
				fn(t, tl, e)
			})
		}
	}
}

// versions returns the versions recorded in outbox_records_migrations, as
// "version name" each.
func versions(t *testing.T, db *gorm.DB) []string {
	t.Helper()
	var rows []struct {
		Version int
		Name    string
	}
	must(t, db.Raw(`SELECT version, name FROM outbox_records_migrations ORDER BY version`).Scan(&rows).Error)
	var out []string
	for _, r := range rows {
		out = append(out, fmt.Sprint(r.Version, " ", r.Name))
	}
	return out
}

var allVersions = []string{"1 init", "2 dead_letters", "3 shard_window", "4 discarded"}

// schema describes the outbox tables of db: each column with its type
// and nullability, and each index with its columns, in name order.
func schema(t *testing.T, e outboxtest.Engine, db *gorm.DB) []string {
	t.Helper()
	var out []string
	scan := func(query string) {
		rows, err := db.Raw(query).Rows()
		must(t, err)
		defer rows.Close()
		for rows.Next() {
			var a, b, c, d sql.NullString
			must(t, rows.Scan(&a, &b, &c, &d))
			out = append(out, strings.Join([]string{a.String, b.String, c.String, d.String}, " "))
		}
		must(t, rows.Err())
	}
	switch e {
	case outboxtest.Postgres:
		scan(`SELECT table_name, column_name, data_type, is_nullable FROM information_schema.columns
WHERE table_schema = current_schema() AND table_name LIKE 'outbox_records%' ORDER BY 1, 2`)
		scan(`SELECT tablename, indexname, regexp_replace(indexdef, ' ON \S+', ''), '' FROM pg_indexes
WHERE schemaname = current_schema() AND tablename LIKE 'outbox_records%' ORDER BY 1, 2`)
		scan(`SELECT stxname, '', '', '' FROM pg_statistic_ext WHERE stxnamespace = current_schema()::regnamespace ORDER BY 1`)
	case outboxtest.MySQL:
		scan(`SELECT table_name, column_name, column_type, concat(is_nullable, ' ', extra) FROM information_schema.columns
WHERE table_schema = database() AND table_name LIKE 'outbox_records%' ORDER BY 1, 2`)
		scan(`SELECT table_name, index_name, group_concat(column_name ORDER BY seq_in_index), non_unique FROM information_schema.statistics
WHERE table_schema = database() AND table_name LIKE 'outbox_records%' GROUP BY 1, 2, 4 ORDER BY 1, 2`)
	case outboxtest.SQLite:
		scan(`SELECT m.name, c.name, c.type, c."notnull" FROM sqlite_master m, pragma_table_info(m.name) c
WHERE m.type = 'table' AND m.name LIKE 'outbox_records%' ORDER BY 1, 2`)
		scan(`SELECT m.name, i.name, i."unique", i.partial FROM sqlite_master m, pragma_index_list(m.name) i
WHERE m.type = 'table' AND m.name LIKE 'outbox_records%' ORDER BY 1, 2`)
	}
	return out
}

// works checks that the outbox runs on db: a write, and its delivery.
func works(t *testing.T, db *gorm.DB) {
	t.Helper()
	must(t, db.Use(outbox.Plugin()))
	must(t, outbox.Publish(db, outbox.Event{Type: "order.placed", AggregateType: "order", AggregateID: "1"}))
	d, err := outbox.NewDispatcher(db, outbox.PublisherFunc(func(context.Context, outbox.Batch) error { return nil }))
	must(t, err)
	if n, err := d.DispatchOnce(ctx); n != 1 || err != nil {
		t.Fatalf("DispatchOnce = %d, %v; want the one event delivered", n, err)
	}
}

// autoMigrated returns the schema that AutoMigrate makes on an empty
// database of engine e.
func autoMigrated(t *testing.T, e outboxtest.Engine) []string {
	t.Helper()
	db, _ := outboxtest.Open(t, e, nil)
	must(t, outbox.AutoMigrate(db))
	return schema(t, e, db)
}

func TestToolAppliesTheMigrationsAndAutoMigrateTakesThemAsCurrent(t *testing.T) {
	forEach(t, func(t *testing.T, tl tool, e engine) {
		db, info := outboxtest.Open(t, e.engine, nil)
		if !up(t, tl, e, info.DSN, 0) {
			t.Fatalf("%s applied nothing to an empty database", tl.name)
		}
		if got := versions(t, db); !slices.Equal(got, allVersions) {
			t.Fatalf("after %s, outbox_records_migrations holds %v, want %v", tl.name, got, allVersions)
		}
		applied := schema(t, e.engine, db)
		if !slices.ContainsFunc(applied, func(s string) bool { return strings.Contains(s, "failure_kind") }) {
			t.Fatalf("the schema %s applied has no column failure_kind (version 2):\n%s", tl.name, strings.Join(applied, "\n"))
		}
		if want := autoMigrated(t, e.engine); !slices.Equal(applied, want) {
			t.Errorf("%s made the schema\n%s\nAutoMigrate makes\n%s", tl.name, strings.Join(applied, "\n"), strings.Join(want, "\n"))
		}

		must(t, outbox.AutoMigrate(db))
		if got := versions(t, db); !slices.Equal(got, allVersions) {
			t.Errorf("after AutoMigrate, outbox_records_migrations holds %v, want %v", got, allVersions)
		}
		if got := schema(t, e.engine, db); !slices.Equal(got, applied) {
			t.Errorf("AutoMigrate changed the schema %s applied:\n%s", tl.name, strings.Join(got, "\n"))
		}
		if up(t, tl, e, info.DSN, 0) {
			t.Errorf("%s applied something again", tl.name)
		}
		works(t, db)
	})
}

func TestAutoMigrateAppliesWhatTheToolHasNotYet(t *testing.T) {
	forEach(t, func(t *testing.T, tl tool, e engine) {
		db, info := outboxtest.Open(t, e.engine, nil)
		up(t, tl, e, info.DSN, 1)
		if got := versions(t, db); !slices.Equal(got, allVersions[:1]) {
			t.Fatalf("after %s up to version 1, outbox_records_migrations holds %v", tl.name, got)
		}
		must(t, outbox.AutoMigrate(db))
		if got := versions(t, db); !slices.Equal(got, allVersions) {
			t.Errorf("after AutoMigrate, outbox_records_migrations holds %v, want %v", got, allVersions)
		}
		works(t, db)
	})
}

// A database that AutoMigrate migrated is handed over to a tool by
// telling the tool the newest version (golang-migrate's force, goose's
// version table); the tool then has nothing to do, and later versions
// would be its to apply.
func TestAutoMigratedDatabaseHandedOverToAToolHasNothingToApply(t *testing.T) {
	forEach(t, func(t *testing.T, tl tool, e engine) {
		db, info := outboxtest.Open(t, e.engine, nil)
		must(t, outbox.AutoMigrate(db))
		before := schema(t, e.engine, db)
		must(t, tl.handOver(e, openSQL(t, e, info.DSN), newest))
		if up(t, tl, e, info.DSN, 0) {
			t.Errorf("%s applied something to a database at version %d", tl.name, newest)
		}
		if got := schema(t, e.engine, db); !slices.Equal(got, before) {
			t.Errorf("%s changed the schema:\n%s", tl.name, strings.Join(got, "\n"))
		}
		if got := versions(t, db); !slices.Equal(got, allVersions) {
			t.Errorf("outbox_records_migrations holds %v, want %v", got, allVersions)
		}
		works(t, db)
	})
}

// Without the hand-over, a tool fails on a database AutoMigrate migrated:
// its first version finds the version recorded already. Nothing is
// changed, the error says what clashed, and the hand-over still serves.
func TestToolWithoutTheHandOverFailsOnAnAutoMigratedDatabase(t *testing.T) {
	forEach(t, func(t *testing.T, tl tool, e engine) {
		db, info := outboxtest.Open(t, e.engine, nil)
		must(t, outbox.AutoMigrate(db))
		before := schema(t, e.engine, db)
		_, err := tl.up(e, openSQL(t, e, info.DSN), 0)
		if err == nil {
			t.Fatalf("%s applied the migrations again without an error", tl.name)
		}
		t.Logf("%s: %v", tl.name, err)
		if got := schema(t, e.engine, db); !slices.Equal(got, before) {
			t.Errorf("%s changed the schema:\n%s", tl.name, strings.Join(got, "\n"))
		}
		// The hand-over still serves (golang-migrate's force clears the
		// dirty mark the failure left).
		must(t, tl.handOver(e, openSQL(t, e, info.DSN), newest))
		if up(t, tl, e, info.DSN, 0) {
			t.Errorf("%s applied something after the hand-over", tl.name)
		}
	})
}
