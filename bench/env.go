package main

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"gorm.io/driver/postgres"
	"gorm.io/driver/sqlite"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"
)

// env is the databases a run works in: an admin connection to the
// PostgreSQL server, which creates and drops one schema per scenario, and a
// temporary directory for SQLite files.
type env struct {
	baseDSN string
	admin   *sql.DB
	tmp     string
	// checkpoint makes settle force a checkpoint after a bulk load; off in
	// smoke mode, where loads are tiny and a checkpoint of a busy shared
	// server costs more than everything else.
	checkpoint bool
}

func newEnv(ctx context.Context, dsn string) (*env, error) {
	admin, err := sql.Open("pgx", dsn)
	if err != nil {
		return nil, fmt.Errorf("open PostgreSQL: %w", err)
	}
	pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := admin.PingContext(pctx); err != nil {
		admin.Close()
		return nil, fmt.Errorf("PostgreSQL at %q does not answer (set OUTBOX_POSTGRES_DSN): %w", dsn, err)
	}
	admin.SetMaxOpenConns(2)
	tmp, err := os.MkdirTemp("", "outbox-bench-")
	if err != nil {
		admin.Close()
		return nil, err
	}
	return &env{baseDSN: dsn, admin: admin, tmp: tmp}, nil
}

func (e *env) close() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	e.dropLeftovers(ctx)
	e.admin.Close()
	os.RemoveAll(e.tmp)
}

// describe names the server and the machine, for the header of the output,
// and warns when the server does not run autovacuum.
func (e *env) describe(ctx context.Context) string {
	var version string
	if err := e.admin.QueryRowContext(ctx, `SHOW server_version`).Scan(&version); err != nil {
		version = "unknown"
	}
	host, _ := os.Hostname()
	s := fmt.Sprintf("PostgreSQL %s; host %s, %d CPUs", version, host, numCPU())
	var autovacuum string
	if err := e.admin.QueryRowContext(ctx, `SHOW autovacuum`).Scan(&autovacuum); err == nil && autovacuum != "on" {
		s += "\nautovacuum is off on this server, unlike a production one: the planner's statistics go stale" +
			" and the figures mislead (ALTER SYSTEM SET autovacuum = on; SELECT pg_reload_conf())"
	}
	return s
}

var schemaSeq atomic.Int64

// schema is one scenario's PostgreSQL schema; DSN opens connections whose
// search_path is that schema and whose application_name is its name. The
// connections that its openers hand out count what they send in work.
type schema struct {
	name string
	DSN  string
	e    *env
	work clientWork
}

// newSchema creates a fresh schema for one scenario.
func (e *env) newSchema(ctx context.Context, label string) (*schema, error) {
	name := fmt.Sprintf("outbox_bench_%s_%d_%d", label, os.Getpid(), schemaSeq.Add(1))
	if _, err := e.admin.ExecContext(ctx, `CREATE SCHEMA `+name); err != nil {
		return nil, fmt.Errorf("create schema %s: %w", name, err)
	}
	return &schema{name: name, DSN: e.baseDSN + " search_path=" + name + " application_name=" + name, e: e}, nil
}

// drop removes the schema and everything in it. It runs even when the
// run's context has ended, bounded by its own deadline.
func (s *schema) drop() {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := s.e.admin.ExecContext(ctx, `DROP SCHEMA IF EXISTS `+s.name+` CASCADE`); err != nil {
		fmt.Fprintf(os.Stderr, "bench: drop schema %s: %v\n", s.name, err)
	}
}

// sqlDB opens a database/sql pool (pgx driver) in the schema.
func (s *schema) sqlDB(maxConns int) (*sql.DB, error) { return s.openPool(s.DSN, maxConns) }

// sqlDBAsync is sqlDB with synchronous_commit off for every transaction
// of the pool.
func (s *schema) sqlDBAsync(maxConns int) (*sql.DB, error) {
	return s.openPool(s.DSN+" synchronous_commit=off", maxConns)
}

func (s *schema) openPool(dsn string, maxConns int) (*sql.DB, error) {
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		return nil, err
	}
	cfg.Tracer = s.work.tracer()
	db := stdlib.OpenDB(*cfg)
	db.SetMaxOpenConns(maxConns)
	db.SetMaxIdleConns(maxConns)
	return db, nil
}

// pgxPool opens a native pgx pool in the schema.
func (s *schema) pgxPool(ctx context.Context, maxConns int) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(s.DSN)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = int32(maxConns)
	cfg.ConnConfig.Tracer = s.work.tracer()
	return pgxpool.NewWithConfig(ctx, cfg)
}

// gormDB opens GORM on the schema with a pool of maxConns connections. It
// is opened from the DSN, as a user opens it, so that the library sees
// the DSN (and the pgx driver) it expects.
func (s *schema) gormDB(maxConns int) (*gorm.DB, error) {
	return openGorm(postgres.New(postgres.Config{DSN: s.DSN, OptionOpenDB: []stdlib.OptionOpenDB{
		stdlib.OptionBeforeConnect(func(_ context.Context, cfg *pgx.ConnConfig) error {
			cfg.Tracer = s.work.tracer()
			return nil
		}),
	}}), maxConns)
}

