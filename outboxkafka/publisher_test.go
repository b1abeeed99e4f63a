package outboxkafka_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cloudevents/sdk-go/v2/event"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest/brokertest"
	"github.com/gorm-outbox/outbox/outboxkafka"
)

var topicSeq atomic.Int64

// uniqueTopic names a topic no other test uses.
func uniqueTopic(t *testing.T) string {
	return fmt.Sprintf("outboxkafka-test-%d-%d", time.Now().UnixNano()%1e9, topicSeq.Add(1))
}

// newCluster starts an in-process Kafka cluster that creates topics of
// partitions partitions on first use.
func newCluster(t *testing.T, partitions int, opts ...kfake.Opt) *kfake.Cluster {
	t.Helper()
	opts = append([]kfake.Opt{kfake.NumBrokers(1), kfake.AllowAutoTopicCreation(), kfake.DefaultNumPartitions(partitions)}, opts...)
	c, err := kfake.NewCluster(opts...)
	if err != nil {
		t.Fatalf("kfake: %v", err)
	}
	t.Cleanup(c.Close)
	return c
}

// newClient returns a franz-go client with the default producer.
func newClient(t testing.TB, addrs []string, opts ...kgo.Opt) *kgo.Client {
	t.Helper()
	cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(addrs...), kgo.AllowAutoTopicCreation()}, opts...)...)
	if err != nil {
		t.Fatalf("kgo.NewClient: %v", err)
	}
	t.Cleanup(cl.Close)
	return cl
}

func newPublisher(t testing.TB, cl *kgo.Client, opts ...outboxkafka.Option) *outboxkafka.Publisher {
	t.Helper()
	p, err := outboxkafka.New(cl, opts...)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return p
}

// toTopic routes every message to topic.
func toTopic(topic string) outboxkafka.Option {
	return outboxkafka.WithTopic(func(outbox.Message) string { return topic })
}

// consume reads records of topic from the start until it has n of them or
// wait has passed since the last one arrived.
func consume(t *testing.T, addrs []string, topic string, n int, wait time.Duration) []*kgo.Record {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(addrs...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatalf("consumer: %v", err)
	}
	defer cl.Close()
	var recs []*kgo.Record
	for len(recs) < n {
		ctx, cancel := context.WithTimeout(context.Background(), wait)
		fs := cl.PollFetches(ctx)
		cancel()
		if ctx.Err() != nil && fs.NumRecords() == 0 {
			break
		}
		fs.EachError(func(topic string, p int32, err error) {
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Fatalf("fetch %s/%d: %v", topic, p, err)
			}
		})
		recs = append(recs, fs.Records()...)
	}
	return recs
}

// decode reads rec as the CloudEvents Kafka binding does in binary content
// mode (each ce_ header is an attribute or extension, content-type is
// datacontenttype, the value is the data) and decodes it with the SDK.
// The SDK's own Kafka binding modules are not served by the module proxy
// here, so the test drives the SDK's binding.ToEvent through this reader
// instead.
func decode(t testing.TB, rec *kgo.Record) *event.Event {
	t.Helper()
	attrs := map[string]string{}
	for _, h := range rec.Headers {
		if h.Key == outboxkafka.HeaderContentType {
			attrs["datacontenttype"] = string(h.Value)
		} else if attr, ok := strings.CutPrefix(h.Key, outboxkafka.HeaderPrefix); ok {
			attrs[attr] = string(h.Value)
		}
	}
	return brokertest.Event(t, brokertest.Binary{Attributes: attrs, Data: rec.Value})
}

// decodeAll decodes every record of recs.
func decodeAll(t testing.TB, recs []*kgo.Record) []*event.Event {
	t.Helper()
	out := make([]*event.Event, len(recs))
	for i, rec := range recs {
		out[i] = decode(t, rec)
	}
	return out
}

func header(rec *kgo.Record, key string) (string, bool) {
	for _, h := range rec.Headers {
		if h.Key == key {
			return string(h.Value), true
		}
	}
	return "", false
}

