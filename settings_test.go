package outbox_test

import (
	"path/filepath"
	"strings"
	"testing"

	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// settingWarnings registers the plugin on db and makes a dispatcher on it,
// and returns the warnings each logged.
func settingWarnings(t *testing.T, db *gorm.DB) (atUse, atNewDispatcher []string) {
	t.Helper()
	pluginLog, plugin := outboxtest.CaptureLogger(t)
	mustNil(t, db.Use(outbox.Plugin(outbox.WithPluginLogger(pluginLog))))
	mustNil(t, outbox.AutoMigrate(db))
	dispatcherLog, dispatcher := outboxtest.CaptureLogger(t)
	_, err := outbox.NewDispatcher(db, &recorder{}, outbox.WithLogger(dispatcherLog))
	mustNil(t, err)
	return plugin.Warnings(), dispatcher.Warnings()
}

// checkWarnings fails t unless got holds one warning per entry of want,
// each containing its entry, in order.
func checkWarnings(t *testing.T, where string, got, want []string) {
	t.Helper()
	ok := len(got) == len(want)
	for i := 0; ok && i < len(want); i++ {
		ok = strings.Contains(got[i], want[i])
	}
	if !ok {
		t.Errorf("%s logged warnings %q, want one per %q", where, got, want)
	}
}

func TestSQLiteOpenedWithoutWALOrBusyTimeoutIsWarnedAbout(t *testing.T) {
	cases := []struct {
		name  string
		query string // of the file: DSN
		want  []string
	}{
		{name: "plain file DSN", query: "", want: []string{"without the WAL journal mode"}},
		{name: "no busy timeout", query: "?_busy_timeout=0&_journal_mode=WAL", want: []string{"without a busy timeout"}},
		{name: "neither", query: "?_busy_timeout=0", want: []string{"without the WAL journal mode", "without a busy timeout"}},
		{name: "the README's DSN", query: "?_busy_timeout=5000&_journal_mode=WAL&_txlock=immediate"},
		{name: "in memory", query: ":memory:"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			dsn := "file:" + filepath.Join(t.TempDir(), "app.db") + tc.query
			if tc.query == ":memory:" {
				dsn = tc.query
			}
			db, err := gorm.Open(outboxtest.Dialector(outboxtest.SQLite, dsn), &gorm.Config{Logger: logger.Discard})
			mustNil(t, err)
			t.Cleanup(func() {
				if sqlDB, err := db.DB(); err == nil {
					sqlDB.Close()
				}
			})
			if tc.query == ":memory:" {
				sqlDB, err := db.DB()
				mustNil(t, err)
				sqlDB.SetMaxOpenConns(1) // one in-memory database
			}
			atUse, atNewDispatcher := settingWarnings(t, db)
			checkWarnings(t, "db.Use", atUse, tc.want)
			checkWarnings(t, "NewDispatcher", atNewDispatcher, tc.want)
		})
	}
}

func TestPostgresWithAutovacuumOffIsWarnedAbout(t *testing.T) {
	// This test does not change the server's setting: it expects the
	// server's warning when the server runs without autovacuum (this
	// machine's does), and disables autovacuum on the outbox tables.
	db, info := outboxtest.Open(t, outboxtest.Postgres, nil)
	var server string
	mustNil(t, db.Raw(`SHOW autovacuum`).Row().Scan(&server))
	var want []string
	if server != "on" {
		want = append(want, "PostgreSQL runs with autovacuum off")
	}
	atUse, atNewDispatcher := settingWarnings(t, db)
	checkWarnings(t, "db.Use", atUse, want)
	checkWarnings(t, "NewDispatcher", atNewDispatcher, want)

	mustNil(t, db.Exec(`ALTER TABLE outbox_records SET (autovacuum_enabled = false)`).Error)
	mustNil(t, db.Exec(`ALTER TABLE outbox_records_sequences SET (autovacuum_enabled = off, fillfactor = 90)`).Error)
	want = append(want, "autovacuum is disabled on outbox tables")
	atUse, atNewDispatcher = settingWarnings(t, outboxtest.Reopen(t, info, nil))
	checkWarnings(t, "db.Use", atUse, want)
	checkWarnings(t, "NewDispatcher", atNewDispatcher, want)
	if w := atNewDispatcher[len(atNewDispatcher)-1]; !strings.Contains(w, "outbox_records outbox_records_sequences") {
		t.Errorf("warning %q does not name both tables", w)
	}
}

// TestDatabasesOpenedAsTheDocsSayAreNotWarnedAbout opens each engine as
// the tests do (SQLite with the README's settings), and expects no
// warning but the PostgreSQL server's autovacuum when it is off.
func TestDatabasesOpenedAsTheDocsSayAreNotWarnedAbout(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		db, _ := outboxtest.Open(t, e, nil)
		var want []string
		if e == outboxtest.Postgres {
			var server string
			mustNil(t, db.Raw(`SHOW autovacuum`).Row().Scan(&server))
			if server != "on" {
				want = append(want, "PostgreSQL runs with autovacuum off")
			}
		}
		atUse, atNewDispatcher := settingWarnings(t, db)
		checkWarnings(t, "db.Use", atUse, want)
		checkWarnings(t, "NewDispatcher", atNewDispatcher, want)
	})
}

func TestWithPluginLoggerRefusesNil(t *testing.T) {
	db, _ := outboxtest.Open(t, outboxtest.SQLite, nil)
	err := db.Use(outbox.Plugin(outbox.WithPluginLogger(nil)))
	if err == nil || !strings.Contains(err.Error(), "WithPluginLogger") {
		t.Fatalf("db.Use with a nil logger returned %v, want ErrInvalidOption naming WithPluginLogger", err)
	}
}
