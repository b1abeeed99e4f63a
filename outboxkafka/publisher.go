package outboxkafka

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/cloudevent"
)

// HeaderPrefix is the prefix of every CloudEvents attribute header, as the
// Kafka protocol binding's binary content mode names them: ce_id, ce_type,
// ce_source, ...
const HeaderPrefix = "ce_"

// HeaderContentType carries the event's datacontenttype
// ("application/json"), which the Kafka binding maps to this header instead
// of a ce_ one.
const HeaderContentType = "content-type"

// DefaultTopicPrefix precedes the aggregate type in the default topic: the
// events of aggregate type "order" go to the topic "outbox.order".
const DefaultTopicPrefix = "outbox."

// batchOverhead is the size of a record batch's header: a record alone in a
// batch takes this much on top of its own encoding.
const batchOverhead = 61

// maxVarint is the longest encoding of a varint of 32 bits, and
// maxVarlong of 64: the size check assumes the worst.
const (
	maxVarint  = 5
	maxVarlong = 10
)

// ErrReservedHeader is returned (wrapped, and marked [outbox.Permanent])
// for a message with an event header of its own whose name is one that the
// publisher sets: a CloudEvents attribute header (ce_id, ce_type, ...) or
// content-type. Such a message is not sent.
var ErrReservedHeader = errors.New("outboxkafka: event header collides with a CloudEvents attribute header")

// Publisher produces each message of a batch as one Kafka record through a
// franz-go client. It implements [outbox.Publisher] and is safe for
// concurrent use.
type Publisher struct {
	cl       *kgo.Client
	topic    func(outbox.Message) string
	source   string
	maxBytes func(topic string) int32
	reserved map[string]bool
}

var _ outbox.Publisher = (*Publisher)(nil)

// Option configures a [Publisher]. An option given an invalid value makes
// [New] fail with an error that wraps [outbox.ErrInvalidOption] and names
// the option.
type Option func(*config) error

type config struct {
	topic  func(outbox.Message) string
	source string
}

// WithTopic routes each message to the topic fn returns. fn must not be
// nil. A topic that is not a valid Kafka topic name (1 to 249 of a-z, A-Z,
// 0-9, '.', '_', '-', and not "." or "..") fails that message with a
// permanent error, and it is not sent. Records of one aggregate keep their
// order only within one topic: route all of an aggregate's events to the
// same one.
//
// Default: [DefaultTopicPrefix] followed by the aggregate type
// ("outbox.order").
func WithTopic(fn func(outbox.Message) string) Option {
	return func(c *config) error {
		if fn == nil {
			return fmt.Errorf("%w: WithTopic: nil function", outbox.ErrInvalidOption)
		}
		c.topic = fn
		return nil
	}
}

// WithSource sets the CloudEvents source attribute (ce_source) of every
// event. It must be a non-empty URI-reference without white space or
// control characters, such as "https://shop.example/orders" or "/orders".
//
// Default: "gorm-outbox".
func WithSource(source string) Option {
	return func(c *config) error {
		if err := cloudevent.CheckSource(source); err != nil {
			return fmt.Errorf("%w: WithSource: %w", outbox.ErrInvalidOption, err)
		}
		c.source = source
		return nil
	}
}

// New returns a publisher that produces through cl, which must not be nil
// and stays the caller's to close (after the dispatcher has stopped).
//
// cl should be a producer as franz-go makes it by default: idempotent
// writes, acks from all in-sync replicas, and no transactional ID (New
// refuses a transactional client). A client with idempotent writes
// disabled keeps an aggregate's order only with
// MaxProduceRequestsInflightPerBroker at its default of 1, and its own
// retries may then write duplicates. The client's ProducerBatchMaxBytes
// (1,000,012 bytes by default) bounds a record: keep it at or below the
// topics' max.message.bytes. New fails with an error wrapping
// [outbox.ErrInvalidOption] when cl or an option is invalid.
func New(cl *kgo.Client, opts ...Option) (*Publisher, error) {
	if cl == nil {
		return nil, fmt.Errorf("%w: outboxkafka.New: nil *kgo.Client", outbox.ErrInvalidOption)
	}
	c := config{
		topic:  func(m outbox.Message) string { return DefaultTopicPrefix + m.AggregateType },
		source: cloudevent.DefaultSource,
	}
	for _, opt := range opts {
		if err := opt(&c); err != nil {
			return nil, err
		}
	}
	if txn, _ := cl.OptValue(kgo.TransactionalID).(string); txn != "" {
		return nil, fmt.Errorf("%w: outboxkafka.New: client has transactional ID %q; the publisher produces outside transactions", outbox.ErrInvalidOption, txn)
	}
	maxBytes, _ := cl.OptValue(kgo.ProducerBatchMaxBytesFn).(func(string) int32)
	if maxBytes == nil {
		maxBytes = func(string) int32 { return 1_000_012 }
	}
	reserved := map[string]bool{HeaderContentType: true}
	for _, a := range cloudevent.Attributes(outbox.Message{}, c.source) {
		if a.Name != "datacontenttype" {
			reserved[HeaderPrefix+a.Name] = true
		}
	}
	return &Publisher{cl: cl, topic: c.topic, source: c.source, maxBytes: maxBytes, reserved: reserved}, nil
}

