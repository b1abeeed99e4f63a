package outbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib"
	"gorm.io/driver/postgres"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

func TestPostgresClaimReadsOnlyDueRows(t *testing.T) {
	b := setup(t, outboxtest.Postgres, nil)
	var def string
	mustNil(t, b.db.Raw(`SELECT indexdef FROM pg_indexes WHERE indexname = 'outbox_records_due'`).Scan(&def).Error)
	if !strings.Contains(def, "(next_attempt_at, id)") || !strings.Contains(def, "WHERE") {
		t.Fatalf("due index %q, want partial on (next_attempt_at, id)", def)
	}
	mustNil(t, b.db.Exec(`INSERT INTO outbox_records (event_id, event_type, aggregate_type, aggregate_id, aggregate_sequence,
		idempotency_key, payload, delivery_state, next_attempt_at, occurred_at, created_at, updated_at)
		SELECT 'e'||g, 't', 'a', g::text, 1, 'k'||g, '{}', CASE WHEN g % 100 = 0 THEN 'pending' ELSE 'delivered' END,
			now(), now(), now(), now() FROM generate_series(1, 20000) g`).Error)
	mustNil(t, b.db.Exec(`ANALYZE outbox_records`).Error)
	plan := explain(t, b.db, `SELECT id FROM outbox_records WHERE delivery_state IN ('pending', 'retry', 'delivering')
		AND next_attempt_at <= now() ORDER BY next_attempt_at, id LIMIT 100 FOR UPDATE SKIP LOCKED`)
	// Whatever the plan, it reads due rows through the partial indexes and
	// never the delivered history.
	if !strings.Contains(plan, "outbox_records_due") || strings.Contains(plan, "Seq Scan") {
		t.Fatalf("the claim scan reads more than the due rows:\n%s", plan)
	}
}

// The dispatcher's own statements, the claim's lease and the settle, commit
// with synchronous_commit off, each in its own transaction only: the
// connection they ran on commits a business write synchronously again.
func TestPostgresBookkeepingCommitsAsynchronouslyAndOnlyItself(t *testing.T) {
	b := setup(t, outboxtest.Postgres, nil)
	sqlDB, err := b.db.DB()
	mustNil(t, err)
	sqlDB.SetMaxOpenConns(1) // every statement below runs on one connection
	// Whatever the server's default, the connection starts synchronous.
	mustNil(t, b.db.Exec(`SET synchronous_commit = on`).Error)
	mustNil(t, b.db.Exec(`CREATE TABLE commit_modes (state text, mode text)`).Error)
	mustNil(t, b.db.Exec(`CREATE FUNCTION log_commit_mode() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	INSERT INTO commit_modes VALUES (NEW.delivery_state, current_setting('synchronous_commit'));
	RETURN NEW;
END $$`).Error)
	mustNil(t, b.db.Exec(`CREATE TRIGGER log_commit_mode BEFORE UPDATE ON outbox_records
	FOR EACH ROW EXECUTE FUNCTION log_commit_mode()`).Error)
	publishN(t, b.db, "a", 2)

	if n := dispatch(t, newDispatcher(t, b.db, &recorder{})); n != 2 {
		t.Fatalf("delivered %d, want 2", n)
	}
	var modes []string
	mustNil(t, b.db.Raw(`SELECT state || ' ' || mode FROM commit_modes ORDER BY 1`).Scan(&modes).Error)
	if want := []string{"delivered off", "delivered off", "delivering off", "delivering off"}; !slices.Equal(modes, want) {
		t.Fatalf("commit modes of the dispatcher's updates: %q, want %q", modes, want)
	}
	var mode string
	mustNil(t, b.db.Raw(`SHOW synchronous_commit`).Scan(&mode).Error)
	if mode != "on" {
		t.Fatalf("synchronous_commit after dispatch = %q on the dispatcher's connection, want on", mode)
	}
}

