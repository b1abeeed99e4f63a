// Package app is what the single-engine programs under testdata/nocgo
// share: everything but the driver.
package app

import (
	"context"
	"fmt"
	"strings"

	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
)

// WriteAndDeliver migrates db, publishes one event in a transaction,
// delivers it, and returns what was delivered.
func WriteAndDeliver(db *gorm.DB) (string, error) {
	db.Logger = logger.Discard
	if err := db.Use(outbox.Plugin()); err != nil {
		return "", err
	}
	if err := outbox.AutoMigrate(db); err != nil {
		return "", err
	}
	if err := outbox.Transaction(db, func(tx *gorm.DB) error {
		return outbox.Publish(tx, outbox.Event{Type: "greeting.sent", AggregateType: "greeting", AggregateID: "1"})
	}); err != nil {
		return "", err
	}
	var delivered []string
	d, err := outbox.NewDispatcher(db, outbox.PublisherFunc(func(_ context.Context, b outbox.Batch) error {
		for _, m := range b.Messages {
			delivered = append(delivered, m.EventType)
		}
		return nil
	}))
	if err != nil {
		return "", err
	}
	n, err := d.DispatchOnce(context.Background())
	if err != nil {
		return "", err
	}
	return fmt.Sprintf("delivered %d: %s", n, strings.Join(delivered, ",")), nil
}