func TestPublishWritesBinaryModeCloudEvents(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 1)
	topic := uniqueTopic(t)
	p := newPublisher(t, newClient(t, c.ListenAddrs()), toTopic(topic), outboxkafka.WithSource("/shop/orders"))

	m1 := brokertest.Message("order/42", 1)
	m1.Headers = map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tenant": "acme"}
	m2 := brokertest.Message("order/42", 2)
	m2.EventType = "order.paid"
	if err := brokertest.Publish(t, p, m1, m2); err != nil {
		t.Fatalf("Publish: %v", err)
	}
	recs := consume(t, c.ListenAddrs(), topic, 2, 5*time.Second)
	if len(recs) != 2 {
		t.Fatalf("consumed %d records, want 2", len(recs))
	}
	for i, want := range []outbox.Message{m1, m2} {
		rec := recs[i]
		e := decode(t, rec)
		if string(rec.Value) != string(want.Payload) {
			t.Errorf("value = %s, want the payload byte for byte: %s", rec.Value, want.Payload)
		}
		if string(rec.Key) != "order/42" {
			t.Errorf("key = %q, want the aggregate key order/42", rec.Key)
		}
		brokertest.CheckEvent(t, e, want, "/shop/orders")
		if _, ok := header(rec, "ce_sequence"); ok {
			t.Errorf("record %d has ce_sequence; the aggregate's sequence is aggregatesequence", i)
		}
		if _, ok := header(rec, "ce_datacontenttype"); ok {
			t.Errorf("record %d has ce_datacontenttype; the Kafka binding uses content-type", i)
		}
		for k, v := range want.Headers {
			if got, ok := header(rec, k); !ok || got != v {
				t.Errorf("record %d: event header %s = %q (present %v), want %q unchanged", i, k, got, ok, v)
			}
		}
	}
}

func TestAggregateOrderHoldsWithinEachPartition(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 4)
	topic := uniqueTopic(t)
	p := newPublisher(t, newClient(t, c.ListenAddrs()), toTopic(topic))

	var aggregates []string
	for a := range 12 {
		aggregates = append(aggregates, fmt.Sprintf("order/%d", a))
	}
	msgs := brokertest.Interleaved(6, aggregates...)
	if err := brokertest.Publish(t, p, msgs...); err != nil {
		t.Fatalf("Publish: %v", err)
	}
	recs := consume(t, c.ListenAddrs(), topic, len(msgs), 5*time.Second)
	// A fetch returns each partition in offset order: each aggregate's
	// records are in order if its partition's are.
	brokertest.CheckInOrder(t, decodeAll(t, recs), msgs)
	partitionOf := map[string]int32{}
	partitions := map[int32]bool{}
	for _, rec := range recs {
		key := string(rec.Key)
		if p, ok := partitionOf[key]; ok && p != rec.Partition {
			t.Errorf("aggregate %s in partitions %d and %d", key, p, rec.Partition)
		}
		partitionOf[key] = rec.Partition
		partitions[rec.Partition] = true
	}
	if len(partitions) < 2 {
		t.Errorf("all %d aggregates landed in %d partition(s); the test needs them spread", len(aggregates), len(partitions))
	}
}

func TestSameBatchTwiceLeavesTwoCopiesWithTheSameID(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 1)
	topic := uniqueTopic(t)
	p := newPublisher(t, newClient(t, c.ListenAddrs()), toTopic(topic))

	// The idempotent producer drops only its own retries within one
	// producer session; a batch the dispatcher sends again is new to
	// Kafka, so consumers deduplicate on ce_id.
	brokertest.CheckDuplicateBatch(t, p, 2, func() []*event.Event {
		return decodeAll(t, consume(t, c.ListenAddrs(), topic, 6, 3*time.Second))
	})
}