// All the accepted rows of a batch are marked delivered by one statement,
// whatever their attempt counts: split, a failure between two statements
// could leave an event delivered behind an accepted one of its aggregate
// that is not, and claims check only the event just before.
func TestPostgresSettleMarksABatchDeliveredInOneStatement(t *testing.T) {
	b := setup(t, outboxtest.Postgres, nil)
	mustNil(t, b.db.Exec(`CREATE TABLE settles (delivered bigint)`).Error)
	mustNil(t, b.db.Exec(`CREATE FUNCTION log_settle() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	INSERT INTO settles SELECT count(*) FROM new_rows WHERE delivery_state = 'delivered' HAVING count(*) > 0;
	RETURN NULL;
END $$`).Error)
	mustNil(t, b.db.Exec(`CREATE TRIGGER log_settle AFTER UPDATE ON outbox_records
	REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION log_settle()`).Error)
	publishN(t, b.db, "a", 2)
	publishN(t, b.db, "b", 2)
	// b's events were attempted once before: the batch mixes attempt counts.
	mustNil(t, b.db.Exec(`UPDATE outbox_records SET delivery_attempts = 1 WHERE aggregate_id = 'b'`).Error)

	if n := dispatch(t, newDispatcher(t, b.db, &recorder{})); n != 4 {
		t.Fatalf("delivered %d, want 4", n)
	}
	var settles []int64
	mustNil(t, b.db.Raw(`SELECT delivered FROM settles`).Scan(&settles).Error)
	if !slices.Equal(settles, []int64{4}) {
		t.Fatalf("statements marking rows delivered, by rows: %v, want one of 4", settles)
	}
	var attempts []string
	for _, r := range b.records(t) {
		attempts = append(attempts, fmt.Sprintf("%s#%d:%d", r.AggregateID, r.AggregateSequence, r.DeliveryAttempts))
	}
	if got, want := strings.Join(attempts, " "), "a#1:1 a#2:1 b#1:2 b#2:2"; got != want {
		t.Fatalf("attempts %s, want %s", got, want)
	}
}

func explain(t *testing.T, db *gorm.DB, query string) string {
	t.Helper()
	rows, err := db.Raw("EXPLAIN " + query).Rows()
	mustNil(t, err)
	defer rows.Close()
	var lines []string
	for rows.Next() {
		var line string
		mustNil(t, rows.Scan(&line))
		lines = append(lines, line)
	}
	return strings.Join(lines, "\n")
}

// beginningPool wraps a *sql.DB as a tracing wrapper would: a connection
// pool that is not a *sql.DB but begins transactions.
type beginningPool struct{ *sql.DB }

// plainPool wraps a *sql.DB without a way to begin transactions.
type plainPool struct{ db *sql.DB }

func (p plainPool) PrepareContext(ctx context.Context, q string) (*sql.Stmt, error) {
	return p.db.PrepareContext(ctx, q)
}
func (p plainPool) ExecContext(ctx context.Context, q string, args ...any) (sql.Result, error) {
	return p.db.ExecContext(ctx, q, args...)
}
func (p plainPool) QueryContext(ctx context.Context, q string, args ...any) (*sql.Rows, error) {
	return p.db.QueryContext(ctx, q, args...)
}
func (p plainPool) QueryRowContext(ctx context.Context, q string, args ...any) *sql.Row {
	return p.db.QueryRowContext(ctx, q, args...)
}

// A dispatcher claims on every kind of pool GORM can be opened with on
// PostgreSQL, and refuses at construction one that cannot begin a
// transaction, rather than failing every claim.
func TestPostgresDispatcherClaimsOnEveryKindOfPool(t *testing.T) {
	for _, tc := range []struct {
		name string
		open func(t *testing.T, dsn string) *gorm.DB
	}{
		{"simple protocol", func(t *testing.T, dsn string) *gorm.DB {
			return openPostgres(t, postgres.Config{DSN: dsn, PreferSimpleProtocol: true}, nil)
		}},
		{"prepared statements", func(t *testing.T, dsn string) *gorm.DB {
			return openPostgres(t, postgres.Config{DSN: dsn}, &gorm.Config{PrepareStmt: true})
		}},
		{"one connection", func(t *testing.T, dsn string) *gorm.DB {
			db := openPostgres(t, postgres.Config{DSN: dsn}, nil)
			sqlDB, err := db.DB()
			mustNil(t, err)
			sqlDB.SetMaxOpenConns(1)
			return db
		}},
		{"a wrapped pool", func(t *testing.T, dsn string) *gorm.DB {
			return openPostgres(t, postgres.Config{Conn: beginningPool{openPool(t, dsn)}}, nil)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := setup(t, outboxtest.Postgres, nil)
			publishN(t, b.db, "a", 2)
			publishN(t, b.db, "b", 2)
			mustNil(t, b.db.Exec(`UPDATE outbox_records SET delivery_state = 'failed' WHERE aggregate_id = 'b' AND aggregate_sequence = 1`).Error)
			rec := &recorder{}
			d := newDispatcher(t, tc.open(t, b.info.DSN), rec)
			if n := dispatch(t, d); n != 2 || fmt.Sprint(rec.BatchIDs()) != "[[a#1 a#2]]" {
				t.Fatalf("delivered %d in %v, want a#1 a#2 and nothing of b", n, rec.BatchIDs())
			}
		})
	}
	t.Run("a pool that cannot begin transactions", func(t *testing.T) {
		b := setup(t, outboxtest.Postgres, nil)
		db := openPostgres(t, postgres.Config{Conn: plainPool{openPool(t, b.info.DSN)}}, nil)
		_, err := outbox.NewDispatcher(db, &recorder{})
		if !errors.Is(err, outbox.ErrInvalidOption) || !strings.Contains(err.Error(), "cannot begin transactions") {
			t.Fatalf("NewDispatcher = %v, want ErrInvalidOption saying the pool cannot begin transactions", err)
		}
	})
}

