package outboxnats

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/cloudevent"
)

// HeaderPrefix is the prefix of every CloudEvents attribute header, as the
// CloudEvents NATS binding names them: "ce-id", "ce-type", ...
const HeaderPrefix = "ce-"

// DefaultSubjectPrefix is the start of the default subject: a message is
// published to DefaultSubjectPrefix + its event type, for example
// "outbox.order.created", unless [WithSubject] is given.
const DefaultSubjectPrefix = "outbox."

// defaultStallWait bounds how long one asynchronous publish waits for room
// among the JetStream context's pending acks when ctx has no deadline.
const defaultStallWait = 30 * time.Second

// jsErrCodeMessageTooLarge is the JetStream API error code of a message
// larger than the stream's max_msg_size.
const jsErrCodeMessageTooLarge jetstream.ErrorCode = 10054

// Publisher publishes each message of a batch to a JetStream stream. It
// implements [outbox.Publisher] and is safe for concurrent use.
type Publisher struct {
	js      jetstream.JetStream
	subject func(outbox.Message) string
	source  string
}

var _ outbox.Publisher = (*Publisher)(nil)

// Option configures a [Publisher]. An invalid option makes [New] fail with
// an error that wraps [outbox.ErrInvalidOption] and names the option.
type Option func(*config) error

type config struct {
	subject func(outbox.Message) string
	source  string
}

