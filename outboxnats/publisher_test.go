package outboxnats_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cloudevents/sdk-go/v2/event"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest/brokertest"
	"github.com/gorm-outbox/outbox/outboxnats"
)

func TestNewRejectsInvalidOptions(t *testing.T) {
	t.Parallel()
	nc := &nats.Conn{} // never used: New does not contact the server
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	brokertest.CheckNewRejects(t, outboxnats.New, []brokertest.Rejected[jetstream.JetStream, outboxnats.Option]{
		{Name: "nil JetStream", Naming: "js"},
		{Name: "nil subject function", Client: js, Options: []outboxnats.Option{outboxnats.WithSubject(nil)}, Naming: "WithSubject"},
		{Name: "empty source", Client: js, Options: []outboxnats.Option{outboxnats.WithSource("")}, Naming: "WithSource"},
		{Name: "source with a control character", Client: js, Options: []outboxnats.Option{outboxnats.WithSource("shop\x00")}, Naming: "WithSource"},
		{Name: "source not a URI", Client: js, Options: []outboxnats.Option{outboxnats.WithSource("%zz")}, Naming: "WithSource"},
		{Name: "source with a space", Client: js, Options: []outboxnats.Option{outboxnats.WithSource("my app")}, Naming: "WithSource"},
	})
}

func TestEveryMessageArrivesAsTheCloudEventItWas(t *testing.T) {
	t.Parallel()
	js := connect(t)
	s := newStream(t, js, jetstream.StreamConfig{})
	p := newPublisher(t, js, outboxnats.WithSubject(s.subject), outboxnats.WithSource("/shop/orders"))

	m1 := brokertest.Message("order/42", 1)
	m1.EventType = "order placed ünïcode \"100%\"" // must be percent-encoded
	m1.Headers = map[string]string{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
	msgs := []outbox.Message{m1, brokertest.Message("order/42", 2)}
	if err := brokertest.Publish(t, p, msgs...); err != nil {
		t.Fatalf("Publish: %v", err)
	}

	got := s.stored(t)
	if len(got) != 2 {
		t.Fatalf("stream holds %d messages, want 2", len(got))
	}
	for i, raw := range got {
		m := msgs[i]
		if string(raw.Data) != string(m.Payload) {
			t.Errorf("body = %s, want the payload %s byte for byte", raw.Data, m.Payload)
		}
		if id := raw.Header.Get("Nats-Msg-Id"); id != m.EventID {
			t.Errorf("Nats-Msg-Id = %q, want %q", id, m.EventID)
		}
		if raw.Subject != s.prefix+".order" {
			t.Errorf("subject = %q", raw.Subject)
		}
		brokertest.CheckEvent(t, toEvent(t, raw.Header, raw.Data), m, "/shop/orders")
	}
	if tp := got[0].Header.Get("traceparent"); tp != m1.Headers["traceparent"] {
		t.Errorf("traceparent = %q, want the event's header unchanged", tp)
	}
	if raw := got[0].Header.Get("ce-type"); !strings.Contains(raw, "%20") || strings.ContainsAny(raw, " \"") {
		t.Errorf("ce-type = %q, want it percent-encoded", raw)
	}
}

func TestAggregateOrderHoldsOnTheConsumerSide(t *testing.T) {
	t.Parallel()
	js := connect(t)
	s := newStream(t, js, jetstream.StreamConfig{})
	p := newPublisher(t, js, outboxnats.WithSubject(s.subject))

	msgs := brokertest.Interleaved(50, "order/1", "order/2", "cart/9")
	if err := brokertest.Publish(t, p, msgs...); err != nil {
		t.Fatalf("Publish: %v", err)
	}
	brokertest.CheckInOrder(t, s.events(t), msgs)
}

func TestDuplicateBatchLeavesOneCopy(t *testing.T) {
	t.Parallel()
	js := connect(t)
	s := newStream(t, js, jetstream.StreamConfig{Duplicates: time.Minute})
	p := newPublisher(t, js, outboxnats.WithSubject(s.subject))
	brokertest.CheckDuplicateBatch(t, p, 1, func() []*event.Event { return s.events(t) })
}

func TestOversizedMessageFailsPermanentlyAndHoldsBackItsAggregate(t *testing.T) {
	t.Parallel()
	js := connect(t)
	// The connection's max_payload is checked before sending, the stream's
	// max_msg_size by the server after the later messages were sent.
	maxPayload := int(js.Conn().MaxPayload())
	cases := []struct {
		name      string
		limit     int32
		size      int
		laterSent bool
	}{
		{"over the stream's max_msg_size", 1024, 2048, true},
		{"over the connection's max_payload", 0, maxPayload + 1, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			s := newStream(t, js, jetstream.StreamConfig{MaxMsgSize: c.limit})
			p := newPublisher(t, js, outboxnats.WithSubject(s.subject))
			failed := brokertest.CheckOversizedMessageFails(t, p, []byte(`"`+strings.Repeat("x", c.size)+`"`), nil)
			if len(failed) != 2 {
				t.Fatalf("failed = %v, want the big message and the one after it", failed)
			}
			stored := len(s.stored(t))
			want := 2
			if c.laterSent {
				want = 3
			}
			if stored != want {
				t.Errorf("stream holds %d messages, want %d", stored, want)
			}
		})
	}
}

