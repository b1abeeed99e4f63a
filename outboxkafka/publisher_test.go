package outboxkafka_test

import (
	"bytes"
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

	cebinding "github.com/cloudevents/sdk-go/v2/binding"
	cespec "github.com/cloudevents/sdk-go/v2/binding/spec"
	ceevent "github.com/cloudevents/sdk-go/v2/event"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/gorm-outbox/outbox"
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

// recordMessage reads a record as the CloudEvents Kafka binding does in
// binary mode: ce_ headers are attributes and extensions, content-type is
// datacontenttype, the value is the data. The SDK's own Kafka binding
// modules are not served by the module proxy here, so the test drives the
// SDK's binding.ToEvent through this reader instead.
type recordMessage struct{ rec *kgo.Record }

var ceVersions = cespec.WithPrefix(outboxkafka.HeaderPrefix)

func (r recordMessage) ReadEncoding() cebinding.Encoding { return cebinding.EncodingBinary }

func (r recordMessage) ReadStructured(context.Context, cebinding.StructuredWriter) error {
	return cebinding.ErrNotStructured
}

func (r recordMessage) ReadBinary(ctx context.Context, w cebinding.BinaryWriter) error {
	version := r.version()
	if version == nil {
		return cebinding.ErrUnknownEncoding
	}
	for _, h := range r.rec.Headers {
		switch {
		case h.Key == outboxkafka.HeaderContentType:
			if err := w.SetAttribute(version.AttributeFromKind(cespec.DataContentType), string(h.Value)); err != nil {
				return err
			}
		case strings.HasPrefix(h.Key, outboxkafka.HeaderPrefix):
			if a := version.Attribute(h.Key); a != nil {
				if err := w.SetAttribute(a, string(h.Value)); err != nil {
					return err
				}
			} else if err := w.SetExtension(strings.TrimPrefix(h.Key, outboxkafka.HeaderPrefix), string(h.Value)); err != nil {
				return err
			}
		}
	}
	return w.SetData(bytes.NewReader(r.rec.Value))
}

func (r recordMessage) version() cespec.Version {
	if v, ok := header(r.rec, ceVersions.PrefixedSpecVersionName()); ok {
		return ceVersions.Version(v)
	}
	return nil
}

func (r recordMessage) GetAttribute(k cespec.Kind) (cespec.Attribute, any) {
	version := r.version()
	if version == nil {
		return nil, nil
	}
	a := version.AttributeFromKind(k)
	name := a.PrefixedName()
	if k == cespec.DataContentType {
		name = outboxkafka.HeaderContentType
	}
	if v, ok := header(r.rec, name); ok {
		return a, v
	}
	return a, nil
}

func (r recordMessage) GetExtension(name string) any {
	if v, ok := header(r.rec, outboxkafka.HeaderPrefix+name); ok {
		return v
	}
	return nil
}

func (r recordMessage) Finish(error) error { return nil }

// decode turns rec into a CloudEvent with the SDK and validates it.
func decode(t *testing.T, rec *kgo.Record) *ceevent.Event {
	t.Helper()
	e, err := cebinding.ToEvent(context.Background(), recordMessage{rec})
	if err != nil {
		t.Fatalf("record %s: SDK cannot read it as a CloudEvent: %v", rec.Key, err)
	}
	if err := e.Validate(); err != nil {
		t.Fatalf("record %s: SDK says the event is invalid: %v", rec.Key, err)
	}
	return e
}

func header(rec *kgo.Record, key string) (string, bool) {
	for _, h := range rec.Headers {
		if h.Key == key {
			return string(h.Value), true
		}
	}
	return "", false
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

func publish(t *testing.T, p *outboxkafka.Publisher, msgs ...outbox.Message) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return p.Publish(ctx, outbox.Batch{ID: "batch-" + msgs[0].EventID, Messages: msgs})
}

// failures returns the PartialError's map, failing the test when err is
// not one.
func failures(t *testing.T, err error) map[string]error {
	t.Helper()
	var pe *outbox.PartialError
	if !errors.As(err, &pe) {
		t.Fatalf("Publish = %v, want a *outbox.PartialError", err)
	}
	return pe.Failed
}

func TestPublishWritesBinaryModeCloudEvents(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 1)
	topic := uniqueTopic(t)
	p := newPublisher(t, newClient(t, c.ListenAddrs()), toTopic(topic), outboxkafka.WithSource("/shop/orders"))

	m1 := msg("42", 1)
	m1.Headers = map[string]string{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tenant": "acme"}
	m2 := msg("42", 2)
	m2.EventType = "order.paid"
	if err := publish(t, p, m1, m2); err != nil {
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
				t.Errorf("record %d: %s = %q, want %q", i, c.name, c.got, c.want)
			}
		}
		ext := e.Extensions()
		for name, v := range map[string]any{"partitionkey": "order/42", "aggregatetype": "order", "aggregateid": "42", "aggregatesequence": fmt.Sprint(want.Sequence)} {
			if got := fmt.Sprint(ext[name]); got != v {
				t.Errorf("record %d: extension %s = %q, want %q", i, name, got, v)
			}
		}
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

	const aggregates, perAggregate = 12, 6
	var msgs []outbox.Message
	for seq := int64(1); seq <= perAggregate; seq++ {
		for a := range aggregates {
			msgs = append(msgs, msg(fmt.Sprint(a), seq))
		}
	}
	if err := publish(t, p, msgs...); err != nil {
		t.Fatalf("Publish: %v", err)
	}
	recs := consume(t, c.ListenAddrs(), topic, len(msgs), 5*time.Second)
	if len(recs) != len(msgs) {
		t.Fatalf("consumed %d records, want %d", len(recs), len(msgs))
	}
	partitionOf := map[string]int32{}
	last := map[string]int64{}
	partitions := map[int32]bool{}
	for _, rec := range recs { // a fetch returns each partition in offset order
		key := string(rec.Key)
		if p, ok := partitionOf[key]; ok && p != rec.Partition {
			t.Errorf("aggregate %s in partitions %d and %d", key, p, rec.Partition)
		}
		partitionOf[key] = rec.Partition
		partitions[rec.Partition] = true
		seq, _ := header(rec, "ce_aggregatesequence")
		var n int64
		fmt.Sscan(seq, &n)
		if n != last[key]+1 {
			t.Errorf("aggregate %s: sequence %d after %d", key, n, last[key])
		}
		last[key] = n
	}
	if len(partitions) < 2 {
		t.Errorf("all %d aggregates landed in %d partition(s); the test needs them spread", aggregates, len(partitions))
	}
}

