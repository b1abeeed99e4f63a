package outbox

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox/internal/dialect"
)

// WithPluginLogger sets the logger of the plugin (default slog.Default()
// when [Plugin] is called). The plugin logs only at db.Use: one warning
// for each database setting that the documentation says matters and that
// the database runs without (see [OutboxPlugin.Initialize]).
func WithPluginLogger(l *slog.Logger) Option {
	return func(p *OutboxPlugin) error {
		if l == nil {
			return fmt.Errorf("%w: WithPluginLogger: nil logger", ErrInvalidOption)
		}
		p.log = l
		return nil
	}
}

// settingsCheckTimeout bounds the queries of warnSettings.
const settingsCheckTimeout = 5 * time.Second

// warnSettings logs one warning for each setting of db's database that the
// documentation says matters and that the database runs without, saying
// what to set and why:
//
//   - SQLite (a file; an in-memory database is not checked): the WAL
//     journal mode, and a busy timeout;
//   - PostgreSQL: autovacuum, on the server (autovacuum) and on the outbox
//     tables (their autovacuum_enabled storage parameter).
//
// It reads the settings with a query or two and never fails: a check whose
// query fails is logged at debug level and left out.
func warnSettings(ctx context.Context, db *gorm.DB, d dialect.Dialect, t dialect.Tables, log *slog.Logger) {
	ctx, cancel := context.WithTimeout(ctx, settingsCheckTimeout)
	defer cancel()
	pool := db.Statement.ConnPool
	skip := func(check string, err error) {
		log.DebugContext(ctx, "outbox: database setting not checked", "check", check, "error", err)
	}
	switch d.Name() {
	case "sqlite":
		var file string
		if err := pool.QueryRowContext(ctx, `SELECT file FROM pragma_database_list WHERE name = 'main'`).Scan(&file); err != nil {
			skip("sqlite database file", err)
			return
		}
		if file == "" {
			return // in memory, or temporary: no WAL, and no other process
		}
		var mode string
		if err := pool.QueryRowContext(ctx, `PRAGMA journal_mode`).Scan(&mode); err != nil {
			skip("sqlite journal_mode", err)
		} else if !strings.EqualFold(mode, "wal") {
			log.WarnContext(ctx, "outbox: SQLite runs without the WAL journal mode: the dispatcher's reads and the writers' transactions then block each other, and writes fail with \"database is locked\"; open the database with _journal_mode=WAL, as in file:app.db?_busy_timeout=5000&_journal_mode=WAL&_txlock=immediate (mattn/go-sqlite3) or file:app.db?_pragma=busy_timeout(5000)&_pragma=journal_mode(WAL)&_txlock=immediate (glebarez/sqlite, modernc.org/sqlite)",
				"journal_mode", mode, "file", file)
		}
		var timeout int
		if err := pool.QueryRowContext(ctx, `PRAGMA busy_timeout`).Scan(&timeout); err != nil {
			skip("sqlite busy_timeout", err)
		} else if timeout <= 0 {
			log.WarnContext(ctx, "outbox: SQLite runs without a busy timeout: a transaction that meets another's lock fails at once with \"database is locked\" instead of waiting for it; open the database with a busy timeout, as in file:app.db?_busy_timeout=5000&_journal_mode=WAL&_txlock=immediate (mattn/go-sqlite3) or file:app.db?_pragma=busy_timeout(5000)&_pragma=journal_mode(WAL)&_txlock=immediate (glebarez/sqlite, modernc.org/sqlite)",
				"busy_timeout", timeout, "file", file)
		}
	case "postgres":
		var on string
		if err := pool.QueryRowContext(ctx, `SHOW autovacuum`).Scan(&on); err != nil {
			skip("postgres autovacuum", err)
		} else if on != "on" {
			log.WarnContext(ctx, "outbox: PostgreSQL runs with autovacuum off: the claim's plans rely on the outbox table's statistics, which then go stale, and the dead row versions that every lease and settle leave behind pile up; turn it on (autovacuum = on in postgresql.conf, or ALTER SYSTEM SET autovacuum = on and SELECT pg_reload_conf())",
				"autovacuum", on)
		}
		rows, err := pool.QueryContext(ctx, d.Bind(`SELECT c.relname, o.opt FROM pg_class c CROSS JOIN LATERAL unnest(c.reloptions) AS o(opt)
WHERE c.oid IN (to_regclass(?), to_regclass(?)) AND o.opt LIKE 'autovacuum\_enabled=%'`), t.Records, t.Sequences)
		if err != nil {
			skip("postgres autovacuum_enabled", err)
			return
		}
		defer rows.Close()
		var off []string
		for rows.Next() {
			var table, opt string
			if err := rows.Scan(&table, &opt); err != nil {
				skip("postgres autovacuum_enabled", err)
				return
			}
			if isFalse(strings.TrimPrefix(opt, "autovacuum_enabled=")) {
				off = append(off, table)
			}
		}
		if err := rows.Err(); err != nil {
			skip("postgres autovacuum_enabled", err)
			return
		}
		if len(off) > 0 {
			log.WarnContext(ctx, "outbox: autovacuum is disabled on outbox tables (storage parameter autovacuum_enabled): the claim's plans rely on their statistics, which then go stale, and the dead row versions that every lease and settle leave behind pile up; ALTER TABLE ... RESET (autovacuum_enabled)",
				"tables", off)
		}
	}
}

// isFalse reports whether PostgreSQL reads the boolean storage parameter
// value v as false: off, no, false, 0, or a unique prefix of them.
func isFalse(v string) bool {
	v = strings.ToLower(strings.TrimSpace(v))
	switch {
	case v == "0" || v == "of" || v == "off":
		return true
	case v == "":
		return false
	}
	return strings.HasPrefix("false", v) || strings.HasPrefix("no", v)
}
