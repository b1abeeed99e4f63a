package outboxamqp_test

import (
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cloudevents/sdk-go/v2/event"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest/brokertest"
	"github.com/gorm-outbox/outbox/outboxamqp"
)

func newPublisher(t testing.TB, conn *amqp.Connection, opts ...outboxamqp.Option) *outboxamqp.Publisher {
	t.Helper()
	p, err := outboxamqp.New(conn, opts...)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// routeByAggregate routes each message with "<aggregate type>.<id>".
func routeByAggregate(m outbox.Message) string { return m.AggregateType + "." + m.AggregateID }

func TestNewRejectsInvalidOptions(t *testing.T) {
	t.Parallel()
	conn := &amqp.Connection{} // never used: New does not contact the server
	brokertest.CheckNewRejects(t, outboxamqp.New, []brokertest.Rejected[*amqp.Connection, outboxamqp.Option]{
		{Name: "nil connection", Naming: "conn"},
		{Name: "nil routing key function", Client: conn, Options: []outboxamqp.Option{outboxamqp.WithRoutingKey(nil)}, Naming: "WithRoutingKey"},
		{Name: "exchange with a space", Client: conn, Options: []outboxamqp.Option{outboxamqp.WithExchange("my exchange")}, Naming: "WithExchange"},
		{Name: "exchange too long", Client: conn, Options: []outboxamqp.Option{outboxamqp.WithExchange(strings.Repeat("x", 128))}, Naming: "WithExchange"},
		{Name: "empty source", Client: conn, Options: []outboxamqp.Option{outboxamqp.WithSource("")}, Naming: "WithSource"},
		{Name: "source with a space", Client: conn, Options: []outboxamqp.Option{outboxamqp.WithSource("my app")}, Naming: "WithSource"},
		{Name: "source with a control character", Client: conn, Options: []outboxamqp.Option{outboxamqp.WithSource("shop\x00")}, Naming: "WithSource"},
		{Name: "source not a URI", Client: conn, Options: []outboxamqp.Option{outboxamqp.WithSource("%zz")}, Naming: "WithSource"},
	})
}

func TestEveryMessageArrivesAsTheCloudEventItWas(t *testing.T) {
	t.Parallel()
	tp := newTopology(t, "order.*")
	p := newPublisher(t, dial(t), outboxamqp.WithExchange(tp.exchange), outboxamqp.WithRoutingKey(routeByAggregate),
		outboxamqp.WithSource("/shop/orders"))

	m1 := brokertest.Message("order/42", 1)
	m1.EventType = "order placed ünïcode"
	m1.Headers = map[string]string{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
	msgs := []outbox.Message{m1, brokertest.Message("order/42", 2)}
	if err := brokertest.Publish(t, p, msgs...); err != nil {
		t.Fatalf("Publish: %v", err)
	}

	got := tp.receive(t, 2)
	if len(got) != 2 {
		t.Fatalf("queue got %d messages, want 2", len(got))
	}
	for i, d := range got {
		m := msgs[i]
		props := []struct{ name, got, want string }{
			{"body", string(d.Body), string(m.Payload)},
			{"MessageId", d.MessageId, m.EventID},
			{"Type", d.Type, m.EventType},
			{"ContentType", d.ContentType, "application/json"},
			{"Timestamp", d.Timestamp.UTC().String(), m.OccurredAt.Truncate(time.Second).String()},
			{"DeliveryMode", strconv.Itoa(int(d.DeliveryMode)), strconv.Itoa(int(amqp.Persistent))},
		}
		for _, c := range props {
			if c.got != c.want {
				t.Errorf("message %d: %s = %q, want %q", i+1, c.name, c.got, c.want)
			}
		}
		if _, ok := d.Headers["cloudEvents_datacontenttype"]; ok {
			t.Errorf("message %d: datacontenttype in a header; the binding carries it in content-type", i+1)
		}
		brokertest.CheckEvent(t, toEvent(t, d), m, "/shop/orders")
	}
	if tpv := got[0].Headers["traceparent"]; tpv != m1.Headers["traceparent"] {
		t.Errorf("traceparent = %v, want the event's header unchanged", tpv)
	}
}

func TestAggregateOrderHoldsOnTheConsumerSide(t *testing.T) {
	t.Parallel()
	tp := newTopology(t, "#")
	p := newPublisher(t, dial(t), outboxamqp.WithExchange(tp.exchange), outboxamqp.WithRoutingKey(routeByAggregate))
	msgs := brokertest.Interleaved(50, "order/1", "order/2", "cart/9")
	if err := brokertest.Publish(t, p, msgs...); err != nil {
		t.Fatalf("Publish: %v", err)
	}
	brokertest.CheckInOrder(t, tp.events(t, len(msgs)), msgs)
}

// RabbitMQ does not deduplicate: a batch published again reaches the
// queue again, with the same MessageId and ce id, for the consumer to
// drop.
func TestDuplicateBatchIsDeliveredTwiceWithTheSameIDs(t *testing.T) {
	t.Parallel()
	tp := newTopology(t, "#")
	p := newPublisher(t, dial(t), outboxamqp.WithExchange(tp.exchange))
	brokertest.CheckDuplicateBatch(t, p, 2, func() []*event.Event {
		var events []*event.Event
		for _, d := range tp.receive(t, 6) {
			e := toEvent(t, d)
			if e.ID() != d.MessageId {
				t.Errorf("ce id %q, MessageId %q", e.ID(), d.MessageId)
			}
			events = append(events, e)
		}
		return events
	})
}

func TestUnroutableMessageIsNotAccepted(t *testing.T) {
	t.Parallel()
	tp := newTopology(t, "order.*")
	p := newPublisher(t, dial(t), outboxamqp.WithExchange(tp.exchange), outboxamqp.WithRoutingKey(routeByAggregate))
	lost := brokertest.Message("nobody/1", 1)
	msgs := []outbox.Message{brokertest.Message("order/1", 1), lost, brokertest.Message("nobody/1", 2), brokertest.Message("order/1", 2)}
	failed := brokertest.Failures(t, brokertest.Publish(t, p, msgs...))
	if len(failed) != 2 {
		t.Fatalf("failed = %v, want the unroutable message and the next of its aggregate", failed)
	}
	if e := failed[lost.EventID]; !errors.Is(e, outboxamqp.ErrReturned) || outbox.IsPermanent(e) {
		t.Errorf("unroutable message: %v, want a retryable ErrReturned", e)
	}
	if e := failed[msgs[2].EventID]; !errors.Is(e, outbox.ErrNotAttempted) {
		t.Errorf("next message of its aggregate: %v, want ErrNotAttempted", e)
	}
	if got := tp.receive(t, 2); len(got) != 2 {
		t.Errorf("queue got %d messages, want the 2 routable ones", len(got))
	}
}

func TestOversizedMessageFailsPermanently(t *testing.T) {
	t.Parallel()
	tp := newTopology(t, "#")
	p := newPublisher(t, dial(t), outboxamqp.WithExchange(tp.exchange))
	// RabbitMQ's default max_message_size is 128 MiB.
	failed := brokertest.CheckOversizedMessageFails(t, p, make([]byte, 128<<20+1), nil)
	if e, isFailed := failed[brokertest.Message("order/1", 1).EventID]; isFailed {
		t.Errorf("the message before it failed: %v", e)
	}
	// The broker closed the channel; the next batch opens another.
	if err := brokertest.Publish(t, p, brokertest.Message("order/2", 1)); err != nil {
		t.Fatalf("next batch: %v", err)
	}
}

func TestClosedChannelIsReopenedOnTheNextBatch(t *testing.T) {
	t.Parallel()
	tp := newTopology(t, "#")
	p := newPublisher(t, dial(t), outboxamqp.WithExchange(tp.exchange))
	if err := brokertest.Publish(t, p, brokertest.Message("order/1", 1)); err != nil {
		t.Fatal(err)
	}
	// Without its exchange the broker closes the channel (404).
	if err := tp.ch.ExchangeDelete(tp.exchange, false, false); err != nil {
		t.Fatal(err)
	}
	err := brokertest.Publish(t, p, brokertest.Message("order/2", 1))
	if err == nil || outbox.IsPermanent(err) {
		t.Fatalf("Publish to a deleted exchange = %v, want a retryable failure", err)
	}
	var pe *outbox.PartialError
	if errors.As(err, &pe) {
		for _, e := range pe.Failed {
			if outbox.IsPermanent(e) {
				t.Fatalf("Publish to a deleted exchange: %v, want a retryable failure", e)
			}
		}
	}
	tp.declareExchange(t)
	if err := tp.ch.QueueBind(tp.queue, "#", tp.exchange, false, nil); err != nil {
		t.Fatal(err)
	}
	if err := brokertest.Publish(t, p, brokertest.Message("order/3", 1)); err != nil {
		t.Fatalf("Publish after the exchange is back: %v", err)
	}
}

func TestClosedConnectionIsRetryable(t *testing.T) {
	t.Parallel()
	conn := dial(t)
	p := newPublisher(t, conn)
	if err := conn.Close(); err != nil {
		t.Fatal(err)
	}
	err := brokertest.Publish(t, p, brokertest.Message("order/1", 1))
	if err == nil || outbox.IsPermanent(err) || !errors.Is(err, amqp.ErrClosed) {
		t.Fatalf("Publish on a closed connection = %v, want a retryable amqp.ErrClosed", err)
	}
}

func TestContextExpiringMidBatchStopsThePublish(t *testing.T) {
	t.Parallel()
	tp := newTopology(t, "#")
	p := newPublisher(t, dial(t), outboxamqp.WithExchange(tp.exchange), outboxamqp.WithRoutingKey(routeByAggregate))
	brokertest.CheckDeadlineCutsTheBatch(t, p)
	// The next batch runs on a fresh channel, untouched by late confirms.
	if err := brokertest.Publish(t, p, brokertest.Message("order/3", 1)); err != nil {
		t.Fatalf("next batch: %v", err)
	}
}
