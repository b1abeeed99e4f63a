package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// runWithoutPolling starts Run with a poll interval of an hour, so that
// only a wake-up can make it dispatch, and returns a channel of what it
// publishes and a stop function.
func runWithoutPolling(t *testing.T, db *gorm.DB, opts ...outbox.DispatcherOption) (<-chan outbox.Message, func()) {
	t.Helper()
	got := make(chan outbox.Message, 100)
	p := outbox.PublisherFunc(func(_ context.Context, b outbox.Batch) error {
		for _, m := range b.Messages {
			got <- m
		}
		return nil
	})
	d := newDispatcher(t, db, p, append([]outbox.DispatcherOption{outbox.WithPollInterval(time.Hour)}, opts...)...)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	time.Sleep(200 * time.Millisecond) // let the first poll and the listener start
	return got, func() { cancel(); mustNil(t, <-done) }
}

func awaitMessage(t *testing.T, got <-chan outbox.Message, what string) outbox.Message {
	t.Helper()
	select {
	case m := <-got:
		return m
	case <-time.After(10 * time.Second):
		t.Fatalf("%s: nothing was dispatched, though the poll interval is an hour: no wake-up", what)
		return outbox.Message{}
	}
}

func TestCommitWakesRunWithoutPolling(t *testing.T) {
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil, ownTable())
		got, stop := runWithoutPolling(t, b.db)
		defer stop()
		mustNil(t, b.db.Create(&Order{Status: "statement transaction"}).Error)
		awaitMessage(t, got, "a create in GORM's own transaction")
		mustNil(t, b.db.Transaction(func(tx *gorm.DB) error {
			if err := tx.Create(&Order{Status: "explicit transaction"}).Error; err != nil {
				return err
			}
			time.Sleep(50 * time.Millisecond) // commit after the in-process follow-up look
			return nil
		}))
		awaitMessage(t, got, "a create in an explicit transaction")
		mustNil(t, outbox.Transaction(b.db, func(tx *gorm.DB) error { return tx.Create(&Order{Status: "outbox.Transaction"}).Error }))
		awaitMessage(t, got, "a create in outbox.Transaction")
		mustNil(t, outbox.Publish(b.db, outbox.Event{Type: "t", AggregateType: "a", AggregateID: "1"}))
		awaitMessage(t, got, "Publish")
	})
}

// notifySetup is setup on PostgreSQL with an outbox table, and so a
// notification channel, of the test's own: the channel belongs to the
// database, which tests running beside this one (in this package and
// others) share.
func notifySetup(t *testing.T, cfg *gorm.Config, opts ...outbox.Option) bundle {
	t.Helper()
	return setup(t, outboxtest.Postgres, cfg, append([]outbox.Option{ownTable()}, opts...)...)
}

// ownTable names an outbox table, and so a channel, that no other test
// uses.
func ownTable() outbox.Option {
	return outbox.WithTable(fmt.Sprintf("outbox_notify_%d_%d", os.Getpid(), notifyTables.Add(1)))
}

var notifyTables atomic.Int64

// withPlugin opens another pool on b's database with a plugin of its own
// on b's table, so that only notifications, not b's in-process wake-ups,
// reach a dispatcher on it.
func withPlugin(t *testing.T, b bundle) *gorm.DB {
	t.Helper()
	db := outboxtest.Reopen(t, b.info, nil)
	mustNil(t, db.Use(outbox.Plugin(outbox.WithTable(b.plugin.Table()))))
	return db
}

