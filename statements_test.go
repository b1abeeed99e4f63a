package outbox_test

import (
	"context"
	"database/sql"
	"sync/atomic"
	"testing"

	"gorm.io/driver/postgres"
	"gorm.io/driver/sqlite"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// countingPool is a connection pool that counts the statements sent
// through it, BEGIN and COMMIT included.
type countingPool struct {
	db *sql.DB
	n  *atomic.Int64
}

func (c *countingPool) PrepareContext(ctx context.Context, q string) (*sql.Stmt, error) {
	return c.db.PrepareContext(ctx, q)
}

func (c *countingPool) ExecContext(ctx context.Context, q string, args ...any) (sql.Result, error) {
	c.n.Add(1)
	return c.db.ExecContext(ctx, q, args...)
}

func (c *countingPool) QueryContext(ctx context.Context, q string, args ...any) (*sql.Rows, error) {
	c.n.Add(1)
	return c.db.QueryContext(ctx, q, args...)
}

func (c *countingPool) QueryRowContext(ctx context.Context, q string, args ...any) *sql.Row {
	c.n.Add(1)
	return c.db.QueryRowContext(ctx, q, args...)
}

func (c *countingPool) BeginTx(ctx context.Context, opts *sql.TxOptions) (gorm.ConnPool, error) {
	c.n.Add(1)
	tx, err := c.db.BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	return &countingTx{tx: tx, n: c.n}, nil
}

func (c *countingPool) GetDBConn() (*sql.DB, error) { return c.db, nil }

type countingTx struct {
	tx *sql.Tx
	n  *atomic.Int64
}

func (c *countingTx) PrepareContext(ctx context.Context, q string) (*sql.Stmt, error) {
	return c.tx.PrepareContext(ctx, q)
}

func (c *countingTx) ExecContext(ctx context.Context, q string, args ...any) (sql.Result, error) {
	c.n.Add(1)
	return c.tx.ExecContext(ctx, q, args...)
}

func (c *countingTx) QueryContext(ctx context.Context, q string, args ...any) (*sql.Rows, error) {
	c.n.Add(1)
	return c.tx.QueryContext(ctx, q, args...)
}

func (c *countingTx) QueryRowContext(ctx context.Context, q string, args ...any) *sql.Row {
	c.n.Add(1)
	return c.tx.QueryRowContext(ctx, q, args...)
}

func (c *countingTx) Commit() error   { c.n.Add(1); return c.tx.Commit() }
func (c *countingTx) Rollback() error { c.n.Add(1); return c.tx.Rollback() }

// TestWriteStatementCounts states the work each write style asks of the
// database, statements per write with BEGIN and COMMIT, with the plugin
// and without: learning the rows from RETURNING costs no statement; an
// upsert on SQLite costs one read of its conflict keys; a write in the
// caller's transaction on SQLite costs a savepoint and its release.
func TestWriteStatementCounts(t *testing.T) {
	type counts struct{ gorm, plugin int64 }
	cases := []struct {
		name string
		run  func(db *gorm.DB) error
		want map[outboxtest.Engine]counts
	}{
		{"Create", func(db *gorm.DB) error { return db.Create(&Order{Status: "a"}).Error },
			map[outboxtest.Engine]counts{outboxtest.SQLite: {3, 5}, outboxtest.Postgres: {3, 4}}},
		{"Update", func(db *gorm.DB) error { return db.Model(&Order{ID: 101}).Update("status", "b").Error },
			map[outboxtest.Engine]counts{outboxtest.SQLite: {3, 5}, outboxtest.Postgres: {3, 4}}},
		{"UpdateWhereOfTwoRows", func(db *gorm.DB) error {
			return db.Model(&Order{}).Where("id IN ?", []int{101, 102}).Update("status", "b").Error
		}, map[outboxtest.Engine]counts{outboxtest.SQLite: {3, 7}, outboxtest.Postgres: {3, 5}}},
		{"Delete", func(db *gorm.DB) error { return db.Delete(&Order{ID: 102}).Error },
			map[outboxtest.Engine]counts{outboxtest.SQLite: {3, 5}, outboxtest.Postgres: {3, 4}}},
		{"SaveOfSliceUpsert", func(db *gorm.DB) error { return db.Save(&[]Order{{ID: 101, Status: "c"}}).Error },
			map[outboxtest.Engine]counts{outboxtest.SQLite: {3, 6}, outboxtest.Postgres: {3, 4}}},
		{"CreateInCallersTransaction", func(db *gorm.DB) error {
			return db.Transaction(func(tx *gorm.DB) error { return tx.Create(&Order{Status: "a"}).Error })
		}, map[outboxtest.Engine]counts{outboxtest.SQLite: {3, 7}, outboxtest.Postgres: {3, 4}}},
		{"CreateInOutboxTransaction", func(db *gorm.DB) error {
			return outbox.Transaction(db, func(tx *gorm.DB) error { return tx.Create(&Order{Status: "a"}).Error })
		}, map[outboxtest.Engine]counts{outboxtest.SQLite: {3, 7}, outboxtest.Postgres: {3, 4}}},
	}
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		if e == outboxtest.MySQL {
			t.Skip("MySQL: no statement counts recorded for this engine yet")
		}
		_, info := outboxtest.Open(t, e, nil)
		for _, withPlugin := range []bool{false, true} {
			raw := outboxtest.Reopen(t, info, nil)
			sqlDB, err := raw.DB()
			mustNil(t, err)
			n := &atomic.Int64{}
			pool := &countingPool{db: sqlDB, n: n}
			var dl gorm.Dialector = sqlite.New(sqlite.Config{Conn: pool})
			if e == outboxtest.Postgres {
				dl = postgres.New(postgres.Config{Conn: pool})
			}
			db, err := gorm.Open(dl, &gorm.Config{Logger: logger.Discard})
			mustNil(t, err)
			mustNil(t, db.Use(outbox.Plugin(outbox.WithNotify(false))))
			if withPlugin {
				mustNil(t, outbox.AutoMigrate(db))
			} else {
				db = outbox.WithoutEvents(db).Session(&gorm.Session{})
			}
			mustNil(t, db.AutoMigrate(&Order{}))
			mustNil(t, db.Exec(`DELETE FROM orders`).Error)
			mustNil(t, outbox.WithoutEvents(db).Create(&[]Order{{ID: 101}, {ID: 102}}).Error)
			for _, c := range cases {
				n.Store(0)
				mustNil(t, c.run(db))
				got, want := n.Load(), c.want[e].gorm
				if withPlugin {
					want = c.want[e].plugin
				}
				t.Logf("%s, plugin %v: %d statements", c.name, withPlugin, got)
				if got != want {
					t.Errorf("%s, plugin %v: %d statements, want %d", c.name, withPlugin, got, want)
				}
			}
		}
	})
}