// WithSubject makes the publisher send each message to the subject f
// returns for it. f must not be nil. A subject that is not a valid NATS
// subject for publishing (empty, with white space, an empty token or a
// wildcard) fails that message permanently.
//
// Default: [DefaultSubjectPrefix] followed by the event type.
func WithSubject(f func(outbox.Message) string) Option {
	return func(c *config) error {
		if f == nil {
			return fmt.Errorf("%w: WithSubject: function is nil", outbox.ErrInvalidOption)
		}
		c.subject = f
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

// New returns a publisher that publishes through js. js must not be nil;
// the streams that bind the subjects are the caller's to create, with the
// duplicate window that the deduplication should cover.
func New(js jetstream.JetStream, opts ...Option) (*Publisher, error) {
	if js == nil {
		return nil, fmt.Errorf("%w: js: JetStream is nil", outbox.ErrInvalidOption)
	}
	cfg := config{
		subject: func(m outbox.Message) string { return DefaultSubjectPrefix + m.EventType },
		source:  cloudevent.DefaultSource,
	}
	for _, opt := range opts {
		if err := opt(&cfg); err != nil {
			return nil, err
		}
	}
	return &Publisher{js: js, subject: cfg.subject, source: cfg.source}, nil
}

// Publish sends every message of b asynchronously, then waits for all the
// acknowledgements or the end of ctx, whichever comes first. It returns nil
// when the stream stored every message (a PubAck marked duplicate counts as
// stored), and otherwise an [*outbox.PartialError] naming each message that
// was not:
//
//   - permanent ([outbox.IsPermanent]): a message larger than the
//     connection's max_payload or the stream's max_msg_size, a subject that
//     is invalid, a header of the event that NATS cannot carry, and a
//     publish the server refused for lack of permission;
//   - retryable: no stream answered on the subject, the connection is
//     closed or reconnecting, an ack timed out, ctx ended before the ack;
//   - [outbox.ErrNotAttempted]: a message that follows a failed one of its
//     aggregate in the batch. When it was not sent yet, it is not sent.
//     When it was already sent and stored, it is reported all the same, so
//     the dispatcher sends it again after the failed one: within the
//     stream's duplicate window the stream drops that copy, so a consumer
//     sees that aggregate's later event once, before the failed one.
//
// Messages are published in batch order on one connection, without the
// client's retries, so a stream stores the messages of one aggregate in
// sequence order, save those sent after one that failed (above). No publish outlives ctx: once it ends, messages not yet
// sent are reported as not attempted and those without an ack as failed
// with ctx's error.
func (p *Publisher) Publish(ctx context.Context, b outbox.Batch) error {
	if len(b.Messages) == 0 {
		return nil
	}
	failed := map[string]error{}
	blocked := map[string]bool{} // aggregate keys with a failed message
	futures := make([]jetstream.PubAckFuture, len(b.Messages))
	fail := func(m outbox.Message, err error) {
		failed[m.EventID] = err
		blocked[cloudevent.Key(m)] = true
	}

	stall := defaultStallWait
	if dl, ok := ctx.Deadline(); ok {
		stall = max(time.Until(dl), time.Millisecond)
	}
	for i, m := range b.Messages {
		if blocked[cloudevent.Key(m)] || ctx.Err() != nil {
			failed[m.EventID] = outbox.ErrNotAttempted
			continue
		}
		msg, err := p.message(m)
		if err != nil {
			fail(m, outbox.Permanent(fmt.Errorf("outboxnats: publish %s: %w", m.EventID, err)))
			continue
		}
		f, err := p.js.PublishMsgAsync(msg,
			jetstream.WithMsgID(m.EventID),
			jetstream.WithRetryAttempts(0),
			jetstream.WithStallWait(stall))
		if err != nil {
			fail(m, classify(m, msg.Subject, err, p.js.Conn()))
			continue
		}
		futures[i] = f
	}

	for i, f := range futures {
		if f == nil {
			continue
		}
		m := b.Messages[i]
		err := wait(ctx, f)
		if err != nil {
			fail(m, classify(m, f.Msg().Subject, err, p.js.Conn()))
		}
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

// wait returns nil once f is acknowledged (a duplicate included), the
// publish error, or ctx's error when ctx ends first.
func wait(ctx context.Context, f jetstream.PubAckFuture) error {
	select {
	case <-f.Ok():
		return nil
	case err := <-f.Err():
		return err
	case <-ctx.Done():
	}
	// Ended together: an ack already there still counts.
	select {
	case <-f.Ok():
		return nil
	case err := <-f.Err():
		return err
	default:
		return fmt.Errorf("waiting for the ack: %w", ctx.Err())
	}
}

// classify wraps a publish error with the operation and marks the errors
// that retrying cannot help as permanent.
func classify(m outbox.Message, subject string, err error, nc *nats.Conn) error {
	err = fmt.Errorf("outboxnats: publish %s to %q: %w", m.EventID, subject, err)
	var apiErr *jetstream.APIError
	switch {
	case errors.Is(err, nats.ErrMaxPayload), errors.Is(err, nats.ErrBadSubject),
		errors.As(err, &apiErr) && apiErr.ErrorCode == jsErrCodeMessageTooLarge:
		return outbox.Permanent(err)
	case nc != nil && refused(nc.LastError(), subject):
		return outbox.Permanent(fmt.Errorf("%w (%w)", err, nc.LastError()))
	}
	return err
}

// refused reports whether last, the connection's last error, is the
// server refusing a publish to subject: NATS reports a permission
// violation on the connection, not in the publish's reply.
func refused(last error, subject string) bool {
	return last != nil && errors.Is(last, nats.ErrPermissionViolation) &&
		strings.Contains(last.Error(), `Publish to "`+subject+`"`)
}

// message builds the NATS message of m: the payload as the body, the
// event's own headers, then the CloudEvents attributes as ce- headers.
func (p *Publisher) message(m outbox.Message) (*nats.Msg, error) {
	subject := p.subject(m)
	if err := validSubject(subject); err != nil {
		return nil, err
	}
	h := make(nats.Header, len(m.Headers)+12)
	for k, v := range m.Headers {
		if !validHeaderName(k) || strings.ContainsAny(v, "\r\n") {
			return nil, fmt.Errorf("header %q cannot be carried by a NATS message", k)
		}
		h[k] = []string{v}
	}
	for _, a := range cloudevent.Attributes(m, p.source) {
		h[HeaderPrefix+a.Name] = []string{percentEncode(a.Value)}
	}
	return &nats.Msg{Subject: subject, Header: h, Data: m.Payload}, nil
}

// validSubject checks that s is a subject a message can be published to.
func validSubject(s string) error {
	if s == "" {
		return errors.New("subject is empty")
	}
	for _, tok := range strings.Split(s, ".") {
		switch {
		case tok == "":
			return fmt.Errorf("subject %q has an empty token", s)
		case tok == "*" || tok == ">":
			return fmt.Errorf("subject %q has a wildcard", s)
		case strings.IndexFunc(tok, func(r rune) bool { return r <= ' ' || r == 0x7f }) >= 0:
			return fmt.Errorf("subject %q has white space or a control character", s)
		}
	}
	return nil
}

// validHeaderName reports whether s is a non-empty header name of
// printable ASCII without ':' or white space.
func validHeaderName(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; c <= ' ' || c >= 0x7f || c == ':' {
			return false
		}
	}
	return true
}

// percentEncode encodes an attribute value as the CloudEvents NATS binding
// requires of a header value: space, double quote, percent and every byte
// outside printable ASCII become %XY (upper-case hex of each UTF-8 byte);
// every other character is kept.
func percentEncode(s string) string {
	const hex = "0123456789ABCDEF"
	first := strings.IndexFunc(s, func(r rune) bool { return needsEncoding(r) })
	if first < 0 {
		return s
	}
	var b strings.Builder
	b.Grow(len(s) + 16)
	b.WriteString(s[:first])
	for i := first; i < len(s); i++ {
		if c := s[i]; c >= 0x80 || needsEncoding(rune(c)) {
			b.WriteByte('%')
			b.WriteByte(hex[c>>4])
			b.WriteByte(hex[c&0xf])
		} else {
			b.WriteByte(c)
		}
	}
	return b.String()
}

// needsEncoding reports whether r is percent-encoded in a header value.
func needsEncoding(r rune) bool {
	return r <= ' ' || r >= 0x7f || r == '"' || r == '%'
}
