package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"gorm.io/driver/sqlite"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
)

// A session of outboxctl on a SQLite file: create the tables, write an
// event the way a service would, then look at it and check the table.
func Example() {
	dir, _ := os.MkdirTemp("", "outboxctl")
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "app.db")
	ctx := context.Background()
	sh := func(args ...string) {
		fmt.Println("$ outboxctl", strings.Join(args, " "))
		if code := run(ctx, append(args, "--db", "sqlite:"+path), os.Stdout, os.Stdout); code != 0 {
			fmt.Println("exit status", code)
		}
	}
	sh("migrate")

	db, _ := gorm.Open(sqlite.Open(path), &gorm.Config{Logger: logger.Discard})
	db.Use(outbox.Plugin())
	outbox.Publish(db, outbox.Event{ID: "evt-1", Type: "order.created", AggregateType: "order", AggregateID: "42",
		Payload: map[string]int{"total": 3}})
	db.Exec(`UPDATE outbox_records SET delivery_state = 'failed', delivery_attempts = 10, last_error = 'broker said no'`)
	if sqlDB, err := db.DB(); err == nil {
		sqlDB.Close()
	}

	sh("stats")
	sh("requeue", "--id", "evt-1")
	sh("check")
	// Output:
	// $ outboxctl migrate
	// migrated outbox_records
	// $ outboxctl stats
	// STATE       COUNT
	// pending     0
	// delivering  0
	// retry       0
	// failed      1
	// delivered   0
	//
	// oldest due    -
	// last failure  broker said no
	// $ outboxctl requeue --id evt-1
	// requeued 1 message(s)
	// $ outboxctl check
	// ok: no violation
}
