package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"gorm.io/driver/sqlite"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
)

// Invoice is a model that emits one event per write.
type Invoice struct {
	ID     uint
	Amount int
}

// OutboxEvents describes the fact of a write: a pure function of the model.
func (i *Invoice) OutboxEvents(op outbox.Op) ([]outbox.Event, error) {
	return []outbox.Event{{
		Type:          "invoice." + string(op),
		AggregateType: "invoice",
		AggregateID:   strconv.Itoa(int(i.ID)),
		Payload:       i,
	}}, nil
}

// exampleSQLite opens a fresh SQLite file for an example.
func exampleSQLite() (*gorm.DB, func()) {
	dir, err := os.MkdirTemp("", "outbox-example")
	if err != nil {
		log.Fatal(err)
	}
	dsn := "file:" + filepath.Join(dir, "app.db") + "?_busy_timeout=5000&_journal_mode=WAL&_txlock=immediate"
	db, err := gorm.Open(sqlite.Open(dsn), &gorm.Config{Logger: logger.Discard})
	if err != nil {
		log.Fatal(err)
	}
	return db, func() {
		if sqlDB, err := db.DB(); err == nil {
			sqlDB.Close()
		}
		os.RemoveAll(dir)
	}
}

// openExampleDB is exampleSQLite with the outbox plugin registered and the
// outbox tables and models migrated, as ExamplePlugin shows.
func openExampleDB(models ...any) (*gorm.DB, func()) {
	db, done := exampleSQLite()
	if err := db.Use(outbox.Plugin()); err != nil {
		log.Fatal(err)
	}
	if err := outbox.AutoMigrate(db); err != nil {
		log.Fatal(err)
	}
	if err := db.AutoMigrate(models...); err != nil {
		log.Fatal(err)
	}
	return db, done
}

func ExamplePlugin() {
	db, done := exampleSQLite()
	defer done()

	if err := db.Use(outbox.Plugin()); err != nil {
		log.Fatal(err)
	}
	if err := outbox.AutoMigrate(db); err != nil {
		log.Fatal(err)
	}
	if err := db.AutoMigrate(&Invoice{}); err != nil {
		log.Fatal(err)
	}

	// The invoice row and its outbox row commit together.
	inv := Invoice{Amount: 120}
	if err := db.Create(&inv).Error; err != nil {
		log.Fatal(err)
	}
	if err := db.Model(&inv).Update("amount", 150).Error; err != nil {
		log.Fatal(err)
	}

	var rows []struct {
		EventType         string
		AggregateSequence int
		Payload           string
	}
	db.Raw("SELECT event_type, aggregate_sequence, payload FROM outbox_records ORDER BY id").Scan(&rows)
	for _, r := range rows {
		fmt.Println(r.EventType, r.AggregateSequence, r.Payload)
	}
	// Output:
	// invoice.create 1 {"ID":1,"Amount":120}
	// invoice.update 2 {"ID":1,"Amount":150}
}

func ExamplePublish() {
	db, done := openExampleDB()
	defer done()

	// An event not tied to a model write, in the caller's transaction. The
	// transaction rolls back, and so does the event.
	err := db.Transaction(func(tx *gorm.DB) error {
		if err := outbox.Publish(tx, outbox.Event{
			Type: "invoice.reminded", AggregateType: "invoice", AggregateID: "7",
			IdempotencyKey: "reminder-7-2024-05",
		}); err != nil {
			return err
		}
		return fmt.Errorf("mail quota exceeded")
	})
	fmt.Println("transaction:", err)

	// Published twice under one idempotency key: one row.
	for range 2 {
		if err := db.Transaction(func(tx *gorm.DB) error {
			return outbox.Publish(tx, outbox.Event{
				Type: "invoice.reminded", AggregateType: "invoice", AggregateID: "7",
				IdempotencyKey: "reminder-7-2024-05",
			})
		}); err != nil {
			log.Fatal(err)
		}
	}
	var n int64
	db.Raw("SELECT count(*) FROM outbox_records").Scan(&n)
	fmt.Println("rows:", n)
	// Output:
	// transaction: mail quota exceeded
	// rows: 1
}

