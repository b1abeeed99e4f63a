package outbox

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/gorm-outbox/outbox/internal/dialect"
)

// ErrNoHandler is wrapped, inside a [Permanent] error, by the failure that
// [Handlers] reports under [FailUnhandled] for a message whose event type has
// no handler. The message is dead-lettered for good: the retry_failed
// sweep ([Dispatcher.RetryFailed]) leaves it alone; once a handler is
// registered, a person brings it back with [Dispatcher.Requeue]
// (outboxctl requeue, the dashboard).
var ErrNoHandler = errors.New("outbox: no handler for event type")

// HandlerFunc handles one message in process. Returning nil accepts the
// message. Any error fails it and is reported as is: wrap it with
// [Permanent] to dead-letter the message, otherwise it is retried with
// backoff. A handler should honour ctx, which ends with the dispatcher's
// publish deadline.
//
// Delivery is at least once: a handler may see the same message again (same
// EventID) and should deduplicate or be idempotent.
type HandlerFunc func(ctx context.Context, m Message) error

// UnhandledPolicy says what [Handlers] does with a message whose event type
// has no handler; see [WithUnhandled].
type UnhandledPolicy int

const (
	// FailUnhandled, the default, fails a message that has no handler with
	// a [Permanent] error wrapping [ErrNoHandler]: it is dead-lettered,
	// and stays failed until, once a handler exists, a person requeues it
	// ([Dispatcher.Requeue]); [Dispatcher.RetryFailed] never revives it.
	// Like any failure, it holds back the later messages of its aggregate.
	FailUnhandled UnhandledPolicy = iota
	// SkipUnhandled accepts a message that has no handler without handling
	// it: it is marked delivered and dropped, deliberately.
	SkipUnhandled
)

// handlersConfig collects the options of [NewHandlers].
type handlersConfig struct {
	unhandled UnhandledPolicy
}

// HandlersOption configures [Handlers]; see [NewHandlers].
type HandlersOption func(*handlersConfig) error

// WithUnhandled sets what happens to a message whose event type has no
// handler (default [FailUnhandled]). Any other value than [FailUnhandled]
// or [SkipUnhandled] is invalid.
func WithUnhandled(p UnhandledPolicy) HandlersOption {
	return func(c *handlersConfig) error {
		if p != FailUnhandled && p != SkipUnhandled {
			return fmt.Errorf("%w: WithUnhandled: unknown policy %d", ErrInvalidOption, int(p))
		}
		c.unhandled = p
		return nil
	}
}

// Handlers is a [Publisher] that delivers each message in process, to the
// [HandlerFunc] registered for its event type with [Handlers.Handle]. It
// is meant for development and for consumers that live in the same process
// as the dispatcher.
//
// Publish handles the messages of a batch one at a time, in batch order, on
// the calling goroutine, and settles each message on its own:
//
//   - A message is accepted when its handler returns nil.
//   - A handler's error fails its message, unchanged: a [Permanent] error
//     dead-letters it, any other error retries it with backoff.
//   - A handler that panics is recovered; its message fails with a
//     retryable error that wraps [ErrPublisherPanic] and shows the panic
//     value. Messages of other aggregates are still handled.
//   - A message whose event type has no handler follows the
//     [UnhandledPolicy] (by default it fails permanently with
//     [ErrNoHandler]).
//   - Once a message fails, the later messages of the same aggregate
//     (AggregateType and AggregateID) in the batch are not handled and are
//     reported with [ErrNotAttempted], so a handler never sees sequence n+1
//     of an aggregate before it has accepted sequence n. Other aggregates
//     carry on.
//   - ctx is checked before each message: once it is done, each message
//     still to handle fails with ctx.Err() (retryable), or with
//     [ErrNotAttempted] when it is held back by the rule above.
//
// Publish returns nil when every message was accepted, and otherwise a
// [*PartialError] whose Failed map holds exactly the messages that were not
// accepted. It never returns any other error.
//
// The zero value is ready to use, with [FailUnhandled]. A Handlers is safe
// for concurrent use: Handle may be called while Publish runs, and a
// message sees the handlers registered when its turn comes. It must not be
// copied after first use.
type Handlers struct {
	unhandled UnhandledPolicy

	mu       sync.RWMutex
	handlers map[string]HandlerFunc
}