// eventWrites are the ways events reach the outbox, and whether the plugin
// sees each one's commit.
var eventWrites = []struct {
	name       string
	cfg        *gorm.Config
	write      func(db *gorm.DB, status string) error
	seesCommit bool
}{
	{"CreateInGORMsTransaction", nil, func(db *gorm.DB, status string) error {
		return db.Create(&Order{Status: status}).Error
	}, true},
	{"CreateWithSkipDefaultTransaction", &gorm.Config{SkipDefaultTransaction: true}, func(db *gorm.DB, status string) error {
		return db.Create(&Order{Status: status}).Error
	}, true},
	{"CreateWithPreparedStatements", &gorm.Config{PrepareStmt: true}, func(db *gorm.DB, status string) error {
		return db.Create(&Order{Status: status}).Error
	}, true},
	{"CreateInTheCallersTransaction", nil, func(db *gorm.DB, status string) error {
		return db.Transaction(func(tx *gorm.DB) error { return tx.Create(&Order{Status: status}).Error })
	}, false},
	{"CreateInTransaction", nil, func(db *gorm.DB, status string) error {
		return outbox.Transaction(db, func(tx *gorm.DB) error { return tx.Create(&Order{Status: status}).Error })
	}, true},
	{"UpdateInGORMsTransaction", nil, func(db *gorm.DB, status string) error {
		o := Order{Status: "before " + status}
		if err := outbox.WithoutEvents(db).Create(&o).Error; err != nil {
			return err
		}
		return db.Model(&o).Update("status", status).Error
	}, true},
	{"SaveInGORMsTransaction", nil, func(db *gorm.DB, status string) error {
		o := Order{Status: "before " + status}
		if err := outbox.WithoutEvents(db).Create(&o).Error; err != nil {
			return err
		}
		o.Status = status
		return db.Save(&o).Error
	}, true},
	{"DeleteInGORMsTransaction", nil, func(db *gorm.DB, status string) error {
		o := Order{Status: status}
		if err := outbox.WithoutEvents(db).Create(&o).Error; err != nil {
			return err
		}
		return db.Delete(&o).Error
	}, true},
	{"Publish", nil, func(db *gorm.DB, status string) error {
		return outbox.Publish(db, outbox.Event{Type: "t", AggregateType: "a", AggregateID: status})
	}, true},
	{"PublishInTheCallersTransaction", nil, func(db *gorm.DB, status string) error {
		return db.Transaction(func(tx *gorm.DB) error {
			return outbox.Publish(tx, outbox.Event{Type: "t", AggregateType: "a", AggregateID: status})
		})
	}, false},
	{"PublishInTransaction", nil, func(db *gorm.DB, status string) error {
		return outbox.Transaction(db, func(tx *gorm.DB) error {
			return outbox.Publish(tx, outbox.Event{Type: "t", AggregateType: "a", AggregateID: status})
		})
	}, true},
}

func TestCommitWakesRunOnAnotherPoolByNotification(t *testing.T) {
	for _, w := range eventWrites {
		t.Run(w.name, func(t *testing.T) {
			t.Parallel()
			b := notifySetup(t, w.cfg)
			got, stop := runWithoutPolling(t, withPlugin(t, b))
			defer stop()
			mustNil(t, w.write(b.db, "a"))
			awaitMessage(t, got, w.name)
		})
	}
}

// writerPIDs records, by order status, the backend that created each order
// in its transaction. It also makes db's pool keep no idle connection, so
// that a backend that sends a notification after a commit is never the one
// that wrote.
func writerPIDs(t *testing.T, db *gorm.DB) *sync.Map {
	t.Helper()
	sqlDB, err := db.DB()
	mustNil(t, err)
	sqlDB.SetMaxIdleConns(0)
	var pids sync.Map
	mustNil(t, db.Callback().Create().Before("gorm:after_create").Register("test:writer_pid", func(db *gorm.DB) {
		o, ok := db.Statement.Dest.(*Order)
		if !ok {
			return
		}
		var pid uint32
		mustNil(t, db.Statement.ConnPool.QueryRowContext(db.Statement.Context, "SELECT pg_backend_pid()").Scan(&pid))
		pids.Store(o.Status, pid)
	}))
	return &pids
}

func awaitNotification(t *testing.T, conn *pgx.Conn) *pgconn.Notification {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	n, err := conn.WaitForNotification(ctx)
	mustNil(t, err)
	return n
}

func TestALoneTransactionNotifiesAtItsOwnCommit(t *testing.T) {
	for _, w := range eventWrites {
		if !strings.HasPrefix(w.name, "Create") {
			continue // only a create callback reports the writing backend
		}
		t.Run(w.name, func(t *testing.T) {
			t.Parallel()
			b := notifySetup(t, w.cfg)
			pids := writerPIDs(t, b.db)
			conn := listenConn(t, b)
			mustNil(t, w.write(b.db, "alone"))
			n := awaitNotification(t, conn)
			if writer, _ := pids.Load("alone"); n.PID != writer {
				t.Fatalf("notification from backend %d, want it from the writer %d", n.PID, writer)
			}
		})
	}
}

