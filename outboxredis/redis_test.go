package outboxredis_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	cebinding "github.com/cloudevents/sdk-go/v2/binding"
	cespec "github.com/cloudevents/sdk-go/v2/binding/spec"
	ceevent "github.com/cloudevents/sdk-go/v2/event"
	"github.com/redis/go-redis/v9"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/outboxredis"
)

// redisAddr is the server the tests use: OUTBOX_REDIS_ADDR, or the
// machine's default.
func redisAddr() string {
	if a := os.Getenv("OUTBOX_REDIS_ADDR"); a != "" {
		return a
	}
	return "127.0.0.1:6379"
}

// newRedis returns a client of the test server, skipping the test (failing
// it under CI=true) when the server does not answer.
func newRedis(t testing.TB) *redis.Client {
	t.Helper()
	rdb := redis.NewClient(&redis.Options{Addr: redisAddr(), ContextTimeoutEnabled: true})
	t.Cleanup(func() { rdb.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := rdb.Ping(ctx).Err(); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("Redis at %s does not answer (CI=true, so this fails instead of skipping): %v", redisAddr(), err)
		}
		t.Skipf("skipping: no Redis server at %s (set OUTBOX_REDIS_ADDR): %v", redisAddr(), err)
	}
	return rdb
}

var keySeq atomic.Int64

// uniqueStream names a stream key no other test or session uses, and
// deletes it when t ends.
func uniqueStream(t testing.TB, rdb *redis.Client) string {
	key := fmt.Sprintf("outboxredis-test:%d:%d:%d", os.Getpid(), time.Now().UnixNano()%1e9, keySeq.Add(1))
	t.Cleanup(func() { rdb.Del(context.Background(), key) })
	return key
}

func newPublisher(t testing.TB, rdb redis.UniversalClient, opts ...outboxredis.Option) *outboxredis.Publisher {
	t.Helper()
	p, err := outboxredis.New(rdb, opts...)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return p
}

func toStream(key string) outboxredis.Option {
	return outboxredis.WithStream(func(outbox.Message) string { return key })
}

var at = time.Date(2024, 5, 6, 7, 8, 9, 123456000, time.UTC)

func msg(aggregate string, seq int64) outbox.Message {
	id := fmt.Sprintf("evt-%s-%d", aggregate, seq)
	return outbox.Message{
		EventID: id, EventType: "order.changed", AggregateType: "order", AggregateID: aggregate,
		Sequence: seq, IdempotencyKey: id, Payload: json.RawMessage(fmt.Sprintf(`{"n":%d, "a":"%s"}`, seq, aggregate)),
		OccurredAt: at.Add(time.Duration(seq) * time.Second), Attempt: 1,
	}
}

func publish(t *testing.T, p *outboxredis.Publisher, msgs ...outbox.Message) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return p.Publish(ctx, outbox.Batch{ID: "batch-" + msgs[0].EventID, Messages: msgs})
}

func failures(t *testing.T, err error) map[string]error {
	t.Helper()
	var pe *outbox.PartialError
	if !errors.As(err, &pe) {
		t.Fatalf("Publish = %v, want a *outbox.PartialError", err)
	}
	return pe.Failed
}

func entries(t testing.TB, rdb *redis.Client, stream string) []redis.XMessage {
	t.Helper()
	xs, err := rdb.XRange(context.Background(), stream, "-", "+").Result()
	if err != nil {
		t.Fatalf("XRANGE %s: %v", stream, err)
	}
	return xs
}

func field(x redis.XMessage, name string) string {
	v, _ := x.Values[name].(string)
	return v
}

// entryMessage reads a stream entry as a binary-mode CloudEvent: fields
// named after attributes are attributes or extensions, "data" is the data,
// and "header." fields are not part of the event.
type entryMessage struct{ x redis.XMessage }

var ceVersions = cespec.New()

func (e entryMessage) version() cespec.Version { return ceVersions.Version(field(e.x, "specversion")) }

func (e entryMessage) ReadEncoding() cebinding.Encoding { return cebinding.EncodingBinary }

func (e entryMessage) ReadStructured(context.Context, cebinding.StructuredWriter) error {
	return cebinding.ErrNotStructured
}