func openPostgres(t *testing.T, cfg postgres.Config, gcfg *gorm.Config) *gorm.DB {
	t.Helper()
	if gcfg == nil {
		gcfg = &gorm.Config{}
	}
	gcfg.Logger = logger.Discard
	db, err := gorm.Open(postgres.New(cfg), gcfg)
	mustNil(t, err)
	t.Cleanup(func() {
		if sqlDB, err := db.DB(); err == nil {
			sqlDB.Close()
		}
	})
	return db
}

func openPool(t *testing.T, dsn string) *sql.DB {
	t.Helper()
	db, err := sql.Open("pgx", dsn)
	mustNil(t, err)
	t.Cleanup(func() { db.Close() })
	return db
}

func blocksTouched(t *testing.T, db *gorm.DB) int64 {
	t.Helper()
	mustNil(t, db.Exec(`SELECT pg_stat_force_next_flush()`).Error)
	var n int64
	mustNil(t, db.Raw(`SELECT heap_blks_hit + heap_blks_read + coalesce(idx_blks_hit, 0) + coalesce(idx_blks_read, 0)
		FROM pg_statio_user_tables WHERE relid = 'outbox_records'::regclass`).Scan(&n).Error)
	return n
}

// So do the sweeps of a dispatcher that never claims, as a Scheduler that
// only sweeps runs them: it reads no ids, so their plans stay those made
// on the small table, which keep to the indexes.
func TestPostgresSweepsReadLittleOfATableThatGrew(t *testing.T) {
	b := setup(t, outboxtest.Postgres, nil)
	sqlDB, err := b.db.DB()
	mustNil(t, err)
	sqlDB.SetMaxOpenConns(1)
	d := newDispatcher(t, b.db, &recorder{}, outbox.WithRetention(time.Hour))
	publishN(t, b.db, "small", 3)
	for range 8 {
		_, err := d.Cleanup(context.Background())
		mustNil(t, err)
		_, err = d.RetryFailed(context.Background())
		mustNil(t, err)
	}
	// 40,000 rows delivered within the retention, and 20,000 of them due
	// in a day, not analysed.
	mustNil(t, b.db.Exec(`INSERT INTO outbox_records (event_id, event_type, aggregate_type, aggregate_id, aggregate_sequence,
		idempotency_key, payload, delivery_state, next_attempt_at, occurred_at, created_at, updated_at, delivered_at)
		SELECT 'e'||g, 't', 'big', g::text, 1, 'k'||g, '{"some":"payload"}', CASE WHEN g % 2 = 0 THEN 'pending' ELSE 'delivered' END,
			now() + interval '1 day', now(), now(), now(), CASE WHEN g % 2 = 0 THEN NULL ELSE now() END FROM generate_series(1, 40000) g`).Error)

	before := blocksTouched(t, b.db)
	_, err = d.Cleanup(context.Background())
	mustNil(t, err)
	_, err = d.RetryFailed(context.Background())
	mustNil(t, err)
	switch touched := blocksTouched(t, b.db) - before; {
	case touched <= 0:
		t.Fatalf("the statistics counted %d blocks touched: they measure nothing here", touched)
	case touched > 100:
		t.Fatalf("sweeping a table of 40,003 rows with nothing to sweep touched %d blocks of it and its indexes, want a few", touched)
	}
}