func TestOversizedMessageIsPermanentAndHoldsBackItsAggregate(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 1)
	topic := uniqueTopic(t)
	p := newPublisher(t, newClient(t, c.ListenAddrs()), toTopic(topic))

	failed := brokertest.CheckOversizedMessageFails(t, p, json.RawMessage(`"`+strings.Repeat("x", 1<<20)+`"`), kerr.MessageTooLarge)
	if len(failed) != 2 {
		t.Errorf("failed = %v, want only those two", failed)
	}
	var got []string
	for _, rec := range consume(t, c.ListenAddrs(), topic, 3, 2*time.Second) {
		id, _ := header(rec, "ce_id")
		got = append(got, id)
	}
	if fmt.Sprint(got) != "[evt-order-1-1 evt-order-2-1]" {
		t.Errorf("topic holds %v, want [evt-order-1-1 evt-order-2-1]: nothing of aggregate 1 after the oversized one", got)
	}
}

func TestUnroutableMessageIsPermanent(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 1)
	cl := newClient(t, c.ListenAddrs())
	for _, tc := range []struct{ name, topic string }{
		{"empty", ""},
		{"space", "no spaces"},
		{"dotdot", ".."},
		{"too long", strings.Repeat("t", 250)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			p := newPublisher(t, cl, toTopic(tc.topic))
			e := brokertest.Failures(t, brokertest.Publish(t, p, brokertest.Message("order/1", 1)))["evt-order-1-1"]
			if !outbox.IsPermanent(e) || !errors.Is(e, kerr.InvalidTopicException) {
				t.Errorf("topic %q: %v, want permanent kerr.InvalidTopicException", tc.topic, e)
			}
		})
	}
}

func TestEventHeaderNamedLikeAnAttributeIsPermanent(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 1)
	p := newPublisher(t, newClient(t, c.ListenAddrs()), toTopic(uniqueTopic(t)))
	for _, name := range []string{"ce_id", "CE_Type", "content-type", "ce_aggregatesequence"} {
		m := brokertest.Message("order/1", 1)
		m.Headers = map[string]string{name: "x"}
		e := brokertest.Failures(t, brokertest.Publish(t, p, m))[m.EventID]
		if !outbox.IsPermanent(e) || !errors.Is(e, outboxkafka.ErrReservedHeader) {
			t.Errorf("header %s: %v, want permanent ErrReservedHeader", name, e)
		}
	}
}

func TestUnreachableBrokerFailsRetryablyByTheDeadline(t *testing.T) {
	t.Parallel()
	cl := newClient(t, []string{"127.0.0.1:1"})
	p := newPublisher(t, cl, toTopic("unreachable"))
	brokertest.CheckUnansweredBatchFailsByTheDeadline(t, p, 500*time.Millisecond, 1500*time.Millisecond, nil)
}

func TestContextExpiringMidBatchFailsUnacknowledgedMessages(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 1)
	topic := uniqueTopic(t)
	cl := newClient(t, c.ListenAddrs())
	p := newPublisher(t, cl, toTopic(topic))
	if err := brokertest.Publish(t, p, brokertest.Message("order/0", 1)); err != nil { // topic and producer ID exist
		t.Fatalf("warm-up Publish: %v", err)
	}
	// From now on the broker holds every produce request for two seconds.
	c.ControlKey(int16(kmsg.Produce), func(kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		time.Sleep(2 * time.Second)
		return nil, nil, false
	})
	brokertest.CheckUnansweredBatchFailsByTheDeadline(t, p, 300*time.Millisecond, time.Second, context.DeadlineExceeded)
}

func TestNewRejectsInvalidOptions(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 1)
	cl := newClient(t, c.ListenAddrs())
	txn := newClient(t, c.ListenAddrs(), kgo.TransactionalID("txn"))
	brokertest.CheckNewRejects(t, outboxkafka.New, []brokertest.Rejected[*kgo.Client, outboxkafka.Option]{
		{Name: "nil client", Naming: "nil *kgo.Client"},
		{Name: "transactional client", Client: txn, Naming: "transactional"},
		{Name: "nil topic function", Client: cl, Options: []outboxkafka.Option{outboxkafka.WithTopic(nil)}, Naming: "WithTopic"},
		{Name: "empty source", Client: cl, Options: []outboxkafka.Option{outboxkafka.WithSource("")}, Naming: "WithSource"},
		{Name: "source with a space", Client: cl, Options: []outboxkafka.Option{outboxkafka.WithSource("my app")}, Naming: "WithSource"},
		{Name: "source with a control character", Client: cl, Options: []outboxkafka.Option{outboxkafka.WithSource("shop\x00")}, Naming: "WithSource"},
		{Name: "source not a URI", Client: cl, Options: []outboxkafka.Option{outboxkafka.WithSource("%zz")}, Naming: "WithSource"},
	})
}

