package inbox_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log"
	"net/http/httptest"
	"os"
	"path/filepath"
	"time"

	"gorm.io/driver/sqlite"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/inbox"
	"github.com/gorm-outbox/outbox/outboxhttp"
)

// Delivery is the consumer's own state in the examples.
type Delivery struct {
	ID      uint
	OrderID string
}

// exampleConsumer opens a fresh SQLite file with the recommended DSN, and
// creates the consumer's table and a migrated inbox.
func exampleConsumer() (*gorm.DB, *inbox.Inbox, func()) {
	dir, err := os.MkdirTemp("", "inbox-example")
	if err != nil {
		log.Fatal(err)
	}
	dsn := "file:" + filepath.Join(dir, "consumer.db") + "?_busy_timeout=5000&_journal_mode=WAL&_txlock=immediate"
	db, err := gorm.Open(sqlite.Open(dsn), &gorm.Config{Logger: logger.Discard})
	if err != nil {
		log.Fatal(err)
	}
	if err := db.AutoMigrate(&Delivery{}); err != nil {
		log.Fatal(err)
	}
	in, err := inbox.New(db, inbox.WithTable("inbox_records"))
	if err != nil {
		log.Fatal(err)
	}
	if err := in.Migrate(context.Background()); err != nil {
		log.Fatal(err)
	}
	return db, in, func() {
		if sqlDB, err := db.DB(); err == nil {
			sqlDB.Close()
		}
		os.RemoveAll(dir)
	}
}

func ExampleInbox_Handle() {
	db, in, done := exampleConsumer()
	defer done()
	ctx := context.Background()

	// The same event arrives twice, as at-least-once delivery allows.
	for range 2 {
		handled, err := in.Handle(ctx, "0190b4e2-order-42-paid", func(tx *gorm.DB) error {
			// The consumer's writes, in one transaction with the inbox row.
			return tx.Create(&Delivery{OrderID: "42"}).Error
		})
		fmt.Println("handled:", handled, "error:", err)
	}

	var n int64
	db.Model(&Delivery{}).Count(&n)
	fmt.Println("deliveries:", n)

	// Much later, forget the ids of events too old to be delivered again.
	forgotten, err := in.Cleanup(ctx, 30*24*time.Hour)
	fmt.Println("forgotten:", forgotten, "error:", err)
	// Output:
	// handled: true error: <nil>
	// handled: false error: <nil>
	// deliveries: 1
	// forgotten: 0 error: <nil>
}

func ExampleReceiver() {
	db, in, done := exampleConsumer()
	defer done()
	secret := []byte("shared-secret")

	// The consumer's endpoint: each message of a batch applied once.
	receiver, err := inbox.NewReceiver(in, func(tx *gorm.DB, m outbox.Message) error {
		var order struct {
			ID string `json:"id"`
		}
		if err := json.Unmarshal(m.Payload, &order); err != nil {
			return outbox.Permanent(err) // retrying cannot help
		}
		return tx.Create(&Delivery{OrderID: order.ID}).Error
	}, inbox.WithSecret(secret))
	if err != nil {
		log.Fatal(err)
	}
	srv := httptest.NewServer(receiver)
	defer srv.Close()

	// The producer's side: what a Dispatcher does with an outboxhttp
	// publisher. The second batch redelivers evt-1 with a new message.
	pub, err := outboxhttp.New(srv.URL, outboxhttp.WithSecret(secret))
	if err != nil {
		log.Fatal(err)
	}
	msg := func(id, order string) outbox.Message {
		return outbox.Message{EventID: id, EventType: "order.paid", AggregateType: "order", AggregateID: order,
			Sequence: 1, Payload: json.RawMessage(`{"id":"` + order + `"}`)}
	}
	ctx := context.Background()
	fmt.Println(pub.Publish(ctx, outbox.Batch{ID: "batch-1", Messages: []outbox.Message{msg("evt-1", "7")}}))
	fmt.Println(pub.Publish(ctx, outbox.Batch{ID: "batch-2", Messages: []outbox.Message{msg("evt-1", "7"), msg("evt-2", "8")}}))

	var orders []string
	db.Model(&Delivery{}).Order("id").Pluck("order_id", &orders)
	fmt.Println(orders)
	// Output:
	// <nil>
	// <nil>
	// [7 8]
}
