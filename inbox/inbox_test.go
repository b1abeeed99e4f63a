package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/inbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// Shipment is the consumer's own state in the tests: one row per applied
// delivery, never deduplicated by the schema, so that a second application
// shows as a second row.
type Shipment struct {
	ID        uint
	MessageID string `gorm:"size:255;index"`
	Sequence  int64
}

// newConsumer opens a fresh database on e with the consumer's table and a
// migrated inbox.
func newConsumer(t *testing.T, e engine, opts ...inbox.Option) (*gorm.DB, *inbox.Inbox, outboxtest.DB) {
	t.Helper()
	db, info := openDB(t, e)
	if err := db.AutoMigrate(&Shipment{}); err != nil {
		t.Fatalf("migrate shipments: %v", err)
	}
	in := newInbox(t, db, opts...)
	return db, in, info
}

func newInbox(t testing.TB, db *gorm.DB, opts ...inbox.Option) *inbox.Inbox {
	t.Helper()
	in, err := inbox.New(db, opts...)
	if err != nil {
		t.Fatalf("inbox.New: %v", err)
	}
	if err := in.Migrate(context.Background()); err != nil {
		t.Fatalf("Migrate: %v", err)
	}
	return in
}

// ship is the consumer's handler of message id.
func ship(id string) func(tx *gorm.DB) error {
	return func(tx *gorm.DB) error { return tx.Create(&Shipment{MessageID: id}).Error }
}

// shipments returns how many shipment rows each message id has.
func shipments(t testing.TB, db *gorm.DB) map[string]int {
	t.Helper()
	var rows []Shipment
	if err := db.Order("id").Find(&rows).Error; err != nil {
		t.Fatalf("read shipments: %v", err)
	}
	n := make(map[string]int)
	for _, r := range rows {
		n[r.MessageID]++
	}
	return n
}

// checkAppliedOnce checks that db's consumer applied each of ids exactly
// once, and no other message.
func checkAppliedOnce(t testing.TB, db *gorm.DB, ids ...string) {
	t.Helper()
	got := shipments(t, db)
	for _, id := range ids {
		if got[id] != 1 {
			t.Errorf("%s applied %d times, want 1", id, got[id])
		}
	}
	if len(got) != len(ids) {
		t.Errorf("%d message ids applied, want %d", len(got), len(ids))
	}
}

// inboxRow is one row of the inbox table.
type inboxRow struct {
	MessageID   string
	MessageType *string
	HandledAt   time.Time
}

func inboxRows(t testing.TB, db *gorm.DB, table string) map[string]inboxRow {
	t.Helper()
	var rows []inboxRow
	if err := db.Table(table).Find(&rows).Error; err != nil {
		t.Fatalf("read %s: %v", table, err)
	}
	m := make(map[string]inboxRow, len(rows))
	for _, r := range rows {
		m[r.MessageID] = r
	}
	return m
}

func TestReplayedDeliveriesChangeStateOnce(t *testing.T) {
	t.Parallel()
	forEachEngine(t, func(t *testing.T, e engine) {
		db, in, _ := newConsumer(t, e)
		ctx := context.Background()
		ids := make([]string, 20)
		for i := range ids {
			ids[i] = fmt.Sprintf("evt-%02d", i)
		}
		for pass, want := range []bool{true, false} {
			for _, id := range ids {
				handled, err := in.Handle(ctx, id, ship(id))
				if err != nil || handled != want {
					t.Fatalf("pass %d: Handle(%s) = %v, %v; want %v, nil", pass+1, id, handled, err, want)
				}
			}
		}
		checkAppliedOnce(t, db, ids...)
		if rows := inboxRows(t, db, inbox.DefaultTable); len(rows) != len(ids) {
			t.Errorf("inbox holds %d ids, want %d", len(rows), len(ids))
		}
	})
}

// deliverConcurrently runs Handle(id, fn) from n goroutines released at
// once and counts the outcomes.
func deliverConcurrently(t *testing.T, in *inbox.Inbox, n int, id string, fn func(tx *gorm.DB) error) (handled, duplicates int, errs []error) {
	t.Helper()
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		start = make(chan struct{})
	)
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			h, err := in.Handle(context.Background(), id, fn)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err != nil:
				errs = append(errs, err)
			case h:
				handled++
			default:
				duplicates++
			}
		}()
	}
	close(start)
	wg.Wait()
	return handled, duplicates, errs
}