func TestEmptyBatchSendsNothing(t *testing.T) {
	t.Parallel()
	p := newPublisher(t, newClient(t, []string{"127.0.0.1:1"}))
	if err := p.Publish(context.Background(), outbox.Batch{ID: "empty"}); err != nil {
		t.Errorf("Publish(empty) = %v, want nil", err)
	}
}

func TestAuthorizationRefusedIsPermanent(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 1)
	// The broker refuses every produce request for the topics in it, as
	// a broker with ACLs answers a principal without WRITE on them.
	c.ControlKey(int16(kmsg.Produce), func(kr kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		req := kr.(*kmsg.ProduceRequest)
		resp := req.ResponseKind().(*kmsg.ProduceResponse)
		resp.Version = req.Version
		for _, rt := range req.Topics {
			st := kmsg.NewProduceResponseTopic()
			st.Topic, st.TopicID = rt.Topic, rt.TopicID
			for _, rp := range rt.Partitions {
				sp := kmsg.NewProduceResponseTopicPartition()
				sp.Partition, sp.ErrorCode = rp.Partition, kerr.TopicAuthorizationFailed.Code
				st.Partitions = append(st.Partitions, sp)
			}
			resp.Topics = append(resp.Topics, st)
		}
		return resp, nil, true
	})
	p := newPublisher(t, newClient(t, c.ListenAddrs()), toTopic(uniqueTopic(t)))
	failed := brokertest.Failures(t, brokertest.Publish(t, p, brokertest.Message("order/1", 1), brokertest.Message("order/1", 2)))
	if e := failed["evt-order-1-1"]; !outbox.IsPermanent(e) || !errors.Is(e, kerr.TopicAuthorizationFailed) {
		t.Errorf("evt-order-1-1: %v, want permanent kerr.TopicAuthorizationFailed", e)
	}
	if e := failed["evt-order-1-2"]; !errors.Is(e, outbox.ErrNotAttempted) {
		t.Errorf("evt-order-1-2: %v, want ErrNotAttempted", e)
	}
}

func TestRecordTheBrokerFindsTooLargeIsPermanent(t *testing.T) {
	t.Parallel()
	// The broker accepts less than the client's ProducerBatchMaxBytes, so
	// only the broker can refuse the record: after it is produced.
	c := newCluster(t, 1, kfake.BrokerConfigs(map[string]string{"message.max.bytes": "4096"}))
	topic := uniqueTopic(t)
	p := newPublisher(t, newClient(t, c.ListenAddrs()), toTopic(topic))

	noise := make([]byte, 8<<10) // incompressible, so that it stays too large
	rand.Read(noise)
	failed := brokertest.CheckOversizedMessageFails(t, p, json.RawMessage(`"`+hex.EncodeToString(noise)+`"`), kerr.MessageTooLarge)
	// Whatever franz-go batched with the big record fails with it; every
	// message reported accepted is in the topic.
	stored := map[string]bool{}
	for _, rec := range consume(t, c.ListenAddrs(), topic, 4, 2*time.Second) {
		id, _ := header(rec, "ce_id")
		stored[id] = true
	}
	if stored["evt-order-1-2"] {
		t.Errorf("the oversized record is in the topic")
	}
	for _, id := range []string{"evt-order-1-1", "evt-order-1-2", "evt-order-1-3", "evt-order-2-1"} {
		if _, bad := failed[id]; !bad && !stored[id] {
			t.Errorf("%s was reported accepted but is not in the topic", id)
		}
	}
	t.Logf("failed: %v; stored: %v", failed, stored)
}
