package outboxredis_test

import (
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

	"github.com/cloudevents/sdk-go/v2/event"
	"github.com/redis/go-redis/v9"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest/brokertest"
	"github.com/gorm-outbox/outbox/outboxredis"
)

// redisServer is the Redis server the tests use.
var redisServer = brokertest.Server{Name: "Redis", Env: "OUTBOX_REDIS_ADDR", Default: "127.0.0.1:6379"}

func redisAddr() string { return redisServer.Addr() }

// newRedis returns a client of the test server, skipping the test (failing
// it under CI=true) when the server does not answer.
func newRedis(t testing.TB) *redis.Client {
	t.Helper()
	rdb := redis.NewClient(&redis.Options{Addr: redisAddr(), ContextTimeoutEnabled: true})
	t.Cleanup(func() { rdb.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := rdb.Ping(ctx).Err(); err != nil {
		redisServer.Unreachable(t, err)
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

// decode reads x as a binary-mode CloudEvent (fields named after
// attributes are attributes or extensions, "data" is the data, and
// "header." fields are not part of the event) and decodes it with the SDK.
func decode(t testing.TB, x redis.XMessage) *event.Event {
	t.Helper()
	attrs := map[string]string{}
	for name := range x.Values {
		if name != outboxredis.FieldData && !strings.HasPrefix(name, outboxredis.HeaderFieldPrefix) {
			attrs[name] = field(x, name)
		}
	}
	return brokertest.Event(t, brokertest.Binary{Attributes: attrs, Data: []byte(field(x, outboxredis.FieldData))})
}

// events returns every entry of stream as a CloudEvent, in stream order.
func events(t testing.TB, rdb *redis.Client, stream string) []*event.Event {
	t.Helper()
	var out []*event.Event
	for _, x := range entries(t, rdb, stream) {
		out = append(out, decode(t, x))
	}
	return out
}

func TestPublishAppendsCloudEventFields(t *testing.T) {
	t.Parallel()
	rdb := newRedis(t)
	stream := uniqueStream(t, rdb)
	p := newPublisher(t, rdb, toStream(stream), outboxredis.WithSource("/shop/orders"))

	m1 := brokertest.Message("order/42", 1)
	m1.Headers = map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "id": "not-the-event-id"}
	m2 := brokertest.Message("order/42", 2)
	m2.EventType = "order.paid"
	if err := brokertest.Publish(t, p, m1, m2); err != nil {
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
		brokertest.CheckEvent(t, e, want, "/shop/orders")
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
	route := func(m outbox.Message) string { return streams[len(m.AggregateID)%len(streams)] }
	p := newPublisher(t, rdb, outboxredis.WithStream(route))
	msgs := brokertest.Interleaved(5, "order/a", "order/bb", "order/ccc", "order/d", "order/ee", "order/fff", "order/g")
	if err := brokertest.Publish(t, p, msgs...); err != nil {
		t.Fatalf("Publish: %v", err)
	}
	routed := map[string][]outbox.Message{}
	for _, m := range msgs {
		routed[route(m)] = append(routed[route(m)], m)
	}
	for _, s := range streams {
		brokertest.CheckInOrder(t, events(t, rdb, s), routed[s])
	}
}

func TestSameBatchTwiceLeavesOneCopyWhereTheServerHasIDMP(t *testing.T) {
	t.Parallel()
	rdb := newRedis(t)
	stream := uniqueStream(t, rdb)
	p := newPublisher(t, rdb, toStream(stream))
	idmp, err := p.Idempotent(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	copies := 2 // without IDMP, consumers deduplicate on the id field
	if idmp {
		copies = 1
	}
	t.Logf("IDMP %v", idmp)
	brokertest.CheckDuplicateBatch(t, p, copies, func() []*event.Event { return events(t, rdb, stream) })
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

	failed := brokertest.CheckOversizedMessageFails(t, p, json.RawMessage(`"`+strings.Repeat("x", 2<<10)+`"`), outboxredis.ErrTooLarge)
	if len(failed) != 2 {
		t.Errorf("failed = %v, want only those two", failed)
	}
	var got []string
	for _, x := range entries(t, rdb, stream) {
		got = append(got, field(x, "id"))
	}
	if fmt.Sprint(got) != "[evt-order-1-1 evt-order-2-1]" {
		t.Errorf("stream holds %v, want [evt-order-1-1 evt-order-2-1]", got)
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
	failed := brokertest.Failures(t, brokertest.Publish(t, p, brokertest.Message("order/1", 1), brokertest.Message("order/1", 2)))
	if e := failed["evt-order-1-1"]; !outbox.IsPermanent(e) || !redis.HasErrorPrefix(e, "WRONGTYPE") {
		t.Errorf("evt-order-1-1: %v, want permanent WRONGTYPE", e)
	}
	if e := failed["evt-order-1-2"]; !errors.Is(e, outbox.ErrNotAttempted) {
		t.Errorf("evt-order-1-2: %v, want ErrNotAttempted", e)
	}
}

func TestEmptyStreamKeyIsPermanent(t *testing.T) {
	t.Parallel()
	p := newPublisher(t, newRedis(t), toStream(""))
	if e := brokertest.Failures(t, brokertest.Publish(t, p, brokertest.Message("order/1", 1)))["evt-order-1-1"]; !outbox.IsPermanent(e) {
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
	err := p.Publish(ctx, outbox.Batch{ID: "b", Messages: []outbox.Message{brokertest.Message("order/1", 1)}})
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
			if err := brokertest.Publish(t, p, brokertest.Message("order/0", 1)); err != nil { // the publisher has asked the server
				t.Fatalf("warm-up Publish: %v", err)
			}
			proxy.stalled.Store(true)
			brokertest.CheckUnansweredBatchFailsByTheDeadline(t, p, 300*time.Millisecond, time.Second, context.DeadlineExceeded)
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
	err := p.Publish(ctx, outbox.Batch{ID: "b", Messages: []outbox.Message{brokertest.Message("order/1", 1)}})
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
		msgs = append(msgs, brokertest.Message(fmt.Sprintf("order/%d", i), 1))
	}
	if err := brokertest.Publish(t, p, msgs...); err != nil {
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
	brokertest.CheckNewRejects(t, outboxredis.New, []brokertest.Rejected[redis.UniversalClient, outboxredis.Option]{
		{Name: "nil client", Naming: "nil redis.UniversalClient"},
		{Name: "nil stream function", Client: rdb, Options: []outboxredis.Option{outboxredis.WithStream(nil)}, Naming: "WithStream"},
		{Name: "empty source", Client: rdb, Options: []outboxredis.Option{outboxredis.WithSource("")}, Naming: "WithSource"},
		{Name: "source with a space", Client: rdb, Options: []outboxredis.Option{outboxredis.WithSource("my app")}, Naming: "WithSource"},
		{Name: "source with a control character", Client: rdb, Options: []outboxredis.Option{outboxredis.WithSource("shop\x00")}, Naming: "WithSource"},
		{Name: "source not a URI", Client: rdb, Options: []outboxredis.Option{outboxredis.WithSource("%zz")}, Naming: "WithSource"},
		{Name: "zero max length", Client: rdb, Options: []outboxredis.Option{outboxredis.WithMaxLen(0)}, Naming: "WithMaxLen"},
		{Name: "negative max length", Client: rdb, Options: []outboxredis.Option{outboxredis.WithMaxLen(-5)}, Naming: "WithMaxLen"},
	})
}
