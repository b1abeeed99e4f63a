package outboxamqp_test

import (
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cloudevents/sdk-go/v2/event"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/gorm-outbox/outbox/internal/outboxtest/brokertest"
)

// amqpServer is the RabbitMQ server the tests use.
var amqpServer = brokertest.Server{Name: "RabbitMQ", Env: "OUTBOX_AMQP_URL", Default: "amqp://guest:guest@127.0.0.1:5672/"}

func amqpURL() string { return amqpServer.Addr() }

// dial returns a connection to the test server, closed when t ends; it
// skips the test when the server does not answer, or fails it under
// CI=true.
func dial(t testing.TB) *amqp.Connection {
	t.Helper()
	conn, err := amqp.DialConfig(amqpURL(), amqp.Config{Dial: amqp.DefaultDial(3 * time.Second)})
	if err != nil {
		amqpServer.Unreachable(t, err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

var nameSeq atomic.Int64

// topology is a topic exchange and a queue of its own for one test, the
// queue bound to the exchange with binding keys.
type topology struct {
	exchange, queue string
	ch              *amqp.Channel // the consumer's
}

// newTopology declares an exchange and a queue bound with each of keys,
// and deletes both when t ends.
func newTopology(t testing.TB, keys ...string) topology {
	t.Helper()
	conn := dial(t)
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	name := fmt.Sprintf("outboxt.%d.%d.%d", os.Getpid(), time.Now().UnixNano()%1e9, nameSeq.Add(1))
	tp := topology{exchange: name, queue: name, ch: ch}
	tp.declareExchange(t)
	if _, err := ch.QueueDeclare(name, false, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		if err := ch.QueueBind(name, k, name, false, nil); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		_, _ = ch.QueueDelete(name, false, false, false)
		_ = ch.ExchangeDelete(name, false, false)
	})
	return tp
}

func (tp topology) declareExchange(t testing.TB) {
	t.Helper()
	if err := tp.ch.ExchangeDeclare(tp.exchange, amqp.ExchangeTopic, false, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
}

// receive takes every message from the queue until it has been empty for
// a moment, or want were taken.
func (tp topology) receive(t testing.TB, want int) []amqp.Delivery {
	t.Helper()
	var out []amqp.Delivery
	deadline := time.Now().Add(10 * time.Second)
	emptySince := time.Time{}
	for time.Now().Before(deadline) {
		d, ok, err := tp.ch.Get(tp.queue, true)
		if err != nil {
			t.Fatalf("get from %s: %v", tp.queue, err)
		}
		if ok {
			out = append(out, d)
			emptySince = time.Time{}
			continue
		}
		if len(out) >= want {
			if emptySince.IsZero() {
				emptySince = time.Now()
			} else if time.Since(emptySince) > 100*time.Millisecond {
				break
			}
		}
		time.Sleep(5 * time.Millisecond)
	}
	return out
}

// events takes every message from the queue as receive does, each as a
// CloudEvent.
func (tp topology) events(t testing.TB, want int) []*event.Event {
	t.Helper()
	var out []*event.Event
	for _, d := range tp.receive(t, want) {
		out = append(out, toEvent(t, d))
	}
	return out
}

// toEvent reads a delivery as the CloudEvents AMQP binding does in binary
// content mode (each cloudEvents_ application property, case-insensitive,
// is an attribute or extension and must be a string; the content-type
// property is datacontenttype; the body is the data) and decodes it with
// the SDK.
func toEvent(t testing.TB, d amqp.Delivery) *event.Event {
	t.Helper()
	attrs := map[string]string{}
	for name, v := range d.Headers {
		attr, ok := strings.CutPrefix(strings.ToLower(name), "cloudevents_")
		if !ok {
			continue
		}
		s, ok := v.(string)
		if !ok {
			t.Fatalf("header %s is a %T, want a string", name, v)
		}
		attrs[attr] = s
	}
	if d.ContentType != "" {
		attrs["datacontenttype"] = d.ContentType
	}
	return brokertest.Event(t, brokertest.Binary{Attributes: attrs, Data: d.Body})
}
