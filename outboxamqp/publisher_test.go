package outboxamqp_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/gorm-outbox/outbox"
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
	cases := []struct {
		name string
		conn *amqp.Connection
		opts []outboxamqp.Option
		want string
	}{
		{"nil connection", nil, nil, "conn"},
		{"nil routing key function", conn, []outboxamqp.Option{outboxamqp.WithRoutingKey(nil)}, "WithRoutingKey"},
		{"exchange with a space", conn, []outboxamqp.Option{outboxamqp.WithExchange("my exchange")}, "WithExchange"},
		{"exchange too long", conn, []outboxamqp.Option{outboxamqp.WithExchange(strings.Repeat("x", 128))}, "WithExchange"},
		{"empty source", conn, []outboxamqp.Option{outboxamqp.WithSource("")}, "WithSource"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := outboxamqp.New(c.conn, c.opts...)
			if !errors.Is(err, outbox.ErrInvalidOption) || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("New = %v, want ErrInvalidOption naming %s", err, c.want)
			}
		})
	}
}

func TestEveryMessageArrivesAsTheCloudEventItWas(t *testing.T) {
	t.Parallel()
	tp := newTopology(t, "order.*")
	p := newPublisher(t, dial(t), outboxamqp.WithExchange(tp.exchange), outboxamqp.WithRoutingKey(routeByAggregate),
		outboxamqp.WithSource("/shop/orders"))

	m1 := message("order/42", 1)
	m1.EventType = "order placed ünïcode"
	m1.Headers = map[string]string{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
	m2 := message("order/42", 2)
	b := outbox.Batch{ID: "b1", Messages: []outbox.Message{m1, m2}}
	if err := p.Publish(context.Background(), b); err != nil {
		t.Fatalf("Publish: %v", err)
	}

	got := tp.receive(t, 2)
	if len(got) != 2 {
		t.Fatalf("queue got %d messages, want 2", len(got))
	}
	for i, d := range got {
		m := b.Messages[i]
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
		e := toEvent(t, d)
		checks := []struct{ name, got, want string }{
			{"id", e.ID(), m.EventID},
			{"type", e.Type(), m.EventType},
			{"source", e.Source(), "/shop/orders"},
			{"specversion", e.SpecVersion(), "1.0"},
			{"time", e.Time().UTC().Format(time.RFC3339Nano), m.OccurredAt.Format(time.RFC3339Nano)},
			{"subject", e.Subject(), "order/42"},
			{"datacontenttype", e.DataContentType(), "application/json"},
			{"partitionkey", fmt.Sprint(e.Extensions()["partitionkey"]), "order/42"},
			{"aggregatetype", fmt.Sprint(e.Extensions()["aggregatetype"]), "order"},
			{"aggregateid", fmt.Sprint(e.Extensions()["aggregateid"]), "42"},
			{"aggregatesequence", aggregateSequence(t, e), strconv.FormatInt(m.Sequence, 10)},
			{"data", string(e.Data()), string(m.Payload)},
		}
		for _, c := range checks {
			if c.got != c.want {
				t.Errorf("message %d: %s = %q, want %q", i+1, c.name, c.got, c.want)
			}
		}
	}
	if tpv := got[0].Headers["traceparent"]; tpv != m1.Headers["traceparent"] {
		t.Errorf("traceparent = %v, want the event's header unchanged", tpv)
	}
}

func TestAggregateOrderHoldsOnTheConsumerSide(t *testing.T) {
	t.Parallel()
	tp := newTopology(t, "#")
	p := newPublisher(t, dial(t), outboxamqp.WithExchange(tp.exchange), outboxamqp.WithRoutingKey(routeByAggregate))
	var b outbox.Batch
	for seq := int64(1); seq <= 50; seq++ {
		for _, agg := range []string{"order/1", "order/2", "cart/9"} {
			b.Messages = append(b.Messages, message(agg, seq))
		}
	}
	if err := p.Publish(context.Background(), b); err != nil {
		t.Fatalf("Publish: %v", err)
	}
	got := tp.receive(t, len(b.Messages))
	last := map[string]int64{}
	for _, d := range got {
		e := toEvent(t, d)
		seq, _ := strconv.ParseInt(aggregateSequence(t, e), 10, 64)
		if seq != last[e.Subject()]+1 {
			t.Fatalf("%s: sequence %d after %d", e.Subject(), seq, last[e.Subject()])
		}
		last[e.Subject()] = seq
	}
	if len(got) != len(b.Messages) {
		t.Fatalf("queue got %d messages, want %d", len(got), len(b.Messages))
	}
}

// RabbitMQ does not deduplicate: a batch published again reaches the
// queue again, with the same MessageId and ce id, for the consumer to
// drop.
func TestDuplicateBatchIsDeliveredTwiceWithTheSameIDs(t *testing.T) {
	t.Parallel()
	tp := newTopology(t, "#")
	p := newPublisher(t, dial(t), outboxamqp.WithExchange(tp.exchange))
	b := outbox.Batch{ID: "b", Messages: []outbox.Message{message("order/1", 1), message("order/2", 1)}}
	for range 2 {
		if err := p.Publish(context.Background(), b); err != nil {
			t.Fatal(err)
		}
	}
	got := tp.receive(t, 4)
	count := map[string]int{}
	for _, d := range got {
		count[d.MessageId]++
		if id := toEvent(t, d).ID(); id != d.MessageId {
			t.Errorf("ce id %q, MessageId %q", id, d.MessageId)
		}
	}
	for _, m := range b.Messages {
		if count[m.EventID] != 2 {
			t.Errorf("%s arrived %d times, want 2", m.EventID, count[m.EventID])
		}
	}
}

func TestUnroutableMessageIsNotAccepted(t *testing.T) {
	t.Parallel()
	tp := newTopology(t, "order.*")
	p := newPublisher(t, dial(t), outboxamqp.WithExchange(tp.exchange), outboxamqp.WithRoutingKey(routeByAggregate))
	lost := message("nobody/1", 1)
	b := outbox.Batch{ID: "b", Messages: []outbox.Message{
		message("order/1", 1), lost, message("nobody/1", 2), message("order/1", 2),
	}}
	err := p.Publish(context.Background(), b)
	var pe *outbox.PartialError
	if !errors.As(err, &pe) || len(pe.Failed) != 2 {
		t.Fatalf("Publish = %v, want the unroutable message and the next of its aggregate failed", err)
	}
	if e := pe.Failed[lost.EventID]; !errors.Is(e, outboxamqp.ErrReturned) || outbox.IsPermanent(e) {
		t.Errorf("unroutable message: %v, want a retryable ErrReturned", e)
	}
	if e := pe.Failed[b.Messages[2].EventID]; !errors.Is(e, outbox.ErrNotAttempted) {
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
	big := message("order/1", 2)
	big.Payload = make([]byte, 128<<20+1)
	b := outbox.Batch{ID: "b", Messages: []outbox.Message{message("order/1", 1), big, message("order/1", 3)}}
	err := p.Publish(context.Background(), b)
	var pe *outbox.PartialError
	if !errors.As(err, &pe) {
		t.Fatalf("Publish = %v, want a PartialError", err)
	}
	if e := pe.Failed[big.EventID]; !outbox.IsPermanent(e) {
		t.Fatalf("big message: %v, want a permanent failure", e)
	}
	if e := pe.Failed[b.Messages[2].EventID]; !errors.Is(e, outbox.ErrNotAttempted) {
		t.Errorf("next message of its aggregate: %v, want ErrNotAttempted", e)
	}
	if _, failed := pe.Failed[b.Messages[0].EventID]; failed {
		t.Errorf("the message before it failed: %v", pe.Failed[b.Messages[0].EventID])
	}
	// The broker closed the channel; the next batch opens another.
	if err := p.Publish(context.Background(), outbox.Batch{ID: "b2", Messages: []outbox.Message{message("order/2", 1)}}); err != nil {
		t.Fatalf("next batch: %v", err)
	}
}

func TestClosedChannelIsReopenedOnTheNextBatch(t *testing.T) {
	t.Parallel()
	tp := newTopology(t, "#")
	p := newPublisher(t, dial(t), outboxamqp.WithExchange(tp.exchange))
	one := func(agg string) outbox.Batch {
		return outbox.Batch{ID: "b", Messages: []outbox.Message{message(agg, 1)}}
	}
	if err := p.Publish(context.Background(), one("order/1")); err != nil {
		t.Fatal(err)
	}
	// Without its exchange the broker closes the channel (404).
	if err := tp.ch.ExchangeDelete(tp.exchange, false, false); err != nil {
		t.Fatal(err)
	}
	err := p.Publish(context.Background(), one("order/2"))
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
	if err := p.Publish(context.Background(), one("order/3")); err != nil {
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
	err := p.Publish(context.Background(), outbox.Batch{ID: "b", Messages: []outbox.Message{message("order/1", 1)}})
	if err == nil || outbox.IsPermanent(err) || !errors.Is(err, amqp.ErrClosed) {
		t.Fatalf("Publish on a closed connection = %v, want a retryable amqp.ErrClosed", err)
	}
}

func TestContextExpiringMidBatchStopsThePublish(t *testing.T) {
	t.Parallel()
	tp := newTopology(t, "#")
	p := newPublisher(t, dial(t), outboxamqp.WithExchange(tp.exchange), outboxamqp.WithRoutingKey(routeByAggregate))
	var b outbox.Batch
	for seq := int64(1); seq <= 1000; seq++ {
		b.Messages = append(b.Messages, message("order/1", seq), message("order/2", seq))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Millisecond)
	defer cancel()
	start := time.Now()
	err := p.Publish(ctx, b)
	if elapsed := time.Since(start); elapsed > 500*time.Millisecond {
		t.Errorf("Publish took %v with a 3ms deadline", elapsed)
	}
	var pe *outbox.PartialError
	if !errors.As(err, &pe) {
		t.Fatalf("Publish = %v, want a PartialError", err)
	}
	failedFrom := map[string]bool{}
	for _, m := range b.Messages {
		e, failed := pe.Failed[m.EventID]
		switch {
		case failed && outbox.IsPermanent(e):
			t.Fatalf("%s: %v, want a retryable failure", m.EventID, e)
		case failed:
			failedFrom[m.AggregateID] = true
		case failedFrom[m.AggregateID]:
			t.Fatalf("%s accepted after a failed message of its aggregate", m.EventID)
		}
	}
	if len(failedFrom) == 0 {
		t.Fatal("every message confirmed within 3ms: the deadline did not cut the batch")
	}
	// The next batch runs on a fresh channel, untouched by late confirms.
	next := outbox.Batch{ID: "b2", Messages: []outbox.Message{message("order/3", 1)}}
	if err := p.Publish(context.Background(), next); err != nil {
		t.Fatalf("next batch: %v", err)
	}
}