func TestSameBatchTwiceLeavesTwoCopiesWithTheSameID(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 1)
	topic := uniqueTopic(t)
	p := newPublisher(t, newClient(t, c.ListenAddrs()), toTopic(topic))

	b := []outbox.Message{msg("7", 1), msg("7", 2)}
	for range 2 {
		if err := publish(t, p, b...); err != nil {
			t.Fatalf("Publish: %v", err)
		}
	}
	// The idempotent producer drops only its own retries within one
	// producer session; a batch the dispatcher sends again is new to
	// Kafka, so consumers deduplicate on ce_id.
	recs := consume(t, c.ListenAddrs(), topic, 4, 3*time.Second)
	ids := map[string]int{}
	for _, rec := range recs {
		id, _ := header(rec, "ce_id")
		ids[id]++
	}
	if len(recs) != 4 || ids["evt-7-1"] != 2 || ids["evt-7-2"] != 2 {
		t.Errorf("consumed %d records with ids %v, want each of the two ids twice", len(recs), ids)
	}
}

func TestOversizedMessageIsPermanentAndHoldsBackItsAggregate(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 1)
	topic := uniqueTopic(t)
	p := newPublisher(t, newClient(t, c.ListenAddrs()), toTopic(topic))

	big := msg("1", 2)
	big.Payload = json.RawMessage(`"` + strings.Repeat("x", 1<<20) + `"`)
	err := publish(t, p, msg("1", 1), big, msg("1", 3), msg("2", 1))
	failed := failures(t, err)
	if e := failed[big.EventID]; !outbox.IsPermanent(e) || !errors.Is(e, kerr.MessageTooLarge) {
		t.Errorf("oversized message: %v, want permanent kerr.MessageTooLarge", e)
	}
	if e := failed["evt-1-3"]; !errors.Is(e, outbox.ErrNotAttempted) {
		t.Errorf("message after it in its aggregate: %v, want ErrNotAttempted", e)
	}
	if len(failed) != 2 {
		t.Errorf("failed = %v, want only those two", failed)
	}
	var got []string
	for _, rec := range consume(t, c.ListenAddrs(), topic, 3, 2*time.Second) {
		id, _ := header(rec, "ce_id")
		got = append(got, id)
	}
	if fmt.Sprint(got) != "[evt-1-1 evt-2-1]" {
		t.Errorf("topic holds %v, want [evt-1-1 evt-2-1]: nothing of aggregate 1 after the oversized one", got)
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
			e := failures(t, publish(t, p, msg("1", 1)))["evt-1-1"]
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
		m := msg("1", 1)
		m.Headers = map[string]string{name: "x"}
		e := failures(t, publish(t, p, m))[m.EventID]
		if !outbox.IsPermanent(e) || !errors.Is(e, outboxkafka.ErrReservedHeader) {
			t.Errorf("header %s: %v, want permanent ErrReservedHeader", name, e)
		}
	}
}

