package outboxredis

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/cloudevent"
)

// FieldData is the stream field that holds the event's payload, byte for
// byte.
const FieldData = "data"

// HeaderFieldPrefix precedes the name of each of the event's own headers:
// the header traceparent is the field "header.traceparent", so that no
// header collides with an attribute field.
const HeaderFieldPrefix = "header."

// DefaultStreamPrefix precedes the aggregate type in the default stream
// key: the events of aggregate type "order" go to "outbox:order".
const DefaultStreamPrefix = "outbox:"

// defaultMaxBulkLen is Redis's default proto-max-bulk-len, assumed when the
// server does not say (CONFIG may be disabled).
const defaultMaxBulkLen = 512 << 20

// ErrTooLarge is returned (wrapped, and marked [outbox.Permanent]) for a
// message with a payload or header longer than the server accepts in one
// argument (its proto-max-bulk-len, 512 MiB by default). Such a message is
// not sent: Redis would drop the connection, and the rest of the batch with
// it.
var ErrTooLarge = errors.New("outboxredis: message larger than the server accepts")

// Publisher appends each message of a batch as one entry to a Redis stream
// with XADD. It implements [outbox.Publisher] and is safe for concurrent
// use.
type Publisher struct {
	rdb    redis.UniversalClient
	stream func(outbox.Message) string
	source string
	maxLen int64

	mu       sync.Mutex  // guards server
	server   *serverInfo // nil until the server has answered
	maxBytes int64       // a test's lower bound in place of the server's limit, or 0
}

// serverInfo is what the publisher learns from the server once.
type serverInfo struct {
	idmp       bool  // XADD takes IDMP (Redis 8.6 and later)
	maxBulkLen int64 // proto-max-bulk-len
}

var _ outbox.Publisher = (*Publisher)(nil)

// Option configures a [Publisher]. An option given an invalid value makes
// [New] fail with an error that wraps [outbox.ErrInvalidOption] and names
// the option.
type Option func(*config) error

type config struct {
	stream func(outbox.Message) string
	source string
	maxLen int64
}

// WithStream routes each message to the stream key fn returns. fn must not
// be nil. An empty key fails that message with a permanent error, and it
// is not sent. Entries keep their aggregate's order within one stream:
// route all of an aggregate's events to the same one.
//
// Default: [DefaultStreamPrefix] followed by the aggregate type
// ("outbox:order").
func WithStream(fn func(outbox.Message) string) Option {
	return func(c *config) error {
		if fn == nil {
			return fmt.Errorf("%w: WithStream: nil function", outbox.ErrInvalidOption)
		}
		c.stream = fn
		return nil
	}
}

// WithSource sets the CloudEvents source attribute (the source field) of
// every event. It must be a non-empty URI-reference without white space
// or control characters, such as "https://shop.example/orders" or
// "/orders". On a server with idempotent
// adds it is also the IDMP producer ID.
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

// WithMaxLen caps each stream at about n entries: every XADD trims the
// stream with MAXLEN ~ n, which keeps at least n of the newest entries and
// removes older ones in whole internal nodes. Entries are removed whether
// or not a consumer has read them, so n must comfortably exceed what
// consumers can fall behind. n must be positive.
//
// Default: no cap; streams grow until trimmed by someone else.
func WithMaxLen(n int64) Option {
	return func(c *config) error {
		if n <= 0 {
			return fmt.Errorf("%w: WithMaxLen: %d is not positive", outbox.ErrInvalidOption, n)
		}
		c.maxLen = n
		return nil
	}
}

// New returns a publisher that appends through rdb, which must not be nil
// and stays the caller's to close (after the dispatcher has stopped).
// Create rdb with ContextTimeoutEnabled, so that its connections honour the
// deadline of each Publish. New does not talk to the server: the first
// Publish asks it whether XADD supports IDMP and how long an argument may
// be. It fails with an error wrapping [outbox.ErrInvalidOption] when rdb or
// an option is invalid.
func New(rdb redis.UniversalClient, opts ...Option) (*Publisher, error) {
	if rdb == nil {
		return nil, fmt.Errorf("%w: outboxredis.New: nil redis.UniversalClient", outbox.ErrInvalidOption)
	}
	c := config{
		stream: func(m outbox.Message) string { return DefaultStreamPrefix + m.AggregateType },
		source: cloudevent.DefaultSource,
	}
	for _, opt := range opts {
		if err := opt(&c); err != nil {
			return nil, err
		}
	}
	return &Publisher{rdb: rdb, stream: c.stream, source: c.source, maxLen: c.maxLen}, nil
}