// TestConcurrentTransactionsLeaveTheNotificationToTheNotifier: while
// another transaction of the plugin's is between its writes and its commit,
// a transaction whose commit the plugin sees does not notify itself (so
// that the two would not commit one after the other); the notifier does,
// from another backend, once the events are visible.
func TestConcurrentTransactionsLeaveTheNotificationToTheNotifier(t *testing.T) {
	for _, w := range eventWrites {
		if !w.seesCommit || !strings.HasPrefix(w.name, "Create") {
			continue
		}
		t.Run(w.name, func(t *testing.T) {
			t.Parallel()
			b := notifySetup(t, w.cfg)
			pids := writerPIDs(t, b.db)
			conn := listenConn(t, b)
			// Hold a write of order 500000 inside its event write: an
			// uncommitted sequence row of its aggregate makes its upsert wait.
			ctx := context.Background()
			lock, err := pgx.Connect(ctx, b.info.DSN)
			mustNil(t, err)
			defer lock.Close(ctx)
			lockTx, err := lock.Begin(ctx)
			mustNil(t, err)
			sequences := b.plugin.Table() + "_sequences"
			_, err = lockTx.Exec(ctx, `INSERT INTO "`+sequences+`" (aggregate_type, aggregate_id, last_sequence) VALUES ('order', '500000', 0)`)
			mustNil(t, err)
			held := make(chan error, 1)
			go func() { held <- b.db.Create(&Order{ID: 500_000, Status: "held"}).Error }()
			defer func() {
				_ = lockTx.Rollback(ctx)
				if err := <-held; err != nil {
					t.Errorf("the held transaction: %v", err)
				}
			}()
			outboxtest.WaitUntil(t, func() bool {
				var waiting int64
				mustNil(t, b.db.Raw(`SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'
					AND datname = current_database() AND query LIKE '%' || ? || '%'`, sequences).Scan(&waiting).Error)
				return waiting > 0
			}, "the held transaction to wait in its event write")
			mustNil(t, w.write(b.db, "concurrent"))
			n := awaitNotification(t, conn)
			if got := len(b.records(t)); got != 1 {
				t.Fatalf("%d events visible when the notification came, want the concurrent one", got)
			}
			if writer, _ := pids.Load("concurrent"); n.PID == writer {
				t.Fatalf("notification from the writer %d, want it from another backend", writer)
			}
		})
	}
}

func TestWritesThroughOneDBEachNotify(t *testing.T) {
	b := notifySetup(t, nil)
	conn := listenConn(t, b)
	q := b.db.Model(&Order{})
	mustNil(t, q.Create(&Order{Status: "a"}).Error)
	awaitNotification(t, conn)
	mustNil(t, q.Create(&Order{Status: "b"}).Error)
	awaitNotification(t, conn)
}

func TestATransactionWhoseFirstEventIsStoredAlreadyStillNotifies(t *testing.T) {
	b := notifySetup(t, nil)
	stored := outbox.Event{Type: "t", AggregateType: "a", AggregateID: "1", IdempotencyKey: "stored"}
	mustNil(t, outbox.Publish(b.db, stored))
	conn := listenConn(t, b)
	mustNil(t, b.db.Transaction(func(tx *gorm.DB) error {
		return outbox.Publish(tx, stored, outbox.Event{Type: "t", AggregateType: "a", AggregateID: "1", IdempotencyKey: "new"})
	}))
	awaitNotification(t, conn)
	if n := len(b.records(t)); n != 2 {
		t.Fatalf("%d events, want the stored one and the new one", n)
	}
}

func TestListenerReconnectsAfterItsConnectionIsKilled(t *testing.T) {
	b := notifySetup(t, nil)
	got, stop := runWithoutPolling(t, b.db)
	defer stop()
	var killed int64
	mustNil(t, b.db.Raw(`SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE query LIKE 'LISTEN %' AND pid <> pg_backend_pid()
		AND datname = current_database() AND backend_type = 'client backend' AND query LIKE '%' || ? || '%'`, b.plugin.Table()).Scan(&killed).Error)
	if killed == 0 {
		t.Fatal("found no listening connection to kill")
	}
	mustNil(t, b.db.Create(&Order{Status: "after the kill"}).Error)
	awaitMessage(t, got, "a commit after the listener's connection was killed")
}