func (e entryMessage) ReadBinary(ctx context.Context, w cebinding.BinaryWriter) error {
	version := e.version()
	if version == nil {
		return cebinding.ErrUnknownEncoding
	}
	for name, v := range e.x.Values {
		s, _ := v.(string)
		switch {
		case name == outboxredis.FieldData || strings.HasPrefix(name, outboxredis.HeaderFieldPrefix):
		case version.Attribute(name) != nil:
			if err := w.SetAttribute(version.Attribute(name), s); err != nil {
				return err
			}
		default:
			if err := w.SetExtension(name, s); err != nil {
				return err
			}
		}
	}
	return w.SetData(bytes.NewReader([]byte(field(e.x, outboxredis.FieldData))))
}

func (e entryMessage) GetAttribute(k cespec.Kind) (cespec.Attribute, any) {
	version := e.version()
	if version == nil {
		return nil, nil
	}
	a := version.AttributeFromKind(k)
	if v, ok := e.x.Values[a.Name()]; ok {
		return a, v
	}
	return a, nil
}

func (e entryMessage) GetExtension(name string) any { return e.x.Values[name] }

func (e entryMessage) Finish(error) error { return nil }

// decode turns x into a CloudEvent with the SDK and validates it.
func decode(t testing.TB, x redis.XMessage) *ceevent.Event {
	t.Helper()
	e, err := cebinding.ToEvent(context.Background(), entryMessage{x})
	if err != nil {
		t.Fatalf("entry %s: SDK cannot read it as a CloudEvent: %v", x.ID, err)
	}
	if err := e.Validate(); err != nil {
		t.Fatalf("entry %s: SDK says the event is invalid: %v", x.ID, err)
	}
	return e
}

func TestPublishAppendsCloudEventFields(t *testing.T) {
	t.Parallel()
	rdb := newRedis(t)
	stream := uniqueStream(t, rdb)
	p := newPublisher(t, rdb, toStream(stream), outboxredis.WithSource("/shop/orders"))

	m1 := msg("42", 1)
	m1.Headers = map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "id": "not-the-event-id"}
	m2 := msg("42", 2)
	m2.EventType = "order.paid"
	if err := publish(t, p, m1, m2); err != nil {
		t.Fatalf("Publish: %v", err)
	}
	xs := entries(t, rdb, stream)
	if len(xs) != 2 {
		t.Fatalf("stream holds %d entries, want 2", len(xs))
	}
	for i, want := range []outbox.Message{m1, m2} {
		x := xs[i]
		e := decode(t, x)
		if got := field(x, "data"); got != string(want.Payload) {
			t.Errorf("data = %s, want the payload byte for byte: %s", got, want.Payload)
		}
		checks := []struct{ name, got, want string }{
			{"id", e.ID(), want.EventID},
			{"type", e.Type(), want.EventType},
			{"source", e.Source(), "/shop/orders"},
			{"specversion", e.SpecVersion(), "1.0"},
			{"time", e.Time().UTC().Format(time.RFC3339Nano), want.OccurredAt.Format(time.RFC3339Nano)},
			{"subject", e.Subject(), "order/42"},
			{"datacontenttype", e.DataContentType(), "application/json"},
			{"data", string(e.Data()), string(want.Payload)},
		}
		for _, c := range checks {
			if c.got != c.want {
				t.Errorf("entry %d: %s = %q, want %q", i, c.name, c.got, c.want)
			}
		}
		ext := e.Extensions()
		for name, v := range map[string]string{"partitionkey": "order/42", "aggregatetype": "order", "aggregateid": "42", "aggregatesequence": fmt.Sprint(want.Sequence)} {
			if got := fmt.Sprint(ext[name]); got != v {
				t.Errorf("entry %d: extension %s = %q, want %q", i, name, got, v)
			}
		}
		if _, ok := x.Values["sequence"]; ok {
			t.Errorf("entry %d has a sequence field; the aggregate's sequence is aggregatesequence", i)
		}
		for k, v := range want.Headers {
			if got := field(x, "header."+k); got != v {
				t.Errorf("entry %d: header.%s = %q, want %q unchanged", i, k, got, v)
			}
		}
		if want := 11 + 1 + len(want.Headers); len(x.Values) != want {
			t.Errorf("entry %d has %d fields, want %d (11 attributes, data, headers): %v", i, len(x.Values), want, x.Values)
		}
	}
}

