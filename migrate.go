package outbox

import (
	"context"
	"embed"
	"fmt"
	"io/fs"
	"path"
	"regexp"
	"sort"
	"strconv"
	"strings"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox/internal/dialect"
)

// Migrations holds the schema as ordered SQL files per engine, the same
// files AutoMigrate applies: migrations/postgres/0001_init.up.sql, ...,
// migrations/mysql/..., migrations/sqlite/... Each file is one version,
// named as golang-migrate and goose both read it, and begins with goose's
// "-- +goose Up"; each statement ends with a semicolon at the end of a
// line. The first file creates the version table outbox_records_migrations
// and every file ends by recording its version there, so AutoMigrate takes
// a schema a tool applied as current and applies only what the tool has
// not. The files name the default table, outbox_records: a tool applies
// them for that name only, not for another [WithTable] name.
//
// With golang-migrate, take the engine's directory through its iofs
// source (on MySQL the DSN needs multiStatements=true):
//
//	src, err := iofs.New(outbox.Migrations, "migrations/postgres")
//	m, err := migrate.NewWithSourceInstance("iofs", src, databaseURL)
//	err = m.Up()
//
// With goose, a provider on the same directory:
//
//	dir, err := fs.Sub(outbox.Migrations, "migrations/postgres")
//	p, err := goose.NewProvider(goose.DialectPostgres, sqlDB, dir)
//	_, err = p.Up(ctx)
//
// If the database has migrations of its own under the same tool, give the
// outbox's a version table of their own (golang-migrate's
// x-migrations-table, goose.WithTableName). The reverse hand-over is by
// hand: a tool's version table knows nothing of what AutoMigrate applied,
// and a tool run on such a database fails on version 1 (its record exists)
// and changes nothing; tell the tool the database's version first
// (golang-migrate's Force, rows in goose's table): docs/design.md,
// "Migrations".
//
//go:embed migrations
var Migrations embed.FS

// migration is one versioned SQL file of an engine.
type migration struct {
	version int
	name    string
	sql     string
}

var migrationFile = regexp.MustCompile(`^(\d{4})_([a-z0-9_]+)\.up\.sql$`)

// migrationsFor reads the migrations of engine, in version order.
func migrationsFor(engine string) ([]migration, error) {
	dir := path.Join("migrations", engine)
	entries, err := fs.ReadDir(Migrations, dir)
	if err != nil {
		return nil, fmt.Errorf("outbox: migrations of %s: %w", engine, err)
	}
	var ms []migration
	for _, e := range entries {
		m := migrationFile.FindStringSubmatch(e.Name())
		if m == nil {
			continue
		}
		text, err := fs.ReadFile(Migrations, path.Join(dir, e.Name()))
		if err != nil {
			return nil, fmt.Errorf("outbox: migrations of %s: %w", engine, err)
		}
		v, _ := strconv.Atoi(m[1])
		ms = append(ms, migration{version: v, name: m[2], sql: string(text)})
	}
	sort.Slice(ms, func(i, j int) bool { return ms[i].version < ms[j].version })
	return ms, nil
}

// defaultName is how the migration files name the records table; every
// other name in them (the sequences table, the indexes) starts with it.
var defaultName = regexp.MustCompile(`\b` + DefaultTable + `(\w*)`)

// statementsOf splits a migration into its statements, naming t's tables
// and indexes instead of the default ones, and leaves out comments.
func statementsOf(m migration, t dialect.Tables) []string {
	var out []string
	var cur strings.Builder
	for _, line := range strings.Split(m.sql, "\n") {
		trimmed := strings.TrimSpace(line)
		if trimmed == "" || strings.HasPrefix(trimmed, "--") {
			continue
		}
		cur.WriteString(line)
		cur.WriteByte('\n')
		if strings.HasSuffix(trimmed, ";") {
			stmt := strings.TrimSuffix(strings.TrimSpace(cur.String()), ";")
			out = append(out, defaultName.ReplaceAllStringFunc(stmt, func(s string) string {
				return t.Quote(t.Name + strings.TrimPrefix(s, DefaultTable))
			}))
			cur.Reset()
		}
	}
	return out
}

// AutoMigrate brings the outbox tables of db up to the newest schema
// version: it applies, in order, the migrations (see [Migrations]) that
// the table's version table (<table>_migrations) does not list, and
// records each. It uses the table name of the plugin registered on db, or
// [DefaultTable] when there is none.
//
// It is safe to call at every start-up and from many processes at once:
// they queue on a lock (an advisory lock on PostgreSQL, the database's
// write lock on SQLite, GET_LOCK on MySQL), and all but the first find
// nothing to do. On PostgreSQL and SQLite each version applies in one
// transaction; MySQL commits each DDL statement on its own, so a process
// that dies between a version's statements and its record leaves a
// version that the next AutoMigrate cannot apply again (it fails with a
// duplicate column): drop what it added, or record the version by hand. A
// table created before migrations were versioned is upgraded in place:
// its first version's statements find everything there, and later ones
// add what is new, keeping every row.
func AutoMigrate(db *gorm.DB) error {
	return autoMigrate(context.Background(), db)
}

func autoMigrate(ctx context.Context, db *gorm.DB) error {
	d, err := dialect.For(db)
	if err != nil {
		return err
	}
	t := d.Tables(tableNameOf(db))
	ms, err := migrationsFor(d.Name())
	if err != nil {
		return err
	}
	versions := t.Quote(t.Name + "_migrations")
	err = d.MigrateTx(ctx, db, t, func(q dialect.Querier) error {
		if _, err := q.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS `+versions+` (
	version    integer PRIMARY KEY,
	name       varchar(200) NOT NULL,
	applied_at varchar(40)  NOT NULL
)`); err != nil {
			return err
		}
		applied := map[int]bool{}
		rows, err := q.QueryContext(ctx, `SELECT version FROM `+versions)
		if err != nil {
			return err
		}
		for rows.Next() {
			var v int
			if err := rows.Scan(&v); err != nil {
				rows.Close()
				return err
			}
			applied[v] = true
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return err
		}
		for _, m := range ms {
			if applied[m.version] {
				continue
			}
			// The version's last statement records it.
			for _, stmt := range statementsOf(m, t) {
				if _, err := q.ExecContext(ctx, stmt); err != nil {
					return fmt.Errorf("version %d (%s): %w", m.version, m.name, err)
				}
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("outbox: migrate %s: %w", t.Name, err)
	}
	return nil
}
