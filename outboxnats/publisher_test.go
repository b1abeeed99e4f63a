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

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/outboxnats"
)

func newPublisher(t testing.TB, js jetstream.JetStream, opts ...outboxnats.Option) *outboxnats.Publisher {
	t.Helper()
	p, err := outboxnats.New(js, opts...)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return p
}

func TestNewRejectsInvalidOptions(t *testing.T) {
	t.Parallel()
	nc := &nats.Conn{} // never used: New does not contact the server
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name string
		js   jetstream.JetStream
		opts []outboxnats.Option
		want string
	}{
		{"nil JetStream", nil, nil, "js"},
		{"nil subject function", js, []outboxnats.Option{outboxnats.WithSubject(nil)}, "WithSubject"},
		{"empty source", js, []outboxnats.Option{outboxnats.WithSource("")}, "WithSource"},
		{"source with a space", js, []outboxnats.Option{outboxnats.WithSource("my app")}, "WithSource"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := outboxnats.New(c.js, c.opts...)
			if !errors.Is(err, outbox.ErrInvalidOption) || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("New = %v, want ErrInvalidOption naming %s", err, c.want)
			}
		})
	}
}

func TestEveryMessageArrivesAsTheCloudEventItWas(t *testing.T) {
	t.Parallel()
	js := connect(t)
	s := newStream(t, js, jetstream.StreamConfig{})
	p := newPublisher(t, js, outboxnats.WithSubject(s.subject), outboxnats.WithSource("/shop/orders"))

	m1 := message("order/42", 1)
	m1.EventType = "order placed ünïcode \"100%\"" // must be percent-encoded
	m1.Headers = map[string]string{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
	m2 := message("order/42", 2)
	b := outbox.Batch{ID: "b1", Messages: []outbox.Message{m1, m2}}
	if err := p.Publish(context.Background(), b); err != nil {
		t.Fatalf("Publish: %v", err)
	}

	got := s.stored(t)
	if len(got) != 2 {
		t.Fatalf("stream holds %d messages, want 2", len(got))
	}
	for i, raw := range got {
		m := b.Messages[i]
		if string(raw.Data) != string(m.Payload) {
			t.Errorf("body = %s, want the payload %s byte for byte", raw.Data, m.Payload)
		}
		if id := raw.Header.Get("Nats-Msg-Id"); id != m.EventID {
			t.Errorf("Nats-Msg-Id = %q, want %q", id, m.EventID)
		}
		if raw.Subject != s.prefix+".order" {
			t.Errorf("subject = %q", raw.Subject)
		}
		e := toEvent(t, raw.Header, raw.Data)
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
		if _, ok := e.Extensions()["sequence"]; ok {
			t.Errorf("message %d carries the CloudEvents sequence extension", i+1)
		}
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

	var b outbox.Batch
	for seq := int64(1); seq <= 50; seq++ {
		for _, agg := range []string{"order/1", "order/2", "cart/9"} {
			b.Messages = append(b.Messages, message(agg, seq))
		}
	}
	if err := p.Publish(context.Background(), b); err != nil {
		t.Fatalf("Publish: %v", err)
	}
	last := map[string]int64{}
	got := s.stored(t)
	for _, raw := range got {
		e := toEvent(t, raw.Header, raw.Data)
		seq, _ := strconv.ParseInt(aggregateSequence(t, e), 10, 64)
		if seq != last[e.Subject()]+1 {
			t.Fatalf("%s: sequence %d after %d", e.Subject(), seq, last[e.Subject()])
		}
		last[e.Subject()] = seq
	}
	if len(got) != len(b.Messages) {
		t.Fatalf("stream holds %d messages, want %d", len(got), len(b.Messages))
	}
}

func TestDuplicateBatchLeavesOneCopy(t *testing.T) {
	t.Parallel()
	js := connect(t)
	s := newStream(t, js, jetstream.StreamConfig{Duplicates: time.Minute})
	p := newPublisher(t, js, outboxnats.WithSubject(s.subject))
	b := outbox.Batch{ID: "b", Messages: []outbox.Message{message("order/1", 1), message("order/1", 2), message("order/2", 1)}}

	for round := 1; round <= 2; round++ {
		if err := p.Publish(context.Background(), b); err != nil {
			t.Fatalf("Publish round %d: %v (a duplicate PubAck must count as accepted)", round, err)
		}
	}
	if got := s.stored(t); len(got) != len(b.Messages) {
		t.Fatalf("stream holds %d messages after publishing the batch twice, want %d", len(got), len(b.Messages))
	}
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
			big := message("order/1", 2)
			big.Payload = []byte(`"` + strings.Repeat("x", c.size) + `"`)
			b := outbox.Batch{ID: "b", Messages: []outbox.Message{
				message("order/1", 1), big, message("order/1", 3), message("order/2", 1),
			}}

			err := p.Publish(context.Background(), b)
			var pe *outbox.PartialError
			if !errors.As(err, &pe) {
				t.Fatalf("Publish = %v, want a PartialError", err)
			}
			if len(pe.Failed) != 2 {
				t.Fatalf("failed = %v, want the big message and the one after it", pe.Failed)
			}
			if e := pe.Failed[big.EventID]; !outbox.IsPermanent(e) {
				t.Errorf("big message: %v, want a permanent failure", e)
			}
			if e := pe.Failed[b.Messages[2].EventID]; !errors.Is(e, outbox.ErrNotAttempted) {
				t.Errorf("the next message of its aggregate: %v, want ErrNotAttempted", e)
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
	s := newStream(t, js, jetstream.StreamConfig{})
	for _, bad := range []string{"", "a b", "a..b", s.prefix + ".*", s.prefix + ".>", "trailing."} {
		t.Run(strconv.Quote(bad), func(t *testing.T) {
			p := newPublisher(t, js, outboxnats.WithSubject(func(m outbox.Message) string {
				if m.AggregateID == "bad" {
					return bad
				}
				return s.subject(m)
			}))
			b := outbox.Batch{ID: "b", Messages: []outbox.Message{message("order/bad", 1), message("order/good", 1)}}
			err := p.Publish(context.Background(), b)
			var pe *outbox.PartialError
			if !errors.As(err, &pe) || len(pe.Failed) != 1 || !outbox.IsPermanent(pe.Failed[b.Messages[0].EventID]) {
				t.Fatalf("Publish = %v, want only the message with subject %q failed permanently", err, bad)
			}
		})
	}
}

func TestUnreachableServerIsRetryable(t *testing.T) {
	t.Parallel()
	closed, err := nats.Connect(natsURL(), nats.Timeout(2*time.Second))
	if err != nil {
		connect(t) // skips or fails with the address variable named
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
			p := newPublisher(t, js)
			b := outbox.Batch{ID: "b", Messages: []outbox.Message{message("order/1", 1), message("order/2", 1)}}
			ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
			defer cancel()
			start := time.Now()
			err = p.Publish(ctx, b)
			if elapsed := time.Since(start); elapsed > time.Second {
				t.Errorf("Publish took %v, past its context's deadline", elapsed)
			}
			var pe *outbox.PartialError
			if !errors.As(err, &pe) || len(pe.Failed) != 2 {
				t.Fatalf("Publish = %v, want both messages failed", err)
			}
			for id, e := range pe.Failed {
				if outbox.IsPermanent(e) || errors.Is(e, outbox.ErrNotAttempted) {
					t.Errorf("%s: %v, want a retryable failure", id, e)
				}
			}
		})
	}
}

func TestContextExpiringMidBatchStopsThePublish(t *testing.T) {
	t.Parallel()
	js := connect(t)
	s := newStream(t, js, jetstream.StreamConfig{Duplicates: time.Minute})
	p := newPublisher(t, js, outboxnats.WithSubject(s.subject))
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
	// Per aggregate: an accepted prefix, then only failures; none of them
	// permanent.
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
		t.Fatal("every message accepted within 3ms: the deadline did not cut the batch")
	}

	// The retry completes the stream with one copy of each.
	if err := p.Publish(context.Background(), b); err != nil {
		t.Fatalf("second Publish: %v", err)
	}
	if got := len(s.stored(t)); got != len(b.Messages) {
		t.Fatalf("stream holds %d messages, want %d", got, len(b.Messages))
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
	refused, allowed := message("secret/1", 1), message("ok/1", 1)
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
