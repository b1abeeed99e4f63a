package outboxnats_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/cloudevents/sdk-go/v2/binding"
	"github.com/cloudevents/sdk-go/v2/binding/spec"
	"github.com/cloudevents/sdk-go/v2/event"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/gorm-outbox/outbox"
)

// defaultNATSURL is the server the tests use when OUTBOX_NATS_URL is unset.
const defaultNATSURL = "nats://127.0.0.1:4222"

func natsURL() string {
	if u := os.Getenv("OUTBOX_NATS_URL"); u != "" {
		return u
	}
	return defaultNATSURL
}

// connect returns a JetStream context on the test server; it skips the
// test when the server does not answer, or fails it under CI=true.
func connect(t testing.TB) jetstream.JetStream {
	t.Helper()
	nc, err := nats.Connect(natsURL(), nats.Timeout(2*time.Second))
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("NATS at %q does not answer (CI=true, so this fails instead of skipping): %v", natsURL(), err)
		}
		t.Skipf("skipping: no NATS server at %q (set OUTBOX_NATS_URL): %v", natsURL(), err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatalf("jetstream.New: %v", err)
	}
	return js
}

var streamSeq atomic.Int64

// testStream is a stream of its own for one test, bound to prefix.>.
type testStream struct {
	name, prefix string
	stream       jetstream.Stream
}

// newStream creates a stream bound to a unique subject prefix, with cfg's
// limits, and deletes it when t ends.
func newStream(t testing.TB, js jetstream.JetStream, cfg jetstream.StreamConfig) testStream {
	t.Helper()
	name := fmt.Sprintf("OUTBOXT_%d_%d_%d", os.Getpid(), time.Now().UnixNano()%1e9, streamSeq.Add(1))
	prefix := strings.ToLower(name)
	cfg.Name = name
	cfg.Subjects = []string{prefix + ".>"}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s, err := js.CreateStream(ctx, cfg)
	if err != nil {
		t.Fatalf("create stream %s: %v", name, err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = js.DeleteStream(ctx, name)
	})
	return testStream{name: name, prefix: prefix, stream: s}
}

// subject routes every message to prefix.<aggregate type>.
func (s testStream) subject(m outbox.Message) string { return s.prefix + "." + m.AggregateType }

// stored returns every message of the stream, in stream order.
func (s testStream) stored(t testing.TB) []*jetstream.RawStreamMsg {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	info, err := s.stream.Info(ctx)
	if err != nil {
		t.Fatalf("stream info: %v", err)
	}
	var out []*jetstream.RawStreamMsg
	if info.State.Msgs == 0 {
		return nil
	}
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq; seq++ {
		m, err := s.stream.GetMsg(ctx, seq)
		if err != nil {
			t.Fatalf("get message %d: %v", seq, err)
		}
		out = append(out, m)
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

// ceMessage is a NATS message read as the CloudEvents NATS binding reads
// it (binary content mode), for the SDK to turn into an event: attrs maps
// each ce- header, lower-cased, to its percent-decoded value.
type ceMessage struct {
	version spec.Version
	attrs   map[string]string
	data    []byte
}

var natsVersions = spec.WithPrefix("ce-")

func newCEMessage(header nats.Header, data []byte) (ceMessage, error) {
	m := ceMessage{attrs: map[string]string{}, data: data}
	for name, values := range header {
		lower := strings.ToLower(name)
		if !strings.HasPrefix(lower, "ce-") {
			continue
		}
		v, err := percentDecode(values[0])
		if err != nil {
			return m, fmt.Errorf("header %s: %w", name, err)
		}
		m.attrs[lower] = v
	}
	m.version = natsVersions.Version(m.attrs[natsVersions.PrefixedSpecVersionName()])
	if m.version == nil {
		return m, binding.ErrUnknownEncoding
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
			err = w.SetExtension(strings.TrimPrefix(name, "ce-"), v)
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
	if v, ok := m.attrs[attr.PrefixedName()]; ok {
		return attr, v
	}
	return attr, nil
}

func (m ceMessage) GetExtension(name string) interface{} {
	if v, ok := m.attrs["ce-"+name]; ok {
		return v
	}
	return nil
}

func (m ceMessage) Finish(error) error { return nil }

// percentDecode undoes the binding's percent-encoding, rejecting invalid
// UTF-8 as the binding requires.
func percentDecode(s string) (string, error) {
	v, err := url.PathUnescape(s)
	if err != nil {
		return "", err
	}
	if !utf8.ValidString(v) {
		return "", fmt.Errorf("%q is not UTF-8", s)
	}
	return v, nil
}

// toEvent decodes a stored message with the CloudEvents SDK and validates
// the event.
func toEvent(t testing.TB, header nats.Header, data []byte) *event.Event {
	t.Helper()
	msg, err := newCEMessage(header, data)
	if err != nil {
		t.Fatalf("not a binary-mode CloudEvent: %v (headers %v)", err, header)
	}
	e, err := binding.ToEvent(context.Background(), msg)
	if err != nil {
		t.Fatalf("CloudEvents SDK cannot read the message: %v (headers %v)", err, header)
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
