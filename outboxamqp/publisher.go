package outboxamqp

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/cloudevent"
)

// HeaderPrefix is the prefix of every CloudEvents attribute header, as the
// CloudEvents AMQP binding names application properties:
// "cloudEvents_id", "cloudEvents_type", ...
const HeaderPrefix = "cloudEvents_"

// DefaultExchange is the exchange messages are published to unless
// [WithExchange] is given: the topic exchange every RabbitMQ server has.
const DefaultExchange = "amq.topic"

// ErrReturned is wrapped by the failure of a message the broker returned
// as unroutable (mandatory is set and no queue is bound for its routing
// key). It is retryable: the message is sent again once the dispatcher's
// backoff has passed, whatever the broker's confirm said.
var ErrReturned = errors.New("outboxamqp: message returned unroutable")

// ErrNacked is wrapped by the failure of a message the broker negatively
// acknowledged (an internal error, a queue that rejects publishes when
// full). It is retryable.
var ErrNacked = errors.New("outboxamqp: message nacked by the broker")

// returnBuffer is how many returned messages a channel holds before
// they are read: returns arrive before the confirm of the same message.
const returnBuffer = 1024

// Publisher publishes each message of a batch to one exchange on a
// channel of its own, in confirm mode. It implements [outbox.Publisher]
// and is safe for concurrent use; batches are published one at a time.
type Publisher struct {
	conn       *amqp.Connection
	exchange   string
	routingKey func(outbox.Message) string
	source     string

	mu sync.Mutex // serialises batches and guards ch
	ch *channel   // nil until the first batch, and after a close
}

var _ outbox.Publisher = (*Publisher)(nil)

// channel is a confirm-mode channel with its returns and close
// notifications.
type channel struct {
	ch      *amqp.Channel
	returns chan amqp.Return
	closed  chan *amqp.Error
	reason  *amqp.Error // why it closed, once read from closed
}

// Option configures a [Publisher]. An invalid option makes [New] fail with
// an error that wraps [outbox.ErrInvalidOption] and names the option.
type Option func(*config) error

type config struct {
	exchange   string
	routingKey func(outbox.Message) string
	source     string
}

// WithExchange sets the exchange every message is published to. The
// exchange must exist (the publisher declares nothing); "" is the default
// exchange, which routes by queue name. name must be at most 127
// characters of letters, digits, '-', '_', '.' and ':'.
//
// Default: [DefaultExchange] ("amq.topic").
func WithExchange(name string) Option {
	return func(c *config) error {
		if len(name) > 127 || strings.IndexFunc(name, func(r rune) bool {
			return !('a' <= r && r <= 'z' || 'A' <= r && r <= 'Z' || '0' <= r && r <= '9' || strings.ContainsRune("-_.:", r))
		}) >= 0 {
			return fmt.Errorf("%w: WithExchange: invalid exchange name %q", outbox.ErrInvalidOption, name)
		}
		c.exchange = name
		return nil
	}
}

// WithRoutingKey makes the publisher route each message with the key f
// returns for it. f must not be nil. A key longer than 255 bytes fails
// that message permanently.
//
// Default: the event type, for example "order.created", which topic
// exchange bindings such as "order.*" select.
func WithRoutingKey(f func(outbox.Message) string) Option {
	return func(c *config) error {
		if f == nil {
			return fmt.Errorf("%w: WithRoutingKey: function is nil", outbox.ErrInvalidOption)
		}
		c.routingKey = f
		return nil
	}
}

// WithSource sets the CloudEvents source attribute of every message. It
// must be a non-empty URI-reference without white space or control
// characters.
//
// Default: [cloudevent.DefaultSource] ("gorm-outbox").
func WithSource(source string) Option {
	return func(c *config) error {
		if err := cloudevent.CheckSource(source); err != nil {
			return fmt.Errorf("%w: WithSource: %w", outbox.ErrInvalidOption, err)
		}
		c.source = source
		return nil
	}
}

// New returns a publisher that publishes on conn. conn must not be nil;
// it stays the caller's to close. The publisher opens its channel on the
// first batch, and a new one on the next batch after the channel closed.
func New(conn *amqp.Connection, opts ...Option) (*Publisher, error) {
	if conn == nil {
		return nil, fmt.Errorf("%w: conn: connection is nil", outbox.ErrInvalidOption)
	}
	cfg := config{
		exchange:   DefaultExchange,
		routingKey: func(m outbox.Message) string { return m.EventType },
		source:     cloudevent.DefaultSource,
	}
	for _, opt := range opts {
		if err := opt(&cfg); err != nil {
			return nil, err
		}
	}
	return &Publisher{conn: conn, exchange: cfg.exchange, routingKey: cfg.routingKey, source: cfg.source}, nil
}