func TestUnreachableBrokerFailsRetryablyByTheDeadline(t *testing.T) {
	t.Parallel()
	cl := newClient(t, []string{"127.0.0.1:1"})
	p := newPublisher(t, cl, toTopic("unreachable"))
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	start := time.Now()
	err := p.Publish(ctx, outbox.Batch{ID: "b", Messages: []outbox.Message{msg("1", 1), msg("1", 2), msg("2", 1)}})
	if d := time.Since(start); d > 1500*time.Millisecond {
		t.Errorf("Publish took %v, past the 500ms deadline", d)
	}
	failed := failures(t, err)
	for _, id := range []string{"evt-1-1", "evt-2-1"} {
		if e := failed[id]; e == nil || outbox.IsPermanent(e) || errors.Is(e, outbox.ErrNotAttempted) {
			t.Errorf("%s: %v, want a retryable failure", id, e)
		}
	}
	if e := failed["evt-1-2"]; !errors.Is(e, outbox.ErrNotAttempted) {
		t.Errorf("evt-1-2: %v, want ErrNotAttempted behind evt-1-1", e)
	}
}

func TestContextExpiringMidBatchFailsUnacknowledgedMessages(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 1)
	topic := uniqueTopic(t)
	cl := newClient(t, c.ListenAddrs())
	p := newPublisher(t, cl, toTopic(topic))
	if err := publish(t, p, msg("0", 1)); err != nil { // topic and producer ID exist
		t.Fatalf("warm-up Publish: %v", err)
	}
	// From now on the broker holds every produce request for two seconds.
	c.ControlKey(int16(kmsg.Produce), func(kmsg.Request) (kmsg.Response, error, bool) {
		c.KeepControl()
		time.Sleep(2 * time.Second)
		return nil, nil, false
	})
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
}

func TestNewRejectsInvalidOptions(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 1)
	cl := newClient(t, c.ListenAddrs())
	txn := newClient(t, c.ListenAddrs(), kgo.TransactionalID("txn"))
	for _, tc := range []struct {
		name   string
		cl     *kgo.Client
		opts   []outboxkafka.Option
		option string
	}{
		{"nil client", nil, nil, "nil *kgo.Client"},
		{"transactional client", txn, nil, "transactional"},
		{"nil topic function", cl, []outboxkafka.Option{outboxkafka.WithTopic(nil)}, "WithTopic"},
		{"empty source", cl, []outboxkafka.Option{outboxkafka.WithSource("")}, "WithSource"},
		{"source not a URI", cl, []outboxkafka.Option{outboxkafka.WithSource("%zz")}, "WithSource"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := outboxkafka.New(tc.cl, tc.opts...)
			if !errors.Is(err, outbox.ErrInvalidOption) || !strings.Contains(err.Error(), tc.option) {
				t.Errorf("New: %v, want ErrInvalidOption naming %s", err, tc.option)
			}
		})
	}
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
	failed := failures(t, publish(t, p, msg("1", 1), msg("1", 2)))
	if e := failed["evt-1-1"]; !outbox.IsPermanent(e) || !errors.Is(e, kerr.TopicAuthorizationFailed) {
		t.Errorf("evt-1-1: %v, want permanent kerr.TopicAuthorizationFailed", e)
	}
	if e := failed["evt-1-2"]; !errors.Is(e, outbox.ErrNotAttempted) {
		t.Errorf("evt-1-2: %v, want ErrNotAttempted", e)
	}
}

func TestRecordTheBrokerFindsTooLargeIsPermanent(t *testing.T) {
	t.Parallel()
	// The broker accepts less than the client's ProducerBatchMaxBytes, so
	// only the broker can refuse the record: after it is produced.
	c := newCluster(t, 1, kfake.BrokerConfigs(map[string]string{"message.max.bytes": "4096"}))
	topic := uniqueTopic(t)
	p := newPublisher(t, newClient(t, c.ListenAddrs()), toTopic(topic))

	big := msg("1", 2)
	noise := make([]byte, 8<<10) // incompressible, so that it stays too large
	rand.Read(noise)
	big.Payload = json.RawMessage(`"` + hex.EncodeToString(noise) + `"`)
	err := publish(t, p, msg("1", 1), big, msg("1", 3), msg("2", 1))
	failed := failures(t, err)
	if e := failed[big.EventID]; !outbox.IsPermanent(e) || !errors.Is(e, kerr.MessageTooLarge) {
		t.Errorf("oversized message: %v, want permanent kerr.MessageTooLarge", e)
	}
	if e := failed["evt-1-3"]; !errors.Is(e, outbox.ErrNotAttempted) {
		t.Errorf("message after it in its aggregate: %v, want ErrNotAttempted", e)
	}
	// Whatever franz-go batched with the big record fails with it; every
	// message reported accepted is in the topic.
	stored := map[string]bool{}
	for _, rec := range consume(t, c.ListenAddrs(), topic, 4, 2*time.Second) {
		id, _ := header(rec, "ce_id")
		stored[id] = true
	}
	if stored[big.EventID] {
		t.Errorf("the oversized record is in the topic")
	}
	for _, id := range []string{"evt-1-1", "evt-1-2", "evt-1-3", "evt-2-1"} {
		if _, bad := failed[id]; !bad && !stored[id] {
			t.Errorf("%s was reported accepted but is not in the topic", id)
		}
	}
	t.Logf("failed: %v; stored: %v", failed, stored)
}