func ExampleTransaction() {
	db, done := openExampleDB(&Invoice{})
	defer done()

	// db.Transaction, plus a wake-up for the dispatchers after the commit
	// (and, on PostgreSQL, commits side by side with other writers').
	err := outbox.Transaction(db, func(tx *gorm.DB) error {
		inv := Invoice{Amount: 40}
		if err := tx.Create(&inv).Error; err != nil {
			return err
		}
		return outbox.Publish(tx, outbox.Event{
			Type: "invoice.sent", AggregateType: "invoice", AggregateID: strconv.Itoa(int(inv.ID)),
		})
	})
	fmt.Println("transaction:", err)

	var types []string
	db.Raw("SELECT event_type FROM outbox_records ORDER BY id").Scan(&types)
	fmt.Println(types)
	// Output:
	// transaction: <nil>
	// [invoice.create invoice.sent]
}

func ExampleNewDispatcher() {
	db, done := openExampleDB(&Invoice{})
	defer done()
	db.Create(&Invoice{Amount: 10})
	db.Create(&Invoice{Amount: 20})

	publisher := outbox.PublisherFunc(func(ctx context.Context, b outbox.Batch) error {
		for _, m := range b.Messages {
			fmt.Printf("%s %s/%s #%d attempt %d\n", m.EventType, m.AggregateType, m.AggregateID, m.Sequence, m.Attempt)
		}
		return nil // every message accepted
	})
	d, err := outbox.NewDispatcher(db, publisher, outbox.WithBatchSize(50))
	if err != nil {
		log.Fatal(err)
	}
	n, err := d.DispatchOnce(context.Background())
	fmt.Println("delivered:", n, err)
	// Output:
	// invoice.create invoice/1 #1 attempt 1
	// invoice.create invoice/2 #1 attempt 1
	// delivered: 2 <nil>
}

func ExampleDispatcher_Discard() {
	db, done := openExampleDB(&Invoice{})
	defer done()
	db.Create(&Invoice{Amount: 10})
	db.Model(&Invoice{ID: 1}).Update("amount", 15)

	// The consumer refuses invoice 1's first event for good, and so the
	// update after it waits.
	publisher := outbox.PublisherFunc(func(ctx context.Context, b outbox.Batch) error {
		for _, m := range b.Messages {
			if m.EventType == "invoice.create" {
				return outbox.Permanent(fmt.Errorf("schema mismatch"))
			}
			fmt.Println("delivered", m.EventType, m.Sequence)
		}
		return nil
	})
	d, err := outbox.NewDispatcher(db, publisher, outbox.WithBatchSize(1), outbox.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		log.Fatal(err)
	}
	ctx := context.Background()
	d.DispatchOnce(ctx)
	d.DispatchOnce(ctx)

	// A person decides the event will never be delivered.
	n, err := d.Discard(ctx, outbox.RequeueFilter{EventTypes: []string{"invoice.create"}})
	fmt.Println("discarded:", n, err)
	d.DispatchOnce(ctx)
	// Output:
	// discarded: 1 <nil>
	// delivered invoice.update 2
}

func ExampleWithMaxPayloadBytes() {
	db, done := exampleSQLite()
	defer done()
	if err := db.Use(outbox.Plugin(outbox.WithMaxPayloadBytes(64))); err != nil {
		log.Fatal(err)
	}
	if err := outbox.AutoMigrate(db); err != nil {
		log.Fatal(err)
	}
	if err := db.AutoMigrate(&Invoice{}); err != nil {
		log.Fatal(err)
	}

	err := outbox.Publish(db, outbox.Event{
		Type: "invoice.scanned", AggregateType: "invoice", AggregateID: "1",
		Payload: map[string]string{"pdf": strings.Repeat("A", 100)},
	})
	fmt.Println(errors.Is(err, outbox.ErrInvalidEvent))
	fmt.Println(err)
	// Output:
	// true
	// outbox: invalid event "invoice.scanned": payload is 110 bytes encoded, more than the 64 allowed (WithMaxPayloadBytes)
}