func TestConcurrentDeliveriesOfOneIDApplyOnce(t *testing.T) {
	t.Parallel()
	forEachEngine(t, func(t *testing.T, e engine) {
		db, in, _ := newConsumer(t, e)
		var calls atomic.Int32
		handled, duplicates, errs := deliverConcurrently(t, in, 16, "evt-race", func(tx *gorm.DB) error {
			calls.Add(1)
			time.Sleep(20 * time.Millisecond) // the others arrive while this one holds the id
			return ship("evt-race")(tx)
		})
		if len(errs) > 0 {
			t.Fatalf("%d deliveries failed, first: %v", len(errs), errs[0])
		}
		if handled != 1 || duplicates != 15 {
			t.Errorf("handled %d, duplicates %d; want 1 and 15", handled, duplicates)
		}
		if n := calls.Load(); n != 1 {
			t.Errorf("fn ran %d times, want 1", n)
		}
		checkAppliedOnce(t, db, "evt-race")
	})
}

func TestConcurrentDeliveryAppliesItselfWhenTheFirstRollsBack(t *testing.T) {
	t.Parallel()
	forEachEngine(t, func(t *testing.T, e engine) {
		db, in, _ := newConsumer(t, e)
		errFirst := errors.New("first attempt fails")
		var calls atomic.Int32
		handled, duplicates, errs := deliverConcurrently(t, in, 16, "evt-retry", func(tx *gorm.DB) error {
			n := calls.Add(1)
			if err := ship("evt-retry")(tx); err != nil {
				return err
			}
			time.Sleep(20 * time.Millisecond)
			if n == 1 {
				return errFirst
			}
			return nil
		})
		if len(errs) != 1 || !errors.Is(errs[0], errFirst) {
			t.Fatalf("errors %v, want only the first attempt's", errs)
		}
		if handled != 1 || duplicates != 14 {
			t.Errorf("handled %d, duplicates %d; want 1 and 14", handled, duplicates)
		}
		if n := calls.Load(); n != 2 {
			t.Errorf("fn ran %d times, want 2 (the failed attempt and one more)", n)
		}
		checkAppliedOnce(t, db, "evt-retry")
	})
}

func TestFailingHandlerLeavesNoRowAndRetryApplies(t *testing.T) {
	t.Parallel()
	forEachEngine(t, func(t *testing.T, e engine) {
		db, in, _ := newConsumer(t, e)
		ctx := context.Background()
		errDown := errors.New("warehouse service down")
		handled, err := in.Handle(ctx, "evt-1", func(tx *gorm.DB) error {
			if err := ship("evt-1")(tx); err != nil {
				return err
			}
			return errDown
		})
		if handled || err != errDown {
			t.Fatalf("Handle = %v, %v; want false and fn's error unchanged", handled, err)
		}
		if rows := inboxRows(t, db, inbox.DefaultTable); len(rows) != 0 {
			t.Errorf("inbox holds %v after a failed handler, want nothing", rows)
		}
		if got := shipments(t, db); len(got) != 0 {
			t.Errorf("shipments %v after a failed handler, want none", got)
		}

		handled, err = in.Handle(ctx, "evt-1", ship("evt-1"))
		if !handled || err != nil {
			t.Fatalf("retry: Handle = %v, %v; want true, nil", handled, err)
		}
		checkAppliedOnce(t, db, "evt-1")
		if _, ok := inboxRows(t, db, inbox.DefaultTable)["evt-1"]; !ok {
			t.Error("inbox does not hold evt-1 after the retry")
		}
	})
}

func TestHandlerPanicLeavesNoRow(t *testing.T) {
	t.Parallel()
	db, in, _ := newConsumer(t, sqliteEngine)
	func() {
		defer func() {
			if recover() == nil {
				t.Error("Handle swallowed fn's panic")
			}
		}()
		_, _ = in.Handle(context.Background(), "evt-panic", func(tx *gorm.DB) error {
			_ = ship("evt-panic")(tx)
			panic("handler bug")
		})
	}()
	if rows := inboxRows(t, db, inbox.DefaultTable); len(rows) != 0 {
		t.Errorf("inbox holds %v after a panicking handler, want nothing", rows)
	}
	if got := shipments(t, db); len(got) != 0 {
		t.Errorf("shipments %v after a panicking handler, want none", got)
	}
}