// Idempotent reports whether the server supports idempotent adds (XADD
// IDMP, Redis 8.6 and later), so that an event published twice is stored
// once. It asks the server on the first call, as Publish does, and
// remembers the answer.
func (p *Publisher) Idempotent(ctx context.Context) (bool, error) {
	info, err := p.serverInfo(ctx)
	if err != nil {
		return false, err
	}
	return info.idmp, nil
}

// Publish sends every message of b in one pipeline of XADD commands and
// waits for their replies or for ctx to end, whichever comes first: it
// never waits past ctx's deadline.
//
// It returns nil when every entry was added (or, with IDMP, found already
// added). Otherwise it returns an [*outbox.PartialError]: the first failed
// message of an aggregate carries its error, and the later messages of
// that aggregate in b carry [outbox.ErrNotAttempted], whether or not Redis
// had added them (see the package documentation for what a consumer then
// sees). A message without a reply when ctx ends fails with ctx's error:
// it may have been added, and is delivered again.
func (p *Publisher) Publish(ctx context.Context, b outbox.Batch) error {
	if len(b.Messages) == 0 {
		return nil
	}
	info, err := p.serverInfo(ctx)
	if err != nil {
		return err
	}
	results := make([]error, len(b.Messages))
	cmds := make([]*redis.StringCmd, len(b.Messages))
	refused := make(map[string]bool) // aggregates with a message refused here
	pipe := p.rdb.Pipeline()
	for i, m := range b.Messages {
		key := cloudevent.Key(m)
		if refused[key] {
			results[i] = outbox.ErrNotAttempted
			continue
		}
		args, err := p.xadd(m, info)
		if err != nil {
			refused[key] = true
			results[i] = err
			continue
		}
		cmds[i] = pipe.XAdd(ctx, args)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, _ = pipe.Exec(ctx) // each command carries its own error
	}()
	var timedOut bool
	select {
	case <-done:
	case <-ctx.Done():
		timedOut = true
	}

	failed := make(map[string]error)
	stopped := make(map[string]bool) // aggregates whose earlier message failed
	for i, m := range b.Messages {
		key := cloudevent.Key(m)
		if stopped[key] {
			failed[m.EventID] = outbox.ErrNotAttempted
			continue
		}
		err := results[i]
		switch {
		case cmds[i] == nil:
		case timedOut || cmds[i].Err() != nil && !isReply(cmds[i].Err()) && ended(ctx):
			err = fmt.Errorf("outboxredis: publish %s: no reply before the context ended: %w", m.EventID, endCause(ctx))
		case cmds[i].Err() != nil:
			err = classify(fmt.Errorf("outboxredis: publish %s to %s: %w", m.EventID, cmds[i].Args()[1], cmds[i].Err()))
		}
		if err != nil {
			stopped[key] = true
			failed[m.EventID] = err
		}
	}
	if len(failed) == 0 {
		return nil
	}
	return &outbox.PartialError{Failed: failed}
}

// xadd builds m's XADD, or says why m cannot be sent; such an error is
// permanent.
func (p *Publisher) xadd(m outbox.Message, info *serverInfo) (*redis.XAddArgs, error) {
	stream := p.stream(m)
	if stream == "" {
		return nil, outbox.Permanent(fmt.Errorf("outboxredis: publish %s: empty stream key", m.EventID))
	}
	limit := info.maxBulkLen
	if p.maxBytes > 0 {
		limit = p.maxBytes
	}
	attrs := cloudevent.Attributes(m, p.source)
	values := make([]any, 0, 2*(len(attrs)+len(m.Headers)+1))
	for _, a := range attrs {
		values = append(values, a.Name, a.Value)
	}
	names := make([]string, 0, len(m.Headers))
	for name := range m.Headers {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		field, v := HeaderFieldPrefix+name, m.Headers[name]
		if int64(len(field)) > limit || int64(len(v)) > limit {
			return nil, outbox.Permanent(fmt.Errorf("outboxredis: publish %s: header %q is longer than proto-max-bulk-len %d: %w", m.EventID, name, limit, ErrTooLarge))
		}
		values = append(values, field, v)
	}
	if int64(len(m.Payload)) > limit {
		return nil, outbox.Permanent(fmt.Errorf("outboxredis: publish %s: payload of %d bytes is longer than proto-max-bulk-len %d: %w", m.EventID, len(m.Payload), limit, ErrTooLarge))
	}
	values = append(values, FieldData, []byte(m.Payload))
	args := &redis.XAddArgs{Stream: stream, Values: values}
	if p.maxLen > 0 {
		args.MaxLen, args.Approx = p.maxLen, true
	}
	if info.idmp {
		args.ProducerID, args.IdempotentID = p.source, m.EventID
	}
	return args, nil
}

