package outboxinspect_test

import (
	"context"
	"testing"
	"time"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
	"github.com/gorm-outbox/outbox/internal/outboxtest/deliveries"
)

type recorder = deliveries.Recorder

// setup opens a fresh database on engine e with the outbox plugin
// registered and its tables migrated.
func setup(t *testing.T, e outboxtest.Engine) *gorm.DB {
	t.Helper()
	db, _ := outboxtest.Open(t, e, nil)
	mustNil(t, db.Use(outbox.Plugin()))
	mustNil(t, outbox.AutoMigrate(db))
	return db
}

func newDispatcher(t *testing.T, db *gorm.DB, p outbox.Publisher) *outbox.Dispatcher {
	t.Helper()
	d, err := outbox.NewDispatcher(db, p, outbox.WithLogger(outboxtest.Logger(t)))
	mustNil(t, err)
	return d
}

// dispatch runs one DispatchOnce and returns how many events it delivered.
func dispatch(t *testing.T, d *outbox.Dispatcher) int {
	t.Helper()
	n, err := d.DispatchOnce(context.Background())
	mustNil(t, err)
	return n
}

// publishN records n events of aggregate ("agg", aggregate).
func publishN(t *testing.T, db *gorm.DB, aggregate string, n int) {
	t.Helper()
	for range n {
		mustNil(t, outbox.Publish(db, outbox.Event{Type: "t", AggregateType: "agg", AggregateID: aggregate, Payload: map[string]string{"a": aggregate}}))
	}
}

// at returns t as the engine's tests store timestamps planted by SQL: the
// fixed-width UTC text on SQLite, a time elsewhere.
func at(e outboxtest.Engine, t time.Time) any {
	if e == outboxtest.SQLite {
		return t.UTC().Format("2006-01-02 15:04:05.000000000+00:00")
	}
	return t
}

func mustNil(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