func TestNotificationIsSentOncePerCommitAndNeverForRollback(t *testing.T) {
	b := notifySetup(t, nil)
	conn := listenConn(t, b)
	count := func() int { return countNotifications(conn) }
	_ = b.db.Transaction(func(tx *gorm.DB) error {
		mustNil(t, tx.Create(&Order{Status: "rolled back"}).Error)
		return errRollback
	})
	if n := count(); n != 0 {
		t.Fatalf("%d notifications for a rolled-back transaction, want 0", n)
	}
	mustNil(t, b.db.Create(&Order{ID: 1_000_000, Status: "first"}).Error)
	if n := count(); n != 1 {
		t.Fatalf("%d notifications for a create in GORM's transaction, want 1", n)
	}
	mustErr(t, b.db.Create(&Order{ID: 1_000_000, Status: "duplicate key"}).Error)
	if n := count(); n != 0 {
		t.Fatalf("%d notifications for a create whose own transaction rolled back, want 0", n)
	}
	mustNil(t, b.db.Transaction(func(tx *gorm.DB) error {
		for range 10 {
			if err := tx.Create(&Order{Status: "one of ten"}).Error; err != nil {
				return err
			}
		}
		return nil
	}))
	if n := count(); n != 1 {
		t.Fatalf("%d notifications for one transaction of ten events, want 1", n)
	}
}

// TestTransactionNotifications: the events a Transaction's writes store,
// and the notifications that reach a listener, where writes roll back,
// nest or run on another connection.
func TestTransactionNotifications(t *testing.T) {
	for _, tc := range []struct {
		name           string
		write          func(t *testing.T, db *gorm.DB)
		stored, notify int
	}{
		{"OncePerCommitAndNeverForRollback", func(t *testing.T, db *gorm.DB) {
			mustErr(t, outbox.Transaction(db, func(tx *gorm.DB) error {
				mustNil(t, tx.Create(&Order{Status: "rolled back"}).Error)
				return errRollback
			}))
			mustNil(t, outbox.Transaction(db, func(tx *gorm.DB) error {
				for range 10 {
					if err := tx.Create(&Order{Status: "one of ten"}).Error; err != nil {
						return err
					}
				}
				return outbox.Publish(tx, outbox.Event{Type: "t", AggregateType: "a", AggregateID: "1"})
			}))
		}, 11, 1},
		// A notification asked for in a savepoint goes if the savepoint
		// rolls back: a later write asks for its own.
		{"AfterASavepointWithItsNotificationRolledBack", func(t *testing.T, db *gorm.DB) {
			mustNil(t, outbox.Transaction(db, func(tx *gorm.DB) error {
				mustErr(t, tx.Transaction(func(tx *gorm.DB) error {
					mustNil(t, tx.Create(&Order{Status: "rolled back to the savepoint"}).Error)
					return errRollback
				}))
				return tx.Create(&Order{Status: "committed"}).Error
			}))
		}, 1, 1},
		// A transaction begun on another connection inside a Transaction
		// is not that Transaction's: it notifies at its own commit,
		// whatever becomes of the Transaction.
		{"OnAnotherConnectionInside", func(t *testing.T, db *gorm.DB) {
			mustErr(t, outbox.Transaction(db, func(tx *gorm.DB) error {
				mustNil(t, tx.Create(&Order{Status: "rolled back"}).Error)
				mustNil(t, tx.Connection(func(c *gorm.DB) error {
					return c.Transaction(func(c *gorm.DB) error { return c.Create(&Order{Status: "committed on its own"}).Error })
				}))
				return errRollback
			}))
		}, 1, 1},
		// Inside the caller's transaction, Transaction is a savepoint, and
		// its events commit, and notify, with the caller's transaction.
		{"InsideTheCallersTransaction", func(t *testing.T, db *gorm.DB) {
			mustErr(t, db.Transaction(func(tx *gorm.DB) error {
				mustNil(t, outbox.Transaction(tx, func(tx *gorm.DB) error { return tx.Create(&Order{Status: "nested"}).Error }))
				return errRollback
			}))
		}, 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := notifySetup(t, nil)
			conn := listenConn(t, b)
			tc.write(t, b.db)
			if n := len(b.records(t)); n != tc.stored {
				t.Fatalf("%d events stored, want %d", n, tc.stored)
			}
			if n := countNotifications(conn); n != tc.notify {
				t.Fatalf("%d notifications, want %d", n, tc.notify)
			}
		})
	}
}

