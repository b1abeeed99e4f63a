package outboxamqp_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cloudevents/sdk-go/v2/binding"
	"github.com/cloudevents/sdk-go/v2/binding/spec"
	"github.com/cloudevents/sdk-go/v2/event"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/gorm-outbox/outbox"
)

// defaultAMQPURL is the server the tests use when OUTBOX_AMQP_URL is unset.
const defaultAMQPURL = "amqp://guest:guest@127.0.0.1:5672/"

func amqpURL() string {
	if u := os.Getenv("OUTBOX_AMQP_URL"); u != "" {
		return u
	}
	return defaultAMQPURL
}

// dial returns a connection to the test server, closed when t ends; it
// skips the test when the server does not answer, or fails it under
// CI=true.
func dial(t testing.TB) *amqp.Connection {
	t.Helper()
	conn, err := amqp.DialConfig(amqpURL(), amqp.Config{Dial: amqp.DefaultDial(3 * time.Second)})
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("RabbitMQ at %q does not answer (CI=true, so this fails instead of skipping): %v", amqpURL(), err)
		}
		t.Skipf("skipping: no RabbitMQ server at %q (set OUTBOX_AMQP_URL): %v", amqpURL(), err)
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

// message returns event number seq of aggregate agg ("type/id").
func message(agg string, seq int64) outbox.Message {
	typ, id, _ := strings.Cut(agg, "/")
	evID := fmt.Sprintf("%s-%s-%d-%d", typ, id, seq, time.Now().UnixNano())
	return outbox.Message{
		EventID: evID, EventType: typ + ".changed", AggregateType: typ, AggregateID: id,
		Sequence: seq, IdempotencyKey: evID,
		Payload:    json.RawMessage(fmt.Sprintf(`{"id":%q,"seq":%d}`, id, seq)),
		OccurredAt: time.Date(2025, 3, 4, 5, 6, 7, 890000000, time.UTC).Add(time.Duration(seq) * time.Second),
		Attempt:    1,
	}
}

// ceMessage is an AMQP delivery read as the CloudEvents AMQP binding reads
// it (binary content mode): attributes from the cloudEvents_ headers,
// datacontenttype from the content-type property.
type ceMessage struct {
	version spec.Version
	attrs   map[string]string // lower-cased prefixed name -> value
	data    []byte
}

var amqpVersions = spec.WithPrefix("cloudEvents_")

func newCEMessage(d amqp.Delivery) (ceMessage, error) {
	m := ceMessage{attrs: map[string]string{}, data: d.Body}
	for name, v := range d.Headers {
		lower := strings.ToLower(name)
		if !strings.HasPrefix(lower, "cloudevents_") {
			continue
		}
		s, ok := v.(string)
		if !ok {
			return m, fmt.Errorf("header %s is a %T, want a string", name, v)
		}
		m.attrs[lower] = s
	}
	m.version = amqpVersions.Version(m.attrs[strings.ToLower(amqpVersions.PrefixedSpecVersionName())])
	if m.version == nil {
		return m, binding.ErrUnknownEncoding
	}
	if d.ContentType != "" {
		m.attrs[strings.ToLower(m.version.AttributeFromKind(spec.DataContentType).PrefixedName())] = d.ContentType
	}
	return m, nil
}

func (m ceMessage) ReadEncoding() binding.Encoding { return binding.EncodingBinary }

func (m ceMessage) ReadStructured(context.Context, binding.StructuredWriter) error {
	return binding.ErrNotStructured
}

func (m ceMessage) ReadBinary(ctx context.Context, w binding.BinaryWriter) error {
	for name, v := range m.attrs {
		var err error
		if attr := m.version.Attribute(name); attr != nil {
			err = w.SetAttribute(attr, v)
		} else {
			err = w.SetExtension(strings.TrimPrefix(name, "cloudevents_"), v)
		}
		if err != nil {
			return err
		}
	}
	return w.SetData(bytes.NewReader(m.data))
}

func (m ceMessage) GetAttribute(k spec.Kind) (spec.Attribute, interface{}) {
	attr := m.version.AttributeFromKind(k)
	if attr == nil {
		return nil, nil
	}
	if v, ok := m.attrs[strings.ToLower(attr.PrefixedName())]; ok {
		return attr, v
	}
	return attr, nil
}

func (m ceMessage) GetExtension(name string) interface{} {
	if v, ok := m.attrs["cloudevents_"+name]; ok {
		return v
	}
	return nil
}

func (m ceMessage) Finish(error) error { return nil }

// toEvent decodes a delivery with the CloudEvents SDK and validates the
// event.
func toEvent(t testing.TB, d amqp.Delivery) *event.Event {
	t.Helper()
	msg, err := newCEMessage(d)
	if err != nil {
		t.Fatalf("not a binary-mode CloudEvent: %v (headers %v)", err, d.Headers)
	}
	e, err := binding.ToEvent(context.Background(), msg)
	if err != nil {
		t.Fatalf("CloudEvents SDK cannot read the message: %v (headers %v)", err, d.Headers)
	}
	if err := e.Validate(); err != nil {
		t.Fatalf("CloudEvents SDK: invalid event: %v", err)
	}
	return e
}

// aggregateSequence reads the aggregatesequence extension of e.
func aggregateSequence(t testing.TB, e *event.Event) string {
	t.Helper()
	v, ok := e.Extensions()["aggregatesequence"]
	if !ok {
		t.Fatalf("event %s has no aggregatesequence", e.ID())
	}
	return fmt.Sprint(v)
}