func TestAggregateOrderHoldsWithinEachStream(t *testing.T) {
	t.Parallel()
	rdb := newRedis(t)
	streams := []string{uniqueStream(t, rdb), uniqueStream(t, rdb), uniqueStream(t, rdb)}
	p := newPublisher(t, rdb, outboxredis.WithStream(func(m outbox.Message) string {
		return streams[len(m.AggregateID)%len(streams)]
	}))
	const perAggregate = 5
	aggregates := []string{"a", "bb", "ccc", "d", "ee", "fff", "g"}
	var msgs []outbox.Message
	for seq := int64(1); seq <= perAggregate; seq++ {
		for _, a := range aggregates {
			msgs = append(msgs, msg(a, seq))
		}
	}
	if err := publish(t, p, msgs...); err != nil {
		t.Fatalf("Publish: %v", err)
	}
	total := 0
	for _, s := range streams {
		last := map[string]string{}
		for _, x := range entries(t, rdb, s) {
			total++
			id := field(x, "aggregateid")
			if want := fmt.Sprint(len(last[id]) + 1); field(x, "aggregatesequence") != want {
				t.Errorf("stream %s, aggregate %s: sequence %s, want %s", s, id, field(x, "aggregatesequence"), want)
			}
			last[id] += "x"
		}
	}
	if total != len(msgs) {
		t.Errorf("streams hold %d entries, want %d", total, len(msgs))
	}
}

func TestSameBatchTwiceLeavesOneCopyWhereTheServerHasIDMP(t *testing.T) {
	t.Parallel()
	rdb := newRedis(t)
	stream := uniqueStream(t, rdb)
	p := newPublisher(t, rdb, toStream(stream))
	b := []outbox.Message{msg("7", 1), msg("7", 2)}
	for range 2 {
		if err := publish(t, p, b...); err != nil {
			t.Fatalf("Publish: %v", err)
		}
	}
	idmp, err := p.Idempotent(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	ids := map[string]int{}
	for _, x := range entries(t, rdb, stream) {
		ids[field(x, "id")]++
	}
	want := 2 // without IDMP, consumers deduplicate on the id field
	if idmp {
		want = 1
	}
	if len(ids) != 2 || ids["evt-7-1"] != want || ids["evt-7-2"] != want {
		t.Errorf("IDMP %v: stream holds ids %v, want each of the two %d time(s)", idmp, ids, want)
	}
}

func TestIDMPIsDetectedFromTheServerVersion(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		version string
		want    bool
	}{
		{"7.0.15", false}, {"8.4.2", false}, {"8.6.0", true}, {"8.10.1", true}, {"9.0.0", true}, {"", false},
	} {
		info := "# Server\r\nredis_version:" + tc.version + "\r\nredis_mode:standalone\r\n"
		if got := outboxredis.SupportsIDMP(info); got != tc.want {
			t.Errorf("redis_version %q: IDMP %v, want %v", tc.version, got, tc.want)
		}
	}
}

func TestOversizedMessageIsPermanentAndHoldsBackItsAggregate(t *testing.T) {
	t.Parallel()
	rdb := newRedis(t)
	stream := uniqueStream(t, rdb)
	p := newPublisher(t, rdb, toStream(stream))
	p.LimitArgumentBytes(1 << 10)

	big := msg("1", 2)
	big.Payload = json.RawMessage(`"` + strings.Repeat("x", 2<<10) + `"`)
	failed := failures(t, publish(t, p, msg("1", 1), big, msg("1", 3), msg("2", 1)))
	if e := failed[big.EventID]; !outbox.IsPermanent(e) || !errors.Is(e, outboxredis.ErrTooLarge) {
		t.Errorf("oversized message: %v, want permanent ErrTooLarge", e)
	}
	if e := failed["evt-1-3"]; !errors.Is(e, outbox.ErrNotAttempted) {
		t.Errorf("message after it in its aggregate: %v, want ErrNotAttempted", e)
	}
	if len(failed) != 2 {
		t.Errorf("failed = %v, want only those two", failed)
	}
	var got []string
	for _, x := range entries(t, rdb, stream) {
		got = append(got, field(x, "id"))
	}
	if fmt.Sprint(got) != "[evt-1-1 evt-2-1]" {
		t.Errorf("stream holds %v, want [evt-1-1 evt-2-1]", got)
	}
}

