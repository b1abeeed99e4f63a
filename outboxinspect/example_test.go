package outboxinspect_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"time"

	"gorm.io/driver/sqlite"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/outboxinspect"
)

// exampleDispatcher opens a SQLite database in a temporary directory with
// the outbox plugin registered and its tables migrated, and a dispatcher
// on it whose publisher accepts everything.
func exampleDispatcher() (*gorm.DB, *outbox.Dispatcher, func()) {
	dir, err := os.MkdirTemp("", "outboxinspect-example")
	if err != nil {
		log.Fatal(err)
	}
	dsn := "file:" + filepath.Join(dir, "app.db") + "?_busy_timeout=5000&_journal_mode=WAL&_txlock=immediate"
	db, err := gorm.Open(sqlite.Open(dsn), &gorm.Config{Logger: logger.Discard})
	if err != nil {
		log.Fatal(err)
	}
	if err := db.Use(outbox.Plugin()); err != nil {
		log.Fatal(err)
	}
	if err := outbox.AutoMigrate(db); err != nil {
		log.Fatal(err)
	}
	d, err := outbox.NewDispatcher(db, outbox.PublisherFunc(func(context.Context, outbox.Batch) error { return nil }))
	if err != nil {
		log.Fatal(err)
	}
	return db, d, func() {
		if sqlDB, err := db.DB(); err == nil {
			sqlDB.Close()
		}
		os.RemoveAll(dir)
	}
}

// What an operator looks at first: the dead letters of one event type,
// and then one of them whole.
func ExampleInspector_Messages() {
	db, d, done := exampleDispatcher()
	defer done()
	for _, id := range []string{"evt-1", "evt-2"} {
		outbox.Publish(db, outbox.Event{ID: id, Type: "order.created", AggregateType: "order", AggregateID: "42",
			Payload: map[string]int{"total": 3}})
	}
	db.Exec(`UPDATE outbox_records SET delivery_state = 'failed', delivery_attempts = 10, last_error = 'broker said no' WHERE event_id = 'evt-1'`)

	in := outboxinspect.New(d)
	ctx := context.Background()
	dead, _ := in.Messages(ctx, outboxinspect.MessageFilter{States: []string{outbox.StateFailed}, EventTypes: []string{"order.created"}})
	for _, m := range dead {
		fmt.Println(m.EventID, m.AggregateType+"/"+m.AggregateID, m.Sequence, m.Attempts, m.LastError)
	}
	m, _ := in.Message(ctx, "evt-2")
	fmt.Println(m.EventID, m.State, string(m.Payload))
	_, err := in.Message(ctx, "evt-3")
	fmt.Println(errors.Is(err, outboxinspect.ErrMessageNotFound))
	// Output:
	// evt-1 order/42 1 10 broker said no
	// evt-2 pending {"total":3}
	// true
}

// Check after a chaos test: here, a lease that a killed dispatcher left
// behind an hour ago, which no dispatcher has claimed again.
func ExampleInspector_Check() {
	db, d, done := exampleDispatcher()
	defer done()
	outbox.Publish(db, outbox.Event{ID: "evt-1", Type: "order.created", AggregateType: "order", AggregateID: "42"})
	in := outboxinspect.New(d)
	vs, _ := in.Check(context.Background(), outboxinspect.CheckOptions{})
	fmt.Println(len(vs), "violations")

	db.Exec(`UPDATE outbox_records SET delivery_state = 'delivering', locked_until = ?`,
		time.Now().Add(-time.Hour).UTC().Format("2006-01-02 15:04:05.000000000+00:00"))
	vs, _ = in.Check(context.Background(), outboxinspect.CheckOptions{MaxDueAge: -1})
	for _, v := range vs {
		fmt.Println(v.Kind, v.EventID)
	}
	// Output:
	// 0 violations
	// expired-lease evt-1
}
