package outboxamqp_test

import (
	"context"
	"errors"
	"log/slog"
	"strconv"
	"testing"
	"time"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
	"github.com/gorm-outbox/outbox/outboxamqp"
)

// openOutbox returns a fresh SQLite database with the outbox plugin and
// tables.
func openOutbox(t *testing.T) *gorm.DB {
	t.Helper()
	db, _ := outboxtest.Open(t, outboxtest.SQLite, nil)
	if err := db.Use(outbox.Plugin()); err != nil {
		t.Fatal(err)
	}
	if err := outbox.AutoMigrate(db); err != nil {
		t.Fatal(err)
	}
	return db
}

// writeEvents commits n events of aggregates order/0..order/9 and rolls
// back one transaction with an event of order/rolledback after every
// tenth. It returns the committed event ids.
func writeEvents(t *testing.T, db *gorm.DB, n int) map[string]bool {
	t.Helper()
	for i := range n {
		if err := db.Transaction(func(tx *gorm.DB) error {
			return outbox.Publish(tx, outbox.Event{Type: "order.changed", AggregateType: "order",
				AggregateID: strconv.Itoa(i % 10), Payload: map[string]int{"n": i}})
		}); err != nil {
			t.Fatal(err)
		}
		if i%10 == 0 {
			err := db.Transaction(func(tx *gorm.DB) error {
				if err := outbox.Publish(tx, outbox.Event{Type: "order.changed", AggregateType: "order",
					AggregateID: "rolledback", Payload: map[string]int{"n": i}}); err != nil {
					return err
				}
				return errors.New("roll back")
			})
			if err == nil {
				t.Fatal("transaction did not roll back")
			}
		}
	}
	var ids []string
	if err := db.Raw(`SELECT event_id FROM outbox_records`).Scan(&ids).Error; err != nil {
		t.Fatal(err)
	}
	committed := map[string]bool{}
	for _, id := range ids {
		committed[id] = true
	}
	return committed
}

// drainAll runs DispatchOnce until it finds nothing due.
func drainAll(t *testing.T, d *outbox.Dispatcher) {
	t.Helper()
	for {
		n, err := d.DispatchOnce(context.Background())
		if err != nil {
			t.Fatalf("DispatchOnce: %v", err)
		}
		if n == 0 {
			return
		}
	}
}

func TestDispatcherDeliversEveryCommittedEvent(t *testing.T) {
	t.Parallel()
	tp := newTopology(t, "#")
	db := openOutbox(t)
	committed := writeEvents(t, db, 200)
	p := newPublisher(t, dial(t), outboxamqp.WithExchange(tp.exchange), outboxamqp.WithRoutingKey(routeByAggregate))
	d, err := outbox.NewDispatcher(db, p, outbox.WithBatchSize(64))
	if err != nil {
		t.Fatal(err)
	}
	drainAll(t, d)

	seen := map[string]bool{}
	last := map[string]int64{}
	for _, m := range tp.receive(t, len(committed)) {
		e := toEvent(t, m)
		if !committed[e.ID()] {
			t.Errorf("event %s (%s) arrived but was never committed", e.ID(), e.Subject())
		}
		if seen[e.ID()] {
			continue
		}
		seen[e.ID()] = true
		seq, _ := strconv.ParseInt(aggregateSequence(t, e), 10, 64)
		if seq != last[e.Subject()]+1 {
			t.Errorf("%s: first arrival of sequence %d after %d", e.Subject(), seq, last[e.Subject()])
		}
		last[e.Subject()] = seq
	}
	if len(seen) != len(committed) {
		t.Errorf("consumer saw %d of %d committed events", len(seen), len(committed))
	}
}

func TestUnroutableEventIsRetriedUntilAQueueIsBound(t *testing.T) {
	t.Parallel()
	tp := newTopology(t, "order.*")
	db := openOutbox(t)
	if err := db.Transaction(func(tx *gorm.DB) error {
		return outbox.Publish(tx,
			outbox.Event{Type: "invoice.sent", AggregateType: "invoice", AggregateID: "7", Payload: "x"},
			outbox.Event{Type: "order.placed", AggregateType: "order", AggregateID: "1", Payload: "y"})
	}); err != nil {
		t.Fatal(err)
	}
	p := newPublisher(t, dial(t), outboxamqp.WithExchange(tp.exchange), outboxamqp.WithRoutingKey(routeByAggregate))
	d, err := outbox.NewDispatcher(db, p, outbox.WithLogger(slog.New(slog.DiscardHandler)),
		outbox.WithRetryPolicy(outbox.RetryPolicyFunc(func(int, error) time.Duration { return 0 })))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.DispatchOnce(context.Background()); err != nil {
		t.Fatal(err)
	}
	states := func() map[string]string {
		st := map[string]string{}
		for _, r := range outboxtest.Records(t, db, "outbox_records") {
			st[r.AggregateType] = r.DeliveryState
		}
		return st
	}
	if st := states(); st["invoice"] != outbox.StateRetry || st["order"] != outbox.StateDelivered {
		t.Fatalf("states = %v, want the unroutable invoice event to retry and the order event delivered", st)
	}

	if err := tp.ch.QueueBind(tp.queue, "invoice.*", tp.exchange, false, nil); err != nil {
		t.Fatal(err)
	}
	drainAll(t, d)
	if st := states(); st["invoice"] != outbox.StateDelivered {
		t.Fatalf("states = %v after binding a queue, want the invoice event delivered", st)
	}
	if got := tp.receive(t, 2); len(got) != 2 {
		t.Fatalf("queue got %d messages, want 2", len(got))
	}
}