func TestRowsKeepWhenHandledAndTheMessageType(t *testing.T) {
	t.Parallel()
	forEachEngine(t, func(t *testing.T, e engine) {
		db, in, _ := newConsumer(t, e)
		ctx := context.Background()
		before := time.Now().Add(-time.Second) // MySQL's DATETIME(6) and clocks round
		if _, err := in.HandleMessage(ctx, outbox.Message{EventID: "evt-typed", EventType: "order.paid"}, ship("evt-typed")); err != nil {
			t.Fatal(err)
		}
		if _, err := in.Handle(ctx, "evt-plain", ship("evt-plain")); err != nil {
			t.Fatal(err)
		}
		after := time.Now().Add(time.Second)
		rows := inboxRows(t, db, inbox.DefaultTable)
		typed, plain := rows["evt-typed"], rows["evt-plain"]
		if typed.MessageType == nil || *typed.MessageType != "order.paid" {
			t.Errorf("message_type of evt-typed = %v, want order.paid", typed.MessageType)
		}
		if plain.MessageType != nil {
			t.Errorf("message_type of evt-plain = %q, want NULL", *plain.MessageType)
		}
		for id, r := range rows {
			if r.HandledAt.Before(before) || r.HandledAt.After(after) {
				t.Errorf("handled_at of %s = %v, want between %v and %v", id, r.HandledAt, before, after)
			}
		}
	})
}

func TestHandleValidatesIDs(t *testing.T) {
	t.Parallel()
	longest := strings.Repeat("é", inbox.MaxIDLength) // 255 characters, 510 bytes
	tests := []struct {
		name    string
		id, typ string
		valid   bool
	}{
		{name: "empty id", id: ""},
		{name: "id one character too long", id: strings.Repeat("x", inbox.MaxIDLength+1)},
		{name: "id not UTF-8", id: "evt-\xff"},
		{name: "id with NUL", id: "evt\x00"},
		{name: "type too long", id: "evt-t", typ: strings.Repeat("t", inbox.MaxIDLength+1)},
		{name: "type with NUL", id: "evt-n", typ: "order\x00"},
		{name: "longest id and type", id: longest, typ: longest, valid: true},
		{name: "ids differing only in case", id: "EVT-CASE", valid: true},
	}
	forEachEngine(t, func(t *testing.T, e engine) {
		db, in, _ := newConsumer(t, e)
		ctx := context.Background()
		if _, err := in.Handle(ctx, "evt-case", ship("evt-case")); err != nil {
			t.Fatal(err)
		}
		for _, tt := range tests {
			called := false
			handled, err := in.HandleMessage(ctx, outbox.Message{EventID: tt.id, EventType: tt.typ}, func(tx *gorm.DB) error {
				called = true
				return ship(tt.id)(tx)
			})
			if tt.valid {
				if !handled || err != nil || !called {
					t.Errorf("%s: HandleMessage = %v, %v (fn called: %v); want true, nil", tt.name, handled, err, called)
				}
				continue
			}
			if !errors.Is(err, inbox.ErrInvalidMessage) || handled || called {
				t.Errorf("%s: HandleMessage = %v, %v (fn called: %v); want ErrInvalidMessage without calling fn", tt.name, handled, err, called)
			}
			if len(err.Error()) > 200 {
				t.Errorf("%s: error of %d bytes echoes the input: %.80s...", tt.name, len(err.Error()), err)
			}
		}
		if n := len(inboxRows(t, db, inbox.DefaultTable)); n != 3 {
			t.Errorf("inbox holds %d ids, want 3 (evt-case and the two valid ones)", n)
		}
	})
}

func TestHandleRejectsNilFn(t *testing.T) {
	t.Parallel()
	_, in, _ := newConsumer(t, sqliteEngine)
	if _, err := in.Handle(context.Background(), "evt-1", nil); err == nil {
		t.Error("Handle with a nil fn returned no error")
	}
}

func TestInboxesWithOtherTablesAreIndependent(t *testing.T) {
	t.Parallel()
	forEachEngine(t, func(t *testing.T, e engine) {
		db, billing, _ := newConsumer(t, e, inbox.WithTable("billing_inbox"))
		shipping := newInbox(t, db, inbox.WithTable("Shipping_Inbox"))
		ctx := context.Background()
		for _, in := range []*inbox.Inbox{billing, shipping, billing, shipping} {
			if _, err := in.Handle(ctx, "evt-1", ship(in.Table())); err != nil {
				t.Fatal(err)
			}
		}
		got := shipments(t, db)
		if got["billing_inbox"] != 1 || got["Shipping_Inbox"] != 1 {
			t.Errorf("applied %v, want each inbox's handler once", got)
		}
	})
}

// backdate sets the handled_at of ids to at.
func backdate(t testing.TB, db *gorm.DB, e engine, table string, at time.Time, ids []string) {
	t.Helper()
	var arg any = at.UTC()
	if e == sqliteEngine {
		// The inbox's text form on SQLite (fixed width, UTC), so that text
		// comparison is time comparison.
		arg = at.UTC().Format("2006-01-02 15:04:05.000000000+00:00")
	}
	if err := db.Table(table).Where("message_id IN ?", ids).Update("handled_at", arg).Error; err != nil {
		t.Fatalf("backdate: %v", err)
	}
}

