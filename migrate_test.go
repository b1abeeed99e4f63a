package outbox_test

import (
	"context"
	"io/fs"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// oldSchema is the table that AutoMigrate created before migrations were
// versioned: the first migration, applied without a version table.
func oldSchema(t *testing.T, e outboxtest.Engine) []string {
	t.Helper()
	dir := map[outboxtest.Engine]string{outboxtest.SQLite: "sqlite", outboxtest.Postgres: "postgres", outboxtest.MySQL: "mysql"}[e]
	text, err := fs.ReadFile(outbox.Migrations, "migrations/"+dir+"/0001_init.up.sql")
	mustNil(t, err)
	var stmts []string
	for _, s := range strings.Split(string(text), ";\n") {
		if s = strings.TrimSpace(stripComments(s)); s != "" && !strings.Contains(s, "outbox_records_migrations") {
			stmts = append(stmts, s)
		}
	}
	return stmts
}

func stripComments(s string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(l), "--") {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

func TestAutoMigrateUpgradesATableOfTheUnversionedSchemaKeepingEveryRow(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		db, _ := outboxtest.Open(t, e, nil)
		for _, stmt := range oldSchema(t, e) {
			mustNil(t, db.Exec(stmt).Error)
		}
		mustNil(t, db.Use(outbox.Plugin()))
		// Rows as the old code wrote them: pending ones, and a dead letter.
		publishN(t, db, "a", 3)
		publishN(t, db, "b", 1)
		mustNil(t, db.Exec(`UPDATE outbox_records SET delivery_state = 'failed', last_error = 'old' WHERE aggregate_id = 'b'`).Error)

		mustNil(t, outbox.AutoMigrate(db))
		mustNil(t, outbox.AutoMigrate(db)) // and again: nothing to do

		var versions []int
		mustNil(t, db.Raw(`SELECT version FROM outbox_records_migrations ORDER BY version`).Scan(&versions).Error)
		if !slices.Equal(versions, []int{1, 2, 3, 4}) {
			t.Fatalf("recorded versions %v, want [1 2 3 4]", versions)
		}
		rec := &recorder{}
		d := newDispatcher(t, db, rec)
		dispatch(t, d)
		if got := strings.Join(rec.AcceptedIDs(), " "); got != "agg/a#1 agg/a#2 agg/a#3" {
			t.Fatalf("delivered %s after the upgrade, want a's three events", got)
		}
		// The old dead letter has no recorded kind: the sweep leaves it, a
		// person's requeue moves it.
		if n, err := d.RetryFailed(context.Background()); n != 0 || err != nil {
			t.Fatalf("RetryFailed = %d, %v; want 0 for a dead letter of the old schema", n, err)
		}
		if n, err := d.Requeue(context.Background(), outbox.RequeueFilter{}); n != 1 || err != nil {
			t.Fatalf("Requeue = %d, %v; want 1", n, err)
		}
		dispatch(t, d)
		if got := len(rec.AcceptedIDs()); got != 4 {
			t.Fatalf("delivered %d events, want all 4", got)
		}
	})
}

func TestAutoMigrateFromManyProcessesAtOnceAppliesEachVersionOnce(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		_, info := outboxtest.Open(t, e, nil)
		var wg sync.WaitGroup
		errs := make(chan error, 6)
		for range 6 {
			db := outboxtest.Reopen(t, info, nil)
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs <- outbox.AutoMigrate(db)
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			mustNil(t, err)
		}
		db := outboxtest.Reopen(t, info, nil)
		var n int64
		mustNil(t, db.Raw(`SELECT count(*) FROM outbox_records_migrations`).Scan(&n).Error)
		if n != 4 {
			t.Fatalf("%d versions recorded, want 4", n)
		}
	})
}

func TestMigrationsAreTheFilesAutoMigrateApplies(t *testing.T) {
	for _, dir := range []string{"postgres", "sqlite", "mysql"} {
		entries, err := fs.ReadDir(outbox.Migrations, "migrations/"+dir)
		mustNil(t, err)
		var names []string
		for _, e := range entries {
			names = append(names, e.Name())
		}
		if got := strings.Join(names, " "); got != "0001_init.up.sql 0002_dead_letters.up.sql 0003_shard_window.up.sql 0004_discarded.up.sql" {
			t.Errorf("%s migrations: %s", dir, got)
		}
	}
}

// Each file is a goose migration ("-- +goose Up" first) whose last
// statement records its own version and name, which is how AutoMigrate
// knows what a tool applied (compat/migrationtools applies them with
// golang-migrate and goose).
func TestEveryMigrationIsAGooseMigrationThatRecordsItsVersion(t *testing.T) {
	record := regexp.MustCompile(`(?s)INSERT INTO outbox_records_migrations \(version, name, applied_at\)\s+VALUES \((\d+), '([a-z0-9_]+)', [^;]+\);\s*$`)
	file := regexp.MustCompile(`^0*(\d+)_([a-z0-9_]+)\.up\.sql$`)
	for _, dir := range []string{"postgres", "sqlite", "mysql"} {
		entries, err := fs.ReadDir(outbox.Migrations, "migrations/"+dir)
		mustNil(t, err)
		for _, e := range entries {
			text, err := fs.ReadFile(outbox.Migrations, "migrations/"+dir+"/"+e.Name())
			mustNil(t, err)
			if !strings.HasPrefix(string(text), "-- +goose Up\n") {
				t.Errorf("%s/%s does not begin with -- +goose Up", dir, e.Name())
			}
			f, r := file.FindStringSubmatch(e.Name()), record.FindStringSubmatch(string(text))
			if r == nil || f == nil || r[1] != f[1] || r[2] != f[2] {
				t.Errorf("%s/%s does not end by recording version %v: found %v", dir, e.Name(), f, r)
			}
		}
	}
}