// Publish produces every message of b asynchronously, then waits until
// franz-go reports each one acknowledged or failed, or until ctx is done,
// whichever comes first: it never waits past ctx's deadline.
//
// It returns nil when every record was acknowledged. Otherwise it returns
// an [*outbox.PartialError]: the first failed message of an aggregate
// carries its error, and the later messages of that aggregate in b carry
// [outbox.ErrNotAttempted], whether or not franz-go had already sent them
// (see the package documentation for what a consumer then sees). A
// message still unacknowledged when ctx ends fails with ctx's error: it may
// yet be written, and is delivered again.
func (p *Publisher) Publish(ctx context.Context, b outbox.Batch) error {
	if len(b.Messages) == 0 {
		return nil
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("outboxkafka: publish: %w", err)
	}
	var (
		recs    = make([]*kgo.Record, len(b.Messages)) // nil for a message not produced
		mu      sync.Mutex
		results = make([]error, len(b.Messages))
		settled = make([]bool, len(b.Messages))
		pending = len(b.Messages)
		done    = make(chan struct{})
	)
	settle := func(i int, err error) {
		mu.Lock()
		defer mu.Unlock()
		results[i], settled[i] = err, true
		if pending--; pending == 0 {
			close(done)
		}
	}
	refused := make(map[string]bool) // aggregates with a message refused here
	for i, m := range b.Messages {
		key := cloudevent.Key(m)
		if refused[key] {
			settle(i, outbox.ErrNotAttempted)
			continue
		}
		rec, err := p.record(m)
		if err != nil {
			refused[key] = true
			settle(i, err)
			continue
		}
		recs[i] = rec
		p.cl.Produce(ctx, rec, func(_ *kgo.Record, err error) { settle(i, produceError(m, rec, err)) })
	}
	all := true
	select {
	case <-done:
	case <-ctx.Done():
		all = false
	}
	mu.Lock()
	outcomes, acked := slices.Clone(results), slices.Clone(settled)
	mu.Unlock()
	if all {
		p.isolateTooLarge(ctx, b.Messages, recs, outcomes)
	}

	failed := make(map[string]error)
	stopped := make(map[string]bool) // aggregates whose earlier message failed
	for i, m := range b.Messages {
		key := cloudevent.Key(m)
		if stopped[key] {
			failed[m.EventID] = outbox.ErrNotAttempted
			continue
		}
		err := outcomes[i]
		if !acked[i] {
			err = fmt.Errorf("outboxkafka: publish %s: no acknowledgement before the context ended: %w", m.EventID, context.Cause(ctx))
		}
		if err != nil {
			stopped[key] = true
			failed[m.EventID] = classify(err)
		}
	}
	if len(failed) == 0 {
		return nil
	}
	return &outbox.PartialError{Failed: failed}
}

// produceError names the message and topic of a failed produce.
func produceError(m outbox.Message, rec *kgo.Record, err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("outboxkafka: publish %s to %s: %w", m.EventID, rec.Topic, err)
}

// isolateTooLarge produces again, one at a time and in batch order, the
// records that the broker refused as too large when several were: the
// broker refuses a record batch whole, so that only a record refused on
// its own is known to be too large, and the others of its batch deserve
// another try. A record behind a failed one of its aggregate is left
// failed (it is reported not attempted). outcomes is updated in place.
func (p *Publisher) isolateTooLarge(ctx context.Context, msgs []outbox.Message, recs []*kgo.Record, outcomes []error) {
	suspect := func(i int) bool {
		return recs[i] != nil && (errors.Is(outcomes[i], kerr.MessageTooLarge) || errors.Is(outcomes[i], kerr.RecordListTooLarge))
	}
	suspects := 0
	for i := range msgs {
		if suspect(i) {
			suspects++
		}
	}
	if suspects < 2 {
		return
	}
	stopped := make(map[string]bool)
	for i, m := range msgs {
		key := cloudevent.Key(m)
		if stopped[key] {
			continue
		}
		if suspect(i) {
			r := recs[i]
			outcomes[i] = produceError(m, r, p.produceOne(ctx, &kgo.Record{Topic: r.Topic, Key: r.Key, Value: r.Value, Headers: r.Headers}))
		}
		if outcomes[i] != nil {
			stopped[key] = true
		}
	}
}