func TestCleanupRemovesOnlyOldIDs(t *testing.T) {
	t.Parallel()
	forEachEngine(t, func(t *testing.T, e engine) {
		db, in, _ := newConsumer(t, e, inbox.WithCleanupBatch(3))
		ctx := context.Background()
		var old, recent []string
		for i := range 10 {
			old = append(old, fmt.Sprintf("old-%d", i))
		}
		for i := range 4 {
			recent = append(recent, fmt.Sprintf("new-%d", i))
		}
		for _, id := range append(append([]string(nil), old...), recent...) {
			if _, err := in.Handle(ctx, id, ship(id)); err != nil {
				t.Fatal(err)
			}
		}
		backdate(t, db, e, inbox.DefaultTable, time.Now().Add(-31*24*time.Hour), old)
		backdate(t, db, e, inbox.DefaultTable, time.Now().Add(-29*24*time.Hour), recent[:1])

		n, err := in.Cleanup(ctx, 30*24*time.Hour)
		if err != nil || n != len(old) {
			t.Fatalf("Cleanup = %d, %v; want %d, nil (in batches of 3)", n, err, len(old))
		}
		rows := inboxRows(t, db, inbox.DefaultTable)
		for _, id := range recent {
			if _, ok := rows[id]; !ok {
				t.Errorf("%s was removed, but is younger than the age", id)
			}
		}
		if len(rows) != len(recent) {
			t.Errorf("inbox holds %d ids, want %d", len(rows), len(recent))
		}
		if n, err := in.Cleanup(ctx, 30*24*time.Hour); err != nil || n != 0 {
			t.Errorf("second Cleanup = %d, %v; want 0, nil", n, err)
		}

		// A forgotten id is a new message again; a kept one is not.
		if handled, err := in.Handle(ctx, old[0], ship(old[0])); !handled || err != nil {
			t.Errorf("Handle of a forgotten id = %v, %v; want true, nil", handled, err)
		}
		if handled, err := in.Handle(ctx, recent[0], ship(recent[0])); handled || err != nil {
			t.Errorf("Handle of a kept id = %v, %v; want false, nil", handled, err)
		}
	})
}

func TestCleanupRejectsNonPositiveAge(t *testing.T) {
	t.Parallel()
	_, in, _ := newConsumer(t, sqliteEngine)
	for _, age := range []time.Duration{0, -time.Hour} {
		if _, err := in.Cleanup(context.Background(), age); err == nil {
			t.Errorf("Cleanup(%v) returned no error", age)
		}
	}
}

// schemaVersion reads the recorded schema version of table.
func schemaVersion(t testing.TB, db *gorm.DB, table string) int {
	t.Helper()
	var v int
	if err := db.Table(table + "_schema").Select("version").Where("id = 1").Scan(&v).Error; err != nil {
		t.Fatalf("read schema version: %v", err)
	}
	return v
}

func TestConcurrentMigrationsCreateOneSchema(t *testing.T) {
	t.Parallel()
	forEachEngine(t, func(t *testing.T, e engine) {
		db, info := openDB(t, e)
		var wg sync.WaitGroup
		errs := make([]error, 6)
		for i := range errs {
			// A pool each, as replicas starting at once have.
			in, err := inbox.New(reopen(t, info))
			if err != nil {
				t.Fatal(err)
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs[i] = in.Migrate(context.Background())
			}()
		}
		wg.Wait()
		for i, err := range errs {
			if err != nil {
				t.Errorf("Migrate %d: %v", i, err)
			}
		}
		if v := schemaVersion(t, db, inbox.DefaultTable); v != 1 {
			t.Errorf("schema version %d, want 1", v)
		}
		in := newInbox(t, db) // and once more, on a migrated schema
		if handled, err := in.Handle(context.Background(), "evt-1", func(*gorm.DB) error { return nil }); !handled || err != nil {
			t.Errorf("Handle after migrations = %v, %v", handled, err)
		}
	})
}

func TestMigrateRefusesANewerSchema(t *testing.T) {
	t.Parallel()
	forEachEngine(t, func(t *testing.T, e engine) {
		db, in, _ := newConsumer(t, e)
		if err := db.Table(inbox.DefaultTable+"_schema").Where("id = 1").Update("version", 2).Error; err != nil {
			t.Fatal(err)
		}
		if err := in.Migrate(context.Background()); !errors.Is(err, inbox.ErrSchemaTooNew) {
			t.Errorf("Migrate on a newer schema = %v, want ErrSchemaTooNew", err)
		}
		if v := schemaVersion(t, db, inbox.DefaultTable); v != 2 {
			t.Errorf("schema version changed to %d", v)
		}
	})
}