var _ Publisher = (*Handlers)(nil)

// NewHandlers returns a Handlers with no handler registered. It validates
// every option; an invalid one yields an error wrapping [ErrInvalidOption]
// that names it.
func NewHandlers(opts ...HandlersOption) (*Handlers, error) {
	c := handlersConfig{unhandled: FailUnhandled}
	for _, opt := range opts {
		if opt == nil {
			return nil, fmt.Errorf("%w: NewHandlers: nil option", ErrInvalidOption)
		}
		if err := opt(&c); err != nil {
			return nil, err
		}
	}
	return &Handlers{unhandled: c.unhandled, handlers: map[string]HandlerFunc{}}, nil
}

// Handle registers fn for messages of eventType. It fails, with an error
// wrapping [ErrInvalidOption], when eventType is empty, fn is nil, or
// eventType already has a handler; nothing is registered then. A handler
// cannot be replaced or removed. Handle is safe to call while Publish runs.
func (h *Handlers) Handle(eventType string, fn HandlerFunc) error {
	if eventType == "" {
		return fmt.Errorf("%w: Handlers.Handle: empty event type", ErrInvalidOption)
	}
	if fn == nil {
		return fmt.Errorf("%w: Handlers.Handle(%q): nil handler", ErrInvalidOption, eventType)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if _, dup := h.handlers[eventType]; dup {
		return fmt.Errorf("%w: Handlers.Handle(%q): a handler is already registered", ErrInvalidOption, eventType)
	}
	if h.handlers == nil {
		h.handlers = map[string]HandlerFunc{}
	}
	h.handlers[eventType] = fn
	return nil
}

// Publish hands every message of b to its handler, as described on
// [Handlers]. It returns nil when all were accepted, and otherwise a
// [*PartialError] naming exactly the messages that were not.
func (h *Handlers) Publish(ctx context.Context, b Batch) error {
	var (
		failed map[string]error
		// heldBy maps a failed aggregate to the event that failed first.
		heldBy map[dialect.Aggregate]string
	)
	for _, m := range b.Messages {
		agg := dialect.Aggregate{Type: m.AggregateType, ID: m.AggregateID}
		var err error
		if first, held := heldBy[agg]; held {
			err = fmt.Errorf("%w: event %s of aggregate %s/%s failed before it",
				ErrNotAttempted, first, m.AggregateType, m.AggregateID)
		} else if err = ctx.Err(); err == nil {
			err = h.handle(ctx, m)
		}
		if err == nil {
			continue
		}
		if failed == nil {
			failed = map[string]error{}
			heldBy = map[dialect.Aggregate]string{}
		}
		failed[m.EventID] = err
		if _, held := heldBy[agg]; !held {
			heldBy[agg] = m.EventID
		}
	}
	if len(failed) == 0 {
		return nil
	}
	return &PartialError{Failed: failed}
}

// handle runs the handler of m's event type, turning a panic into an error.
// The lock is not held while the handler runs, so a handler may call
// Handle.
func (h *Handlers) handle(ctx context.Context, m Message) (err error) {
	h.mu.RLock()
	fn, ok := h.handlers[m.EventType]
	h.mu.RUnlock()
	if !ok {
		if h.unhandled == SkipUnhandled {
			return nil
		}
		return Permanent(fmt.Errorf("%w: %q", ErrNoHandler, m.EventType))
	}
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%w: handler for %q, event %s: %v", ErrPublisherPanic, m.EventType, m.EventID, r)
		}
	}()
	return fn(ctx, m)
}
