package puresqlite_test

import (
	"context"
	"encoding/json"
	"errors"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/glebarez/sqlite"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
)

// Order is a model that records one event per write.
type Order struct {
	ID    uint
	Total int
}

func (o *Order) OutboxEvents(op outbox.Op) ([]outbox.Event, error) {
	return []outbox.Event{{
		Type:          "order." + string(op),
		AggregateType: "order",
		AggregateID:   strconv.Itoa(int(o.ID)),
		Payload:       o,
	}}, nil
}

// open returns a fresh SQLite file through the pure-Go driver, with the
// plugin registered and the outbox and Order tables migrated.
func open(t *testing.T) *gorm.DB {
	t.Helper()
	dsn := "file:" + filepath.Join(t.TempDir(), "app.db") +
		"?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)&_txlock=immediate"
	db, err := gorm.Open(sqlite.Open(dsn), &gorm.Config{Logger: logger.Discard})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if sqlDB, err := db.DB(); err == nil {
			sqlDB.Close()
		}
	})
	must(t, db.Use(outbox.Plugin()))
	must(t, outbox.AutoMigrate(db))
	must(t, db.AutoMigrate(&Order{}))
	return db
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// delivered is what a dispatcher on db delivers, one DispatchOnce.
type delivered struct {
	types    []string
	payloads []string
}

func dispatch(t *testing.T, db *gorm.DB) delivered {
	t.Helper()
	var got delivered
	d, err := outbox.NewDispatcher(db, outbox.PublisherFunc(func(_ context.Context, b outbox.Batch) error {
		for _, m := range b.Messages {
			got.types = append(got.types, m.EventType)
			got.payloads = append(got.payloads, string(m.Payload))
		}
		return nil
	}))
	must(t, err)
	n, err := d.DispatchOnce(context.Background())
	must(t, err)
	if n != len(got.types) {
		t.Errorf("DispatchOnce = %d, but %d messages were published", n, len(got.types))
	}
	return got
}

func count(t *testing.T, db *gorm.DB, table string) int64 {
	t.Helper()
	var n int64
	must(t, db.Table(table).Count(&n).Error)
	return n
}

func TestWriteIsDeliveredOnce(t *testing.T) {
	db := open(t)
	must(t, db.Create(&Order{Total: 120}).Error)
	must(t, db.Model(&Order{ID: 1}).Update("total", 150).Error)

	got := dispatch(t, db)
	if want := []string{"order.create", "order.update"}; strings.Join(got.types, ",") != strings.Join(want, ",") {
		t.Errorf("delivered %v, want %v", got.types, want)
	}
	if len(got.payloads) == 2 && got.payloads[1] != `{"ID":1,"Total":150}` {
		t.Errorf("update payload %s, want the stored row", got.payloads[1])
	}
	if again := dispatch(t, db); len(again.types) != 0 {
		t.Errorf("a second dispatch delivered %v again", again.types)
	}
}

func TestRolledBackWriteLeavesNoEvent(t *testing.T) {
	db := open(t)
	refused := errors.New("refused")
	err := db.Transaction(func(tx *gorm.DB) error {
		if err := tx.Create(&Order{Total: 5}).Error; err != nil {
			return err
		}
		return refused
	})
	if !errors.Is(err, refused) {
		t.Fatalf("Transaction = %v, want %v", err, refused)
	}
	if n := count(t, db, "orders"); n != 0 {
		t.Errorf("%d orders after the rollback, want none", n)
	}
	if n := count(t, db, outbox.DefaultTable); n != 0 {
		t.Errorf("%d events after the rollback, want none", n)
	}
}

func TestPublishedTwiceUnderOneIdempotencyKeyIsStoredAndDeliveredOnce(t *testing.T) {
	db := open(t)
	ev := outbox.Event{Type: "order.reminded", AggregateType: "order", AggregateID: "7", IdempotencyKey: "reminder-7"}
	for range 2 {
		must(t, db.Transaction(func(tx *gorm.DB) error { return outbox.Publish(tx, ev) }))
	}
	if n := count(t, db, outbox.DefaultTable); n != 1 {
		t.Errorf("%d events stored, want 1", n)
	}
	if got := dispatch(t, db); len(got.types) != 1 {
		t.Errorf("delivered %v, want one order.reminded", got.types)
	}
}

// A payload that encoding/json accepts and SQLite's JSON does not (nested
// deeper than SQLite's limit, 1000 or 2000 by version) fails the write as an invalid event: the pure-Go
// driver's CHECK failure is recognised as the engine refusing a value.
func TestPayloadSQLiteRefusesIsAnInvalidEventAndRollsBackTheWrite(t *testing.T) {
	db := open(t)
	deep := json.RawMessage(strings.Repeat("[", 5000) + strings.Repeat("]", 5000))
	err := db.Transaction(func(tx *gorm.DB) error {
		if err := tx.Create(&Order{Total: 1}).Error; err != nil {
			return err
		}
		return outbox.Publish(tx, outbox.Event{Type: "order.noted", AggregateType: "order", AggregateID: "1", Payload: deep})
	})
	if !errors.Is(err, outbox.ErrInvalidEvent) {
		t.Fatalf("Transaction = %v, want an error wrapping ErrInvalidEvent", err)
	}
	if n := count(t, db, "orders"); n != 0 {
		t.Errorf("%d orders written, want none", n)
	}
	if n := count(t, db, outbox.DefaultTable); n != 0 {
		t.Errorf("%d events written, want none", n)
	}
}