// serverInfo asks the server what it supports, until it has answered
// once; it returns by the end of ctx, whether or not the client honours
// ctx's deadline.
func (p *Publisher) serverInfo(ctx context.Context) (*serverInfo, error) {
	p.mu.Lock()
	known := p.server
	p.mu.Unlock()
	if known != nil {
		return known, nil
	}
	type answer struct {
		info *serverInfo
		err  error
	}
	answered := make(chan answer, 1)
	go func() {
		info, err := p.askServer(ctx)
		answered <- answer{info, err}
	}()
	select {
	case a := <-answered:
		if a.err != nil {
			return nil, a.err
		}
		p.mu.Lock()
		defer p.mu.Unlock()
		if p.server == nil {
			p.server = a.info
		}
		return p.server, nil
	case <-ctx.Done():
		return nil, fmt.Errorf("outboxredis: publish: ask the server its version: %w", context.Cause(ctx))
	}
}

// askServer reads the server's version, and its proto-max-bulk-len where
// CONFIG is allowed (managed servers often disable it: the default holds
// then).
func (p *Publisher) askServer(ctx context.Context) (*serverInfo, error) {
	text, err := p.rdb.Info(ctx, "server").Result()
	if err != nil {
		return nil, classify(fmt.Errorf("outboxredis: publish: ask the server its version: %w", err))
	}
	info := &serverInfo{idmp: supportsIDMP(text), maxBulkLen: defaultMaxBulkLen}
	if cfg, err := p.rdb.ConfigGet(ctx, "proto-max-bulk-len").Result(); err == nil {
		if n, err := strconv.ParseInt(cfg["proto-max-bulk-len"], 10, 64); err == nil && n > 0 {
			info.maxBulkLen = n
		}
	}
	return info, nil
}

// supportsIDMP reads redis_version from INFO server: IDMP came with 8.6.
func supportsIDMP(info string) bool {
	for line := range strings.Lines(info) {
		v, ok := strings.CutPrefix(strings.TrimSpace(line), "redis_version:")
		if !ok {
			continue
		}
		parts := strings.SplitN(v, ".", 3)
		if len(parts) < 2 {
			return false
		}
		major, err1 := strconv.Atoi(parts[0])
		minor, err2 := strconv.Atoi(parts[1])
		return err1 == nil && err2 == nil && (major > 8 || major == 8 && minor >= 6)
	}
	return false
}

// ended reports whether ctx is done or past its deadline: a connection
// that honours the deadline may time out a moment before ctx's own timer.
func ended(ctx context.Context) bool {
	deadline, ok := ctx.Deadline()
	return ctx.Err() != nil || ok && !time.Now().Before(deadline)
}

// endCause is why ctx ended, for a ctx that [ended].
func endCause(ctx context.Context) error {
	if err := context.Cause(ctx); err != nil {
		return err
	}
	return context.DeadlineExceeded
}

// isReply reports whether err is an error reply of the server, rather
// than a failure to reach it.
func isReply(err error) bool {
	var reply redis.Error
	return errors.As(err, &reply)
}

// permanentPrefixes are the Redis error replies that sending the same
// command again cannot cure: authorization refused, or a key of another
// type where the stream should be.
var permanentPrefixes = []string{"NOPERM", "NOAUTH", "WRONGPASS", "WRONGTYPE"}

// classify marks err permanent when Redis replied with one of
// permanentPrefixes.
func classify(err error) error {
	for _, prefix := range permanentPrefixes {
		if redis.HasErrorPrefix(err, prefix) {
			return outbox.Permanent(err)
		}
	}
	return err
}