// sqliteFile returns the DSN of a fresh SQLite file: WAL, a busy timeout
// and BEGIN IMMEDIATE, as the library's README recommends.
func (e *env) sqliteFile(label string) string {
	path := filepath.Join(e.tmp, fmt.Sprintf("%s-%d.db", label, schemaSeq.Add(1)))
	return "file:" + path + "?_busy_timeout=10000&_journal_mode=WAL&_txlock=immediate"
}

// removeSQLite deletes a SQLite file made by sqliteFile, with its WAL.
func removeSQLite(dsn string) {
	path := strings.TrimPrefix(dsn, "file:")
	if i := strings.IndexByte(path, '?'); i >= 0 {
		path = path[:i]
	}
	for _, suffix := range []string{"", "-wal", "-shm"} {
		os.Remove(path + suffix)
	}
}

func sqliteGorm(dsn string, maxConns int) (*gorm.DB, error) {
	return openGorm(sqlite.Open(dsn), maxConns)
}

func openGorm(d gorm.Dialector, maxConns int) (*gorm.DB, error) {
	db, err := gorm.Open(d, &gorm.Config{Logger: logger.Discard})
	if err != nil {
		return nil, err
	}
	sqlDB, err := db.DB()
	if err != nil {
		return nil, err
	}
	sqlDB.SetMaxOpenConns(maxConns)
	sqlDB.SetMaxIdleConns(maxConns)
	return db, nil
}

func closeGorm(db *gorm.DB) {
	if db == nil {
		return
	}
	if sqlDB, err := db.DB(); err == nil {
		sqlDB.Close()
	}
}

// settle gets the server ready for a timed run after a bulk load: fresh
// statistics and visibility map, and no checkpoint pending from the load.
func (e *env) settle(ctx context.Context, db *sql.DB, tables ...string) error {
	for _, t := range tables {
		if _, err := db.ExecContext(ctx, `VACUUM ANALYZE `+t); err != nil {
			return fmt.Errorf("vacuum %s: %w", t, err)
		}
	}
	e.forceCheckpoint(ctx)
	return nil
}

// forceCheckpoint runs CHECKPOINT unless the env says not to. It needs
// privileges that a benchmark user may lack; without it the figures are
// only noisier.
func (e *env) forceCheckpoint(ctx context.Context) {
	if e.checkpoint {
		_, _ = e.admin.ExecContext(ctx, `CHECKPOINT`)
	}
}

// serverGone reports whether err says that the server went away (a
// restart, a shutdown, a dropped connection) rather than that the
// benchmark is wrong: on a server shared with other work, a measurement
// that hits a restart is worth running again.
func serverGone(err error) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		// 57P: shutdown, 08: connection, 53300: too many connections (a
		// spell of other work on a shared server).
		return strings.HasPrefix(pgErr.Code, "57P") || strings.HasPrefix(pgErr.Code, "08") || pgErr.Code == "53300"
	}
	var connErr *pgconn.ConnectError
	if errors.As(err, &connErr) || errors.Is(err, driver.ErrBadConn) || errors.Is(err, io.ErrUnexpectedEOF) {
		return true
	}
	msg := err.Error()
	for _, s := range []string{"conn closed", "connection reset", "connection refused", "broken pipe", "unexpected EOF"} {
		if strings.Contains(msg, s) {
			return true
		}
	}
	return false
}

const maxRestarts = 3

// retry runs one measurement, and runs it again, up to maxRestarts times,
// when it failed because the server went away, once the server answers
// again.
func retry[T any](ctx context.Context, e *env, what string, fn func() (T, error)) (T, error) {
	for attempt := 0; ; attempt++ {
		v, err := fn()
		if err == nil || attempt == maxRestarts || ctx.Err() != nil || !serverGone(err) {
			return v, err
		}
		fmt.Fprintf(os.Stderr, "bench: %s: the server went away (%v); waiting for it, then measuring again\n", what, err)
		if werr := e.waitForServer(ctx); werr != nil {
			return v, errors.Join(err, werr)
		}
	}
}

// waitForServer waits up to two minutes for the server to answer again.
func (e *env) waitForServer(ctx context.Context) error {
	deadline := time.Now().Add(2 * time.Minute)
	for {
		pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		err := e.admin.PingContext(pctx)
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("server did not come back: %w", err)
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
}

// dropLeftovers drops the schemas of this process that a failed drop left
// behind (the server went away while a measurement ended).
func (e *env) dropLeftovers(ctx context.Context) {
	rows, err := e.admin.QueryContext(ctx, `SELECT nspname FROM pg_namespace WHERE nspname LIKE $1`,
		fmt.Sprintf("outbox\\_bench\\_%%\\_%d\\_%%", os.Getpid()))
	if err != nil {
		return
	}
	var names []string
	for rows.Next() {
		var n string
		if rows.Scan(&n) == nil {
			names = append(names, n)
		}
	}
	rows.Close()
	for _, n := range names {
		(&schema{name: n, e: e}).drop()
	}
}