// A Transaction is counted in flight only until it ends, committed or
// not: a lone transaction after one that rolled back notifies at its own
// commit again.
func TestTransactionThatRolledBackLeavesTheNextOneAlone(t *testing.T) {
	b := notifySetup(t, nil)
	pids := writerPIDs(t, b.db)
	conn := listenConn(t, b)
	mustErr(t, outbox.Transaction(b.db, func(tx *gorm.DB) error {
		mustNil(t, tx.Create(&Order{Status: "rolled back"}).Error)
		return errRollback
	}))
	mustNil(t, b.db.Create(&Order{Status: "alone"}).Error)
	n := awaitNotification(t, conn)
	if writer, _ := pids.Load("alone"); n.PID != writer {
		t.Fatalf("notification from backend %d, want it from the writer %d", n.PID, writer)
	}
}

func TestTransactionWithoutThePluginRunsNothing(t *testing.T) {
	b := setup(t, outboxtest.SQLite, nil)
	ran := false
	err := outbox.Transaction(outboxtest.Reopen(t, b.info, nil), func(*gorm.DB) error { ran = true; return nil })
	if !errors.Is(err, outbox.ErrPluginNotRegistered) || ran {
		t.Fatalf("Transaction without the plugin: %v, ran: %v; want ErrPluginNotRegistered, not run", err, ran)
	}
}

// countNotifications counts the notifications that reach conn until none
// comes for 300 ms.
func countNotifications(conn *pgx.Conn) int {
	n := 0
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		_, err := conn.WaitForNotification(ctx)
		cancel()
		if err != nil {
			return n
		}
		n++
	}
}

func TestWithNotifyFalseSendsNoNotification(t *testing.T) {
	b := notifySetup(t, nil, outbox.WithNotify(false))
	ctx := context.Background()
	conn := listenConn(t, b)
	mustNil(t, b.db.Create(&Order{Status: "quiet"}).Error)
	wctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	if _, err := conn.WaitForNotification(wctx); err == nil {
		t.Fatal("a notification was sent with WithNotify(false)")
	}
}

// listenConn returns a connection of its own that listens on the channel
// of b's outbox table.
func listenConn(t *testing.T, b bundle) *pgx.Conn {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, b.info.DSN)
	mustNil(t, err)
	t.Cleanup(func() { conn.Close(ctx) })
	_, err = conn.Exec(ctx, `LISTEN "`+b.plugin.Table()+`"`)
	mustNil(t, err)
	return conn
}

func TestRunOnASingleConnectionPoolPollsInsteadOfListening(t *testing.T) {
	b := setup(t, outboxtest.Postgres, nil)
	dispatcherDB := outboxtest.Reopen(t, b.info, nil)
	sqlDB, err := dispatcherDB.DB()
	mustNil(t, err)
	sqlDB.SetMaxOpenConns(1)
	got := make(chan outbox.Message, 1)
	d := newDispatcher(t, dispatcherDB, outbox.PublisherFunc(func(_ context.Context, batch outbox.Batch) error {
		got <- batch.Messages[0]
		return nil
	}), outbox.WithPollInterval(20*time.Millisecond))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	defer func() {
		cancel()
		select {
		case err := <-done:
			mustNil(t, err)
		case <-time.After(10 * time.Second):
			t.Error("Run did not stop: a claim waits for the pool's only connection")
		}
	}()
	mustNil(t, outbox.Publish(b.db, outbox.Event{Type: "t", AggregateType: "a", AggregateID: "1"}))
	select {
	case <-got:
	case <-time.After(10 * time.Second):
		t.Fatal("nothing dispatched: a listener holds the pool's only connection")
	}
}
