package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
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
	forEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		b := setup(t, e, nil)
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
		mustNil(t, outbox.Publish(b.db, outbox.Event{Type: "t", AggregateType: "a", AggregateID: "1"}))
		awaitMessage(t, got, "Publish")
	})
}

func TestListenerReconnectsAfterItsConnectionIsKilled(t *testing.T) {
	b := setup(t, outboxtest.Postgres, nil)
	got, stop := runWithoutPolling(t, b.db)
	defer stop()
	var killed int64
	mustNil(t, b.db.Raw(`SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE query LIKE 'LISTEN %' AND pid <> pg_backend_pid()
		AND datname = current_database() AND backend_type = 'client backend' AND query LIKE '%outbox_records%'`).Scan(&killed).Error)
	if killed == 0 {
		t.Fatal("found no listening connection to kill")
	}
	mustNil(t, b.db.Create(&Order{Status: "after the kill"}).Error)
	awaitMessage(t, got, "a commit after the listener's connection was killed")
}

func TestNotificationIsSentOncePerCommitAndNeverForRollback(t *testing.T) {
	b := setup(t, outboxtest.Postgres, nil)
	ctx := context.Background()
	conn := listenConn(t, b.info.DSN)
	count := func() int {
		n := 0
		for {
			wctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
			_, err := conn.WaitForNotification(wctx)
			cancel()
			if err != nil {
				return n
			}
			n++
		}
	}
	_ = b.db.Transaction(func(tx *gorm.DB) error {
		mustNil(t, tx.Create(&Order{Status: "rolled back"}).Error)
		return errRollback
	})
	if n := count(); n != 0 {
		t.Fatalf("%d notifications for a rolled-back transaction, want 0", n)
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

func TestWithNotifyFalseSendsNoNotification(t *testing.T) {
	b := setup(t, outboxtest.Postgres, nil, outbox.WithNotify(false))
	ctx := context.Background()
	conn := listenConn(t, b.info.DSN)
	mustNil(t, b.db.Create(&Order{Status: "quiet"}).Error)
	wctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	if _, err := conn.WaitForNotification(wctx); err == nil {
		t.Fatal("a notification was sent with WithNotify(false)")
	}
}

// listenConn returns a connection of its own that listens on the outbox
// table's channel.
func listenConn(t *testing.T, dsn string) *pgx.Conn {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, dsn)
	mustNil(t, err)
	t.Cleanup(func() { conn.Close(ctx) })
	_, err = conn.Exec(ctx, `LISTEN "outbox_records"`)
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
