package outboxamqp_test

import (
	"context"
	"testing"
	"time"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
	"github.com/gorm-outbox/outbox/internal/outboxtest/brokertest"
	"github.com/gorm-outbox/outbox/outboxamqp"
)

// RabbitMQ does not deduplicate, and a dispatcher that could not settle a
// batch publishes it again: the consumer is promised every committed event
// at least once, first arrivals in sequence order per aggregate.
func TestDispatcherDeliversEveryCommittedEvent(t *testing.T) {
	t.Parallel()
	tp := newTopology(t, "#")
	db, _ := brokertest.OpenOutbox(t)
	w := brokertest.WriteEvents(t, db, 200, 10)
	p := newPublisher(t, dial(t), outboxamqp.WithExchange(tp.exchange), outboxamqp.WithRoutingKey(routeByAggregate))

	brokertest.DeliverAll(t, db, p, outbox.WithBatchSize(64))
	brokertest.CheckDelivered(t, tp.events(t, len(w.Committed)), w.Committed)
}

func TestUnroutableEventIsRetriedUntilAQueueIsBound(t *testing.T) {
	t.Parallel()
	tp := newTopology(t, "order.*")
	db, _ := brokertest.OpenOutbox(t)
	if err := db.Transaction(func(tx *gorm.DB) error {
		return outbox.Publish(tx,
			outbox.Event{ID: "invoice", Type: "invoice.sent", AggregateType: "invoice", AggregateID: "7", Payload: "x"},
			outbox.Event{ID: "order", Type: "order.placed", AggregateType: "order", AggregateID: "1", Payload: "y"})
	}); err != nil {
		t.Fatal(err)
	}
	p := newPublisher(t, dial(t), outboxamqp.WithExchange(tp.exchange), outboxamqp.WithRoutingKey(routeByAggregate))
	d, err := outbox.NewDispatcher(db, p, outbox.WithLogger(outboxtest.Logger(t)),
		outbox.WithRetryPolicy(outbox.RetryPolicyFunc(func(int, error) time.Duration { return 0 })))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.DispatchOnce(context.Background()); err != nil {
		t.Fatal(err)
	}
	// The unroutable invoice event is due again at once; the order event is delivered.
	brokertest.CheckStates(t, brokertest.States(t, db), map[string]string{"invoice": "retry/1", "order": "delivered/1"})

	if err := tp.ch.QueueBind(tp.queue, "invoice.*", tp.exchange, false, nil); err != nil {
		t.Fatal(err)
	}
	brokertest.Drain(t, d)
	brokertest.CheckStates(t, brokertest.States(t, db), map[string]string{"invoice": "delivered/2", "order": "delivered/1"})
	if got := tp.receive(t, 2); len(got) != 2 {
		t.Fatalf("queue got %d messages, want 2", len(got))
	}
}
