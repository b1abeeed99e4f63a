package outboxnats_test

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/cloudevents/sdk-go/v2/event"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest/brokertest"
	"github.com/gorm-outbox/outbox/outboxnats"
)

// natsServer is the NATS server, with JetStream, that the tests use.
var natsServer = brokertest.Server{Name: "NATS", Env: "OUTBOX_NATS_URL", Default: "nats://127.0.0.1:4222"}

func natsURL() string { return natsServer.Addr() }

// connect returns a JetStream context on the test server; it skips the
// test when the server does not answer, or fails it under CI=true.
func connect(t testing.TB) jetstream.JetStream {
	t.Helper()
	nc, err := nats.Connect(natsURL(), nats.Timeout(2*time.Second))
	if err != nil {
		natsServer.Unreachable(t, err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatalf("jetstream.New: %v", err)
	}
	return js
}

func newPublisher(t testing.TB, js jetstream.JetStream, opts ...outboxnats.Option) *outboxnats.Publisher {
	t.Helper()
	p, err := outboxnats.New(js, opts...)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return p
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

// events returns every message of the stream as a CloudEvent, in stream
// order.
func (s testStream) events(t testing.TB) []*event.Event {
	t.Helper()
	var out []*event.Event
	for _, raw := range s.stored(t) {
		out = append(out, toEvent(t, raw.Header, raw.Data))
	}
	return out
}

// toEvent reads a NATS message as the CloudEvents NATS binding does in
// binary content mode (each ce- header, case-insensitive, is an attribute
// or extension with its value percent-decoded; the body is the data) and
// decodes it with the SDK.
func toEvent(t testing.TB, header nats.Header, data []byte) *event.Event {
	t.Helper()
	attrs := map[string]string{}
	for name, values := range header {
		attr, ok := strings.CutPrefix(strings.ToLower(name), "ce-")
		if !ok {
			continue
		}
		v, err := percentDecode(values[0])
		if err != nil {
			t.Fatalf("header %s: %v", name, err)
		}
		attrs[attr] = v
	}
	return brokertest.Event(t, brokertest.Binary{Attributes: attrs, Data: data})
}

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