// Close closes the publisher's channel, if open. The connection is left
// open. A batch published after Close opens a new channel.
func (p *Publisher) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ch == nil {
		return nil
	}
	err := p.ch.ch.Close()
	p.ch = nil
	if err != nil && !errors.Is(err, amqp.ErrClosed) {
		return fmt.Errorf("outboxamqp: close channel: %w", err)
	}
	return nil
}

// open returns the publisher's channel, opening one in confirm mode when
// there is none or it was closed.
func (p *Publisher) open() (*channel, error) {
	if p.ch != nil && !p.ch.ch.IsClosed() {
		return p.ch, nil
	}
	p.ch = nil
	ch, err := p.conn.Channel()
	if err != nil {
		return nil, classifyClose(fmt.Errorf("outboxamqp: open channel: %w", err), err)
	}
	if err := ch.Confirm(false); err != nil {
		_ = ch.Close()
		return nil, classifyClose(fmt.Errorf("outboxamqp: confirm mode: %w", err), err)
	}
	c := &channel{
		ch:      ch,
		returns: ch.NotifyReturn(make(chan amqp.Return, returnBuffer)),
		closed:  ch.NotifyClose(make(chan *amqp.Error, 1)),
	}
	p.ch = c
	return c, nil
}

// discard drops c after a batch left confirms outstanding, so that their
// late confirms and returns cannot be taken for a later batch's. The close
// runs in the background, reading returns meanwhile, so that it neither
// holds up the caller nor blocks on an unread return.
func (p *Publisher) discard(c *channel) {
	if p.ch == c {
		p.ch = nil
	}
	go func() {
		done := make(chan struct{})
		go func() {
			defer close(done)
			_ = c.ch.Close()
		}()
		for {
			select {
			case <-c.returns:
			case <-done:
				return
			}
		}
	}()
}

// sent is a message published in this batch, waiting for its confirm.
type sent struct {
	m  outbox.Message
	dc *amqp.DeferredConfirmation
}