// produceOne produces rec and waits for its acknowledgement, or for ctx to
// end.
func (p *Publisher) produceOne(ctx context.Context, rec *kgo.Record) error {
	acked := make(chan error, 1)
	p.cl.Produce(ctx, rec, func(_ *kgo.Record, err error) { acked <- err })
	select {
	case err := <-acked:
		return err
	case <-ctx.Done():
		return fmt.Errorf("no acknowledgement before the context ended: %w", context.Cause(ctx))
	}
}

// record builds m's record, or says why m cannot be sent; such an error is
// permanent.
func (p *Publisher) record(m outbox.Message) (*kgo.Record, error) {
	topic := p.topic(m)
	if err := validTopic(topic); err != nil {
		return nil, outbox.Permanent(fmt.Errorf("outboxkafka: publish %s: %w", m.EventID, err))
	}
	attrs := cloudevent.Attributes(m, p.source)
	headers := make([]kgo.RecordHeader, 0, len(attrs)+len(m.Headers))
	for _, a := range attrs {
		name := HeaderPrefix + a.Name
		if a.Name == "datacontenttype" {
			name = HeaderContentType
		}
		headers = append(headers, kgo.RecordHeader{Key: name, Value: []byte(a.Value)})
	}
	for _, name := range sortedKeys(m.Headers) {
		if p.reserved[strings.ToLower(name)] {
			return nil, outbox.Permanent(fmt.Errorf("outboxkafka: publish %s: header %q: %w", m.EventID, name, ErrReservedHeader))
		}
		headers = append(headers, kgo.RecordHeader{Key: name, Value: []byte(m.Headers[name])})
	}
	rec := &kgo.Record{Topic: topic, Key: []byte(cloudevent.Key(m)), Value: m.Payload, Headers: headers}
	if size, limit := encodedSizeBound(rec), int(p.maxBytes(topic)); size > limit {
		return nil, outbox.Permanent(fmt.Errorf("outboxkafka: publish %s: record of up to %d bytes exceeds the client's ProducerBatchMaxBytes of %d: %w", m.EventID, size, limit, kerr.MessageTooLarge))
	}
	return rec, nil
}

// encodedSizeBound is an upper bound of the size of a record batch that
// holds only rec, as franz-go compares it with ProducerBatchMaxBytes.
func encodedSizeBound(rec *kgo.Record) int {
	n := batchOverhead + maxVarint + 1 + maxVarlong + maxVarint // length, attributes, timestamp and offset deltas
	n += maxVarint + len(rec.Key) + maxVarint + len(rec.Value) + maxVarint
	for _, h := range rec.Headers {
		n += maxVarint + len(h.Key) + maxVarint + len(h.Value)
	}
	return n
}

// validTopic reports why topic is not a legal Kafka topic name.
func validTopic(topic string) error {
	if topic == "" || topic == "." || topic == ".." || len(topic) > 249 {
		return fmt.Errorf("invalid topic %q: must be 1 to 249 characters, not \".\" or \"..\": %w", topic, kerr.InvalidTopicException)
	}
	for _, r := range topic {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-') {
			return fmt.Errorf("invalid topic %q: %q is not one of a-z, A-Z, 0-9, '.', '_', '-': %w", topic, r, kerr.InvalidTopicException)
		}
	}
	return nil
}

// permanentErrors are the Kafka errors that sending the same record again
// cannot cure.
var permanentErrors = []error{
	kerr.MessageTooLarge,
	kerr.RecordListTooLarge,
	kerr.InvalidTopicException,
	kerr.InvalidRecord,
	kerr.TopicAuthorizationFailed,
	kerr.ClusterAuthorizationFailed,
	kerr.TransactionalIDAuthorizationFailed,
	kerr.SaslAuthenticationFailed,
	kerr.PolicyViolation,
	kerr.UnsupportedForMessageFormat,
}

// classify marks err permanent when it is one of permanentErrors.
func classify(err error) error {
	if outbox.IsPermanent(err) {
		return err
	}
	for _, p := range permanentErrors {
		if errors.Is(err, p) {
			return outbox.Permanent(err)
		}
	}
	return err
}

func sortedKeys(h map[string]string) []string {
	keys := make([]string, 0, len(h))
	for k := range h {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}