func TestInvalidSubjectFailsThatMessagePermanently(t *testing.T) {
	t.Parallel()
	js := connect(t)
	// <stream> stands for the subject prefix of the subtest's stream.
	for _, subject := range []string{"", "a b", "a..b", "<stream>.*", "<stream>.>", "trailing."} {
		t.Run(strconv.Quote(subject), func(t *testing.T) {
			t.Parallel()
			s := newStream(t, js, jetstream.StreamConfig{})
			bad := strings.ReplaceAll(subject, "<stream>", s.prefix)
			p := newPublisher(t, js, outboxnats.WithSubject(func(m outbox.Message) string {
				if m.AggregateID == "bad" {
					return bad
				}
				return s.subject(m)
			}))
			msgs := []outbox.Message{brokertest.Message("order/bad", 1), brokertest.Message("order/good", 1)}
			failed := brokertest.Failures(t, brokertest.Publish(t, p, msgs...))
			if len(failed) != 1 || !outbox.IsPermanent(failed[msgs[0].EventID]) {
				t.Fatalf("Publish failed %v, want only the message with subject %q failed permanently", failed, bad)
			}
			if got := len(s.stored(t)); got != 1 {
				t.Fatalf("stream holds %d messages, want the good one", got)
			}
		})
	}
}

func TestUnreachableServerIsRetryable(t *testing.T) {
	t.Parallel()
	closed, err := nats.Connect(natsURL(), nats.Timeout(2*time.Second))
	if err != nil {
		natsServer.Unreachable(t, err)
	}
	closed.Close()
	// A connection that keeps trying a port nobody listens on.
	down, err := nats.Connect("nats://127.0.0.1:1", nats.RetryOnFailedConnect(true), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatalf("connect with RetryOnFailedConnect: %v", err)
	}
	t.Cleanup(down.Close)

	for name, nc := range map[string]*nats.Conn{"closed connection": closed, "server never reached": down} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			js, err := jetstream.New(nc)
			if err != nil {
				t.Fatal(err)
			}
			brokertest.CheckUnansweredBatchFailsByTheDeadline(t, newPublisher(t, js), 300*time.Millisecond, time.Second, nil)
		})
	}
}

func TestContextExpiringMidBatchStopsThePublish(t *testing.T) {
	t.Parallel()
	js := connect(t)
	s := newStream(t, js, jetstream.StreamConfig{Duplicates: time.Minute})
	p := newPublisher(t, js, outboxnats.WithSubject(s.subject))
	msgs := brokertest.CheckDeadlineCutsTheBatch(t, p)

	// The retry completes the stream with one copy of each.
	if err := brokertest.Publish(t, p, msgs...); err != nil {
		t.Fatalf("second Publish: %v", err)
	}
	if got := len(s.stored(t)); got != len(msgs) {
		t.Fatalf("stream holds %d messages, want %d", got, len(msgs))
	}
}

// startRestrictedServer starts a NATS server of the test's own, with
// JetStream and one user that may not publish to secret.>, and stops it
// when t ends. It returns the server's URL.
func startRestrictedServer(t *testing.T) string {
	t.Helper()
	bin, err := exec.LookPath("nats-server")
	if err != nil {
		if bin, err = exec.LookPath("/usr/sbin/nats-server"); err != nil {
			connect(t) // skips or fails, naming the address variable, when there is no NATS here at all
			t.Skip("skipping: no nats-server binary to start a server with permissions")
		}
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	dir := t.TempDir()
	conf := filepath.Join(dir, "server.conf")
	if err := os.WriteFile(conf, []byte(fmt.Sprintf(`listen: 127.0.0.1:%d
jetstream { store_dir: %q }
authorization { users = [
  { user: app, password: secret, permissions: { publish: { allow: [">"], deny: ["secret.>"] } } }
] }
`, port, filepath.Join(dir, "js"))), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "-c", conf)
	if err := cmd.Start(); err != nil {
		t.Fatalf("start nats-server: %v", err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	url := fmt.Sprintf("nats://app:secret@127.0.0.1:%d", port)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		nc, err := nats.Connect(url)
		if err == nil {
			nc.Close()
			return url
		}
		if time.Now().After(deadline) {
			t.Fatalf("nats-server on port %d did not start: %v", port, err)
		}
	}
}

func TestRefusedPublishFailsPermanently(t *testing.T) {
	t.Parallel()
	nc, err := nats.Connect(startRestrictedServer(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "ALL", Subjects: []string{"ok.>", "secret.>"}}); err != nil {
		t.Fatal(err)
	}
	p := newPublisher(t, js, outboxnats.WithSubject(func(m outbox.Message) string { return m.AggregateType + "." + m.AggregateID }))
	refused, allowed := brokertest.Message("secret/1", 1), brokertest.Message("ok/1", 1)
	pctx, pcancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer pcancel()
	err = p.Publish(pctx, outbox.Batch{ID: "b", Messages: []outbox.Message{refused, allowed}})
	var pe *outbox.PartialError
	if !errors.As(err, &pe) || len(pe.Failed) != 1 {
		t.Fatalf("Publish = %v, want only the refused message failed", err)
	}
	if e := pe.Failed[refused.EventID]; !outbox.IsPermanent(e) || !errors.Is(e, nats.ErrPermissionViolation) {
		t.Fatalf("refused message: %v, want a permanent permissions violation", e)
	}
}
