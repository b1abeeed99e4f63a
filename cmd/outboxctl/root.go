package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"gorm.io/driver/mysql"
	"gorm.io/driver/postgres"
	"gorm.io/driver/sqlite"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
)

// errViolations is what check returns when it found violations.
var errViolations = errors.New("check found violations")

// globals are the flags every command shares.
type globals struct {
	db, table, output string
	stdout, stderr    io.Writer
}

func newRoot(stdout, stderr io.Writer) *cobra.Command {
	g := &globals{stdout: stdout, stderr: stderr}
	root := &cobra.Command{
		Use:   "outboxctl",
		Short: "Inspect and operate a gorm-outbox table",
		Long: `outboxctl inspects and operates the outbox table of a gorm-outbox service:
what is waiting, why it failed, sending it again, cleaning up, and checking
the outbox's promises on the live table.`,
		SilenceUsage:  true,
		SilenceErrors: true,
		PersistentPreRunE: func(cmd *cobra.Command, _ []string) error {
			if g.output != "table" && g.output != "json" {
				return fmt.Errorf("--output: %q is neither table nor json", g.output)
			}
			return nil
		},
	}
	root.SetOut(stdout)
	root.SetErr(stderr)
	pf := root.PersistentFlags()
	pf.StringVar(&g.db, "db", os.Getenv("OUTBOX_DB"), "database: sqlite:PATH, sqlite:file:..., postgres://..., 'host=... user=... dbname=...', mysql://user:pass@host:3306/db or mysql://user@tcp(host:3306)/db (default $OUTBOX_DB)")
	pf.StringVar(&g.table, "table", outbox.DefaultTable, "name of the outbox table")
	pf.StringVarP(&g.output, "output", "o", "table", "how rows are printed: table or json")
	root.AddCommand(statsCmd(g), listCmd(g), showCmd(g), requeueCmd(g), discardCmd(g), purgeCmd(g), migrateCmd(g), checkCmd(g), serveCmd(g))
	return root
}

// dialector maps a --db URL to a GORM dialector.
func dialector(url string) (gorm.Dialector, error) {
	switch {
	case url == "":
		return nil, errors.New("--db is required (or set OUTBOX_DB): sqlite:./app.db, postgres://user@host/db or mysql://user@host/db")
	case strings.HasPrefix(url, "sqlite:"):
		path := strings.TrimPrefix(strings.TrimPrefix(url, "sqlite:"), "//")
		if path == "" {
			return nil, errors.New("--db: sqlite: needs a file, as in sqlite:./app.db")
		}
		return sqlite.Open(path), nil
	case strings.HasPrefix(url, "postgres://"), strings.HasPrefix(url, "postgresql://"), keyValueDSN(url):
		return postgres.Open(url), nil
	case strings.HasPrefix(url, "mysql://"), strings.HasPrefix(url, "mariadb://"):
		dsn := url[strings.Index(url, "://")+3:]
		if dsn == "" {
			return nil, errors.New("--db: mysql:// needs a DSN, as in mysql://user:pass@127.0.0.1:3306/app")
		}
		dsn, err := mysqlDSN(dsn)
		if err != nil {
			return nil, err
		}
		// The outbox reads its DATETIME columns as times.
		if !strings.Contains(dsn, "parseTime=") {
			if strings.Contains(dsn, "?") {
				dsn += "&parseTime=true"
			} else {
				dsn += "?parseTime=true"
			}
		}
		return mysql.Open(dsn), nil
	case strings.Contains(url, "=") && !strings.Contains(url, "://"):
		// Meant as a key=value DSN: say what is wrong without repeating it,
		// password included.
		if _, err := parseConninfo(url); err != nil {
			return nil, fmt.Errorf("--db: not a key=value PostgreSQL DSN (host=... dbname=... password='...'): %w", err)
		}
	}
	return nil, fmt.Errorf("--db: %s is not a database URL outboxctl knows: use sqlite:PATH, postgres://..., host=... dbname=... or mysql://...", redacted(url))
}

// redacted names a --db value in an error without what may follow its
// scheme: a password, say.
func redacted(url string) string {
	if scheme, _, ok := strings.Cut(url, "://"); ok {
		return fmt.Sprintf("%q", scheme+"://...")
	}
	return "the value given"
}

// sqliteFile returns the file a sqlite: URL names, or "" for a file: URI
// or an in-memory database, which outboxctl does not look for itself.
func sqliteFile(url string) string {
	path, ok := strings.CutPrefix(url, "sqlite:")
	if !ok || strings.HasPrefix(path, "file:") || strings.Contains(path, ":memory:") {
		return ""
	}
	return strings.TrimPrefix(path, "//")
}

// open connects to the --db database with the outbox plugin on --table.
// Unless create is set, the database and the table must exist.
func (g *globals) open(ctx context.Context, create bool) (*gorm.DB, error) {
	dl, err := dialector(g.db)
	if err != nil {
		return nil, err
	}
	if f := sqliteFile(g.db); f != "" && !create {
		if _, err := os.Stat(f); err != nil {
			return nil, fmt.Errorf("cannot open the database: SQLite file %s does not exist (outboxctl migrate creates it)", f)
		}
	}
	db, err := gorm.Open(dl, &gorm.Config{Logger: logger.Discard})
	if err != nil {
		return nil, fmt.Errorf("cannot reach the database: %w", err)
	}
	sqlDB, err := db.DB()
	if err != nil {
		return nil, fmt.Errorf("cannot reach the database: %w", err)
	}
	pingCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := sqlDB.PingContext(pingCtx); err != nil {
		sqlDB.Close()
		return nil, fmt.Errorf("cannot reach the database: %w", err)
	}
	if err := db.Use(outbox.Plugin(outbox.WithTable(g.table), outbox.WithPluginLogger(g.logger()))); err != nil {
		sqlDB.Close()
		return nil, err
	}
	if !create && !db.Migrator().HasTable(g.table) {
		sqlDB.Close()
		return nil, fmt.Errorf("table %s does not exist in this database (outboxctl migrate creates it; --table names another)", g.table)
	}
	return db, nil
}

// logger is the log of the plugin and the dispatcher: errors only, on
// stderr. Their warnings concern the service (the database settings it
// should run with, parking that heals by itself), not a command.
func (g *globals) logger() *slog.Logger {
	return slog.New(slog.NewTextHandler(g.stderr, &slog.HandlerOptions{Level: slog.LevelError}))
}

// refusing is the publisher of outboxctl's dispatcher, which never runs.
type refusing struct{}

func (refusing) Publish(context.Context, outbox.Batch) error {
	return errors.New("outboxctl does not deliver messages")
}

// dispatcher opens the database and a dispatcher on it, and returns a
// function that closes the database.
func (g *globals) dispatcher(ctx context.Context, opts ...outbox.DispatcherOption) (*outbox.Dispatcher, func(), error) {
	db, err := g.open(ctx, false)
	if err != nil {
		return nil, nil, err
	}
	closeDB := func() {
		if sqlDB, err := db.DB(); err == nil {
			sqlDB.Close()
		}
	}
	opts = append([]outbox.DispatcherOption{outbox.WithLogger(g.logger())}, opts...)
	d, err := outbox.NewDispatcher(db, refusing{}, opts...)
	if err != nil {
		closeDB()
		return nil, nil, err
	}
	return d, closeDB, nil
}