func TestKeyOfAnotherTypeIsPermanent(t *testing.T) {
	t.Parallel()
	rdb := newRedis(t)
	stream := uniqueStream(t, rdb)
	if err := rdb.Set(context.Background(), stream, "a string", 0).Err(); err != nil {
		t.Fatal(err)
	}
	p := newPublisher(t, rdb, toStream(stream))
	failed := failures(t, publish(t, p, msg("1", 1), msg("1", 2)))
	if e := failed["evt-1-1"]; !outbox.IsPermanent(e) || !redis.HasErrorPrefix(e, "WRONGTYPE") {
		t.Errorf("evt-1-1: %v, want permanent WRONGTYPE", e)
	}
	if e := failed["evt-1-2"]; !errors.Is(e, outbox.ErrNotAttempted) {
		t.Errorf("evt-1-2: %v, want ErrNotAttempted", e)
	}
}

func TestEmptyStreamKeyIsPermanent(t *testing.T) {
	t.Parallel()
	p := newPublisher(t, newRedis(t), toStream(""))
	if e := failures(t, publish(t, p, msg("1", 1)))["evt-1-1"]; !outbox.IsPermanent(e) {
		t.Errorf("empty stream key: %v, want a permanent failure", e)
	}
}

func TestUnreachableServerFailsRetryablyByTheDeadline(t *testing.T) {
	t.Parallel()
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", ContextTimeoutEnabled: true})
	defer rdb.Close()
	p := newPublisher(t, rdb)
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	start := time.Now()
	err := p.Publish(ctx, outbox.Batch{ID: "b", Messages: []outbox.Message{msg("1", 1)}})
	if d := time.Since(start); d > 1500*time.Millisecond {
		t.Errorf("Publish took %v, past the 500ms deadline", d)
	}
	if err == nil || outbox.IsPermanent(err) {
		t.Errorf("Publish = %v, want a retryable error", err)
	}
}

// stallingProxy forwards TCP connections to the Redis server and, once
// stalled, holds back the server's replies until the test ends.
type stallingProxy struct {
	ln      net.Listener
	stalled atomic.Bool
	release chan struct{}
	wg      sync.WaitGroup
}

func newStallingProxy(t *testing.T) *stallingProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &stallingProxy{ln: ln, release: make(chan struct{})}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", redisAddr())
			if err != nil {
				c.Close()
				continue
			}
			p.wg.Add(2)
			go func() { defer p.wg.Done(); io.Copy(s, c); s.Close() }()
			go func() { defer p.wg.Done(); p.replies(c, s); c.Close() }()
		}
	}()
	t.Cleanup(func() {
		close(p.release)
		ln.Close()
		p.wg.Wait()
	})
	return p
}