func TestNewValidatesOptions(t *testing.T) {
	t.Parallel()
	db, _ := openDB(t, sqliteEngine)
	tests := []struct {
		name string
		db   *gorm.DB
		opts []inbox.Option
		word string // the error names it
	}{
		{"nil db", nil, nil, "nil"},
		{"table not an identifier", db, []inbox.Option{inbox.WithTable("inbox-records")}, "WithTable"},
		{"table empty", db, []inbox.Option{inbox.WithTable("")}, "WithTable"},
		{"table too long", db, []inbox.Option{inbox.WithTable(strings.Repeat("t", 44))}, "WithTable"},
		{"table reserved by SQLite", db, []inbox.Option{inbox.WithTable("sqlite_inbox")}, "sqlite_"},
		{"cleanup batch zero", db, []inbox.Option{inbox.WithCleanupBatch(0)}, "WithCleanupBatch"},
		{"cleanup batch too large", db, []inbox.Option{inbox.WithCleanupBatch(100_001)}, "WithCleanupBatch"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in, err := inbox.New(tt.db, tt.opts...)
			if !errors.Is(err, outbox.ErrInvalidOption) || in != nil {
				t.Fatalf("New = %v, %v; want ErrInvalidOption", in, err)
			}
			if !strings.Contains(err.Error(), tt.word) {
				t.Errorf("error %q does not name %s", err, tt.word)
			}
		})
	}
	t.Run("db inside a transaction", func(t *testing.T) {
		err := db.Transaction(func(tx *gorm.DB) error {
			_, err := inbox.New(tx)
			return err
		})
		if !errors.Is(err, outbox.ErrInvalidOption) {
			t.Errorf("New(tx) = %v, want ErrInvalidOption", err)
		}
	})
}

func TestEventsPublishedInTheHandlerCommitWithIt(t *testing.T) {
	t.Parallel()
	forEachEngine(t, func(t *testing.T, e engine) {
		db, in, _ := newConsumer(t, e)
		if err := db.Use(outbox.Plugin()); err != nil {
			t.Fatal(err)
		}
		if err := outbox.AutoMigrate(db); err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		errLater := errors.New("fails after publishing")
		deliver := func(fail bool) (bool, error) {
			return in.Handle(ctx, "evt-1", func(tx *gorm.DB) error {
				if err := ship("evt-1")(tx); err != nil {
					return err
				}
				if err := outbox.Publish(tx, outbox.Event{Type: "shipment.created", AggregateType: "shipment", AggregateID: "1"}); err != nil {
					return err
				}
				if fail {
					return errLater
				}
				return nil
			})
		}
		var events int64
		count := func() int64 {
			if err := db.Table(outbox.DefaultTable).Count(&events).Error; err != nil {
				t.Fatal(err)
			}
			return events
		}
		if _, err := deliver(true); !errors.Is(err, errLater) {
			t.Fatalf("failing delivery: %v", err)
		}
		if n := count(); n != 0 {
			t.Errorf("%d events after a failed handler, want 0", n)
		}
		for range 2 {
			if _, err := deliver(false); err != nil {
				t.Fatal(err)
			}
		}
		if n := count(); n != 1 {
			t.Errorf("%d events after two deliveries, want 1", n)
		}
	})
}

func TestMigrateRerunsAStepThatWasNotRecorded(t *testing.T) {
	t.Parallel()
	forEachEngine(t, func(t *testing.T, e engine) {
		// On MySQL/MariaDB, DDL commits at once: a migration interrupted
		// after its step and before recording the version runs the step
		// again.
		db, in, _ := newConsumer(t, e)
		ctx := context.Background()
		if _, err := in.Handle(ctx, "evt-kept", ship("evt-kept")); err != nil {
			t.Fatal(err)
		}
		if err := db.Table(inbox.DefaultTable+"_schema").Where("id = 1").Update("version", 0).Error; err != nil {
			t.Fatal(err)
		}
		if err := in.Migrate(ctx); err != nil {
			t.Fatalf("Migrate over an unrecorded step: %v", err)
		}
		if v := schemaVersion(t, db, inbox.DefaultTable); v != 1 {
			t.Errorf("schema version %d, want 1", v)
		}
		if handled, err := in.Handle(ctx, "evt-kept", ship("evt-kept")); handled || err != nil {
			t.Errorf("Handle of a recorded id after re-migrating = %v, %v; want false, nil", handled, err)
		}
	})
}