// Publish publishes every message of b with mandatory set, persistent,
// then waits for the broker's confirms of all of them or the end of ctx.
// It returns nil when the broker confirmed every message and returned
// none, and otherwise an [*outbox.PartialError] naming each message that
// was not accepted:
//
//   - permanent ([outbox.IsPermanent]): a message larger than the
//     broker's max_message_size, a publish refused for lack of permission
//     (ACCESS_REFUSED), a routing key or header AMQP cannot carry;
//   - retryable: a returned (unroutable) message ([ErrReturned]), a nack
//     ([ErrNacked]), a closed channel or connection, an exchange that does
//     not exist, the end of ctx before the confirm;
//   - [outbox.ErrNotAttempted]: a message after a failed one of its
//     aggregate in the batch. When it was not sent yet, it is not sent;
//     when it was sent and confirmed, it is reported all the same, so that
//     the dispatcher sends it again after the failed one, and a consumer
//     gets it twice: RabbitMQ does not deduplicate.
//
// When the connection is closed, or a channel cannot be opened, Publish
// returns that error (retryable) for the whole batch. No publish outlives
// ctx: once it ends, messages not yet sent are not attempted, those
// without a confirm fail with ctx's error, and the channel is replaced at
// the next batch.
func (p *Publisher) Publish(ctx context.Context, b outbox.Batch) error {
	if len(b.Messages) == 0 {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	c, err := p.open()
	if err != nil {
		return err
	}
	drain(c.returns, nil)

	failed := map[string]error{}
	blocked := map[string]bool{}
	fail := func(m outbox.Message, err error) {
		failed[m.EventID] = err
		blocked[cloudevent.Key(m)] = true
	}
	var pending []sent
	for _, m := range b.Messages {
		if blocked[cloudevent.Key(m)] || ctx.Err() != nil {
			failed[m.EventID] = outbox.ErrNotAttempted
			continue
		}
		key := p.routingKey(m)
		msg, err := p.publishing(m, key)
		if err != nil {
			fail(m, outbox.Permanent(fmt.Errorf("outboxamqp: publish %s: %w", m.EventID, err)))
			continue
		}
		dc, err := c.ch.PublishWithDeferredConfirmWithContext(ctx, p.exchange, key, true, false, msg)
		if err != nil {
			fail(m, classifyClose(fmt.Errorf("outboxamqp: publish %s: %w", m.EventID, err), err))
			continue
		}
		pending = append(pending, sent{m: m, dc: dc})
	}

	returned := map[string]amqp.Return{}
	abandoned := false
	var closeErr *amqp.Error
	culpritFound := false
	for _, s := range pending {
		if !abandoned && !waitConfirm(ctx, s.dc, c.returns, returned) {
			abandoned = true
		}
		if abandoned && !isDone(s.dc) {
			fail(s.m, fmt.Errorf("outboxamqp: publish %s: waiting for the confirm: %w", s.m.EventID, ctx.Err()))
			continue
		}
		// The broker sends a return before the confirm of its message.
		drain(c.returns, returned)
		switch r, isReturned := returned[s.m.EventID]; {
		case isReturned:
			fail(s.m, fmt.Errorf("%w: %s to exchange %q with routing key %q: %d %s",
				ErrReturned, s.m.EventID, r.Exchange, r.RoutingKey, r.ReplyCode, r.ReplyText))
		case s.dc.Acked():
		case c.ch.IsClosed():
			if closeErr == nil {
				closeErr = closeReason(c)
			}
			err := fmt.Errorf("outboxamqp: publish %s: channel closed: %w", s.m.EventID, closeErr)
			if !culpritFound {
				// The broker closes the channel at the message it refuses;
				// the ones after it were discarded unprocessed.
				culpritFound = true
				fail(s.m, classifyClose(err, closeErr))
			} else {
				fail(s.m, err)
			}
		default:
			fail(s.m, fmt.Errorf("%w: %s", ErrNacked, s.m.EventID))
		}
	}
	if abandoned {
		p.discard(c)
	}

	// Every message after a failed one of its aggregate goes back as not
	// attempted, whatever became of it, so that it comes again after the
	// failed one.
	seenFailure := map[string]bool{}
	for _, m := range b.Messages {
		key := cloudevent.Key(m)
		switch _, bad := failed[m.EventID]; {
		case seenFailure[key] && (!bad || !errors.Is(failed[m.EventID], outbox.ErrNotAttempted)):
			failed[m.EventID] = fmt.Errorf("%w: after a failed message of its aggregate", outbox.ErrNotAttempted)
		case bad:
			seenFailure[key] = true
		}
	}
	if len(failed) == 0 {
		return nil
	}
	return &outbox.PartialError{Failed: failed}
}

// waitConfirm waits for dc, recording returns meanwhile; it reports false
// when ctx ended first.
func waitConfirm(ctx context.Context, dc *amqp.DeferredConfirmation, returns <-chan amqp.Return, returned map[string]amqp.Return) bool {
	for {
		select {
		case <-dc.Done():
			return true
		case r, ok := <-returns:
			if ok {
				returned[r.MessageId] = r
			} else {
				returns = nil // closed with the channel
			}
		case <-ctx.Done():
			return isDone(dc)
		}
	}
}

func isDone(dc *amqp.DeferredConfirmation) bool {
	select {
	case <-dc.Done():
		return true
	default:
		return false
	}
}

// drain takes the returns already delivered, recording them in returned
// when it is not nil.
func drain(returns <-chan amqp.Return, returned map[string]amqp.Return) {
	for {
		select {
		case r, ok := <-returns:
			if !ok {
				return
			}
			if returned != nil {
				returned[r.MessageId] = r
			}
		default:
			return
		}
	}
}

// closeReason returns why c was closed, as the broker or the client said.
func closeReason(c *channel) *amqp.Error {
	if c.reason != nil {
		return c.reason
	}
	select {
	case e, ok := <-c.closed:
		if ok && e != nil {
			c.reason = e
			return e
		}
	default:
	}
	return amqp.ErrClosed
}

// classifyClose marks as permanent the failures that retrying cannot
// help: the broker refused access, or a message over its size limit.
func classifyClose(wrapped, cause error) error {
	var ae *amqp.Error
	if !errors.As(cause, &ae) {
		return wrapped
	}
	switch {
	case ae.Code == amqp.AccessRefused:
		return outbox.Permanent(wrapped)
	case ae.Code == amqp.PreconditionFailed && strings.Contains(ae.Reason, "max size"):
		return outbox.Permanent(wrapped)
	}
	return wrapped
}

// publishing builds the AMQP message of m: the payload as the body, the
// event's own headers, then the CloudEvents attributes as cloudEvents_
// headers, with datacontenttype in the content-type property.
func (p *Publisher) publishing(m outbox.Message, key string) (amqp.Publishing, error) {
	if len(key) > 255 {
		return amqp.Publishing{}, fmt.Errorf("routing key of %d bytes, more than 255", len(key))
	}
	if len(m.EventType) > 255 || len(m.EventID) > 255 {
		return amqp.Publishing{}, errors.New("event id or type longer than 255 bytes")
	}
	h := make(amqp.Table, len(m.Headers)+10)
	for k, v := range m.Headers {
		if k == "" || len(k) > 128 {
			return amqp.Publishing{}, fmt.Errorf("header name %q cannot be carried by AMQP", k)
		}
		h[k] = v
	}
	for _, a := range cloudevent.Attributes(m, p.source) {
		if a.Name == "datacontenttype" {
			continue
		}
		h[HeaderPrefix+a.Name] = a.Value
	}
	return amqp.Publishing{
		Headers:      h,
		ContentType:  cloudevent.ContentType,
		DeliveryMode: amqp.Persistent,
		MessageId:    m.EventID,
		Type:         m.EventType,
		Timestamp:    m.OccurredAt,
		Body:         m.Payload,
	}, nil
}