// replies copies the server's replies to the client, waiting for release
// while the proxy is stalled.
func (p *stallingProxy) replies(c, s net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := s.Read(buf)
		if p.stalled.Load() {
			<-p.release
		}
		if n > 0 {
			if _, werr := c.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

func TestContextExpiringMidBatchFailsMessagesWithoutReply(t *testing.T) {
	t.Parallel()
	rdb := newRedis(t)
	for _, contextTimeout := range []bool{true, false} {
		t.Run(fmt.Sprintf("ContextTimeoutEnabled=%v", contextTimeout), func(t *testing.T) {
			t.Parallel()
			stream := uniqueStream(t, rdb)
			proxy := newStallingProxy(t)
			via := redis.NewClient(&redis.Options{Addr: proxy.ln.Addr().String(), ContextTimeoutEnabled: contextTimeout, MaxRetries: -1})
			defer via.Close()
			p := newPublisher(t, via, toStream(stream))
			if err := publish(t, p, msg("0", 1)); err != nil { // the publisher has asked the server
				t.Fatalf("warm-up Publish: %v", err)
			}
			proxy.stalled.Store(true)
			ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
			defer cancel()
			start := time.Now()
			err := p.Publish(ctx, outbox.Batch{ID: "b", Messages: []outbox.Message{msg("1", 1), msg("1", 2), msg("2", 1)}})
			if d := time.Since(start); d > time.Second {
				t.Errorf("Publish took %v, past the 300ms deadline", d)
			}
			failed := failures(t, err)
			for _, id := range []string{"evt-1-1", "evt-2-1"} {
				if e := failed[id]; !errors.Is(e, context.DeadlineExceeded) || outbox.IsPermanent(e) {
					t.Errorf("%s: %v, want retryable context.DeadlineExceeded", id, e)
				}
			}
			if e := failed["evt-1-2"]; !errors.Is(e, outbox.ErrNotAttempted) {
				t.Errorf("evt-1-2: %v, want ErrNotAttempted", e)
			}
			// The server did add what it received: the documented duplicate
			// that the retry of these messages makes.
			if n := len(entries(t, rdb, stream)); n != 4 {
				t.Errorf("stream holds %d entries, want 4: the server ran the commands whose replies were lost", n)
			}
		})
	}
}

func TestContextExpiringBeforeTheServerFirstAnswersFailsTheBatch(t *testing.T) {
	t.Parallel()
	newRedis(t)
	proxy := newStallingProxy(t)
	proxy.stalled.Store(true)
	via := redis.NewClient(&redis.Options{Addr: proxy.ln.Addr().String(), MaxRetries: -1})
	defer via.Close()
	p := newPublisher(t, via)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	err := p.Publish(ctx, outbox.Batch{ID: "b", Messages: []outbox.Message{msg("1", 1)}})
	if d := time.Since(start); d > time.Second {
		t.Errorf("Publish took %v, past the 300ms deadline", d)
	}
	var pe *outbox.PartialError
	if !errors.Is(err, context.DeadlineExceeded) || outbox.IsPermanent(err) || errors.As(err, &pe) {
		t.Errorf("Publish = %v, want a retryable context.DeadlineExceeded for the whole batch", err)
	}
}

func TestMaxLenCapsTheStream(t *testing.T) {
	t.Parallel()
	rdb := newRedis(t)
	stream := uniqueStream(t, rdb)
	p := newPublisher(t, rdb, toStream(stream), outboxredis.WithMaxLen(10))
	var msgs []outbox.Message
	for i := range 500 {
		msgs = append(msgs, msg(fmt.Sprint(i), 1))
	}
	if err := publish(t, p, msgs...); err != nil {
		t.Fatalf("Publish: %v", err)
	}
	n, err := rdb.XLen(context.Background(), stream).Result()
	if err != nil {
		t.Fatal(err)
	}
	if n < 10 || n >= 500 {
		t.Errorf("XLEN = %d after 500 adds with WithMaxLen(10), want at least 10 and far fewer than 500", n)
	}
}

func TestNewRejectsInvalidOptions(t *testing.T) {
	t.Parallel()
	rdb := redis.NewClient(&redis.Options{Addr: redisAddr()})
	defer rdb.Close()
	for _, tc := range []struct {
		name   string
		rdb    redis.UniversalClient
		opts   []outboxredis.Option
		option string
	}{
		{"nil client", nil, nil, "nil redis.UniversalClient"},
		{"nil stream function", rdb, []outboxredis.Option{outboxredis.WithStream(nil)}, "WithStream"},
		{"empty source", rdb, []outboxredis.Option{outboxredis.WithSource("")}, "WithSource"},
		{"source not a URI", rdb, []outboxredis.Option{outboxredis.WithSource("%zz")}, "WithSource"},
		{"zero max length", rdb, []outboxredis.Option{outboxredis.WithMaxLen(0)}, "WithMaxLen"},
		{"negative max length", rdb, []outboxredis.Option{outboxredis.WithMaxLen(-5)}, "WithMaxLen"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := outboxredis.New(tc.rdb, tc.opts...)
			if !errors.Is(err, outbox.ErrInvalidOption) || !strings.Contains(err.Error(), tc.option) {
				t.Errorf("New: %v, want ErrInvalidOption naming %s", err, tc.option)
			}
		})
	}
}
