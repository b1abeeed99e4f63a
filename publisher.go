package outbox

import (
	"context"
	"encoding/json"
	"time"
)

// Message is one outbox event as a [Publisher] receives it.
//
// Messages are delivered at least once: a consumer deduplicates on EventID
// (or IdempotencyKey). Within one aggregate, Sequence is 1, 2, 3, ... in
// commit order with no gaps, and the dispatcher hands out sequence n+1 only
// after sequence n has been accepted, or in the same batch, after n.
type Message struct {
	// EventID is the event's unique identifier (outbox_records.event_id).
	EventID string `json:"event_id"`
	// EventType is the kind of fact, for example "order.created".
	EventType string `json:"event_type"`
	// AggregateType and AggregateID name the entity the event is about.
	AggregateType string `json:"aggregate_type"`
	AggregateID   string `json:"aggregate_id"`
	// Sequence is the event's position within its aggregate, starting at 1.
	Sequence int64 `json:"sequence"`
	// IdempotencyKey is the key the event was written under; it defaults to
	// EventID.
	IdempotencyKey string `json:"idempotency_key"`
	// Payload is the event's JSON document, exactly as stored.
	Payload json.RawMessage `json:"payload"`
	// Headers are the event's string headers, possibly nil.
	Headers map[string]string `json:"headers,omitempty"`
	// OccurredAt is when the fact happened, as the writer said.
	OccurredAt time.Time `json:"occurred_at"`
	// Attempt is 1 on the first delivery attempt, 2 on the second, ...
	Attempt int `json:"attempt"`
}

// Batch is a group of messages handed to a [Publisher] in one call.
//
// ID is stored in outbox_records.batch_id for every message of the batch and
// is fresh for every claim, so a gateway can use it as the idempotency key of
// the whole batch. Messages of one aggregate appear in Sequence order.
type Batch struct {
	ID       string    `json:"batch_id"`
	Messages []Message `json:"messages"`
}

// Publisher delivers batches of messages to the outside world.
//
// Publish returns nil when every message was accepted. To report a partly
// accepted batch, it returns a [*PartialError] (possibly wrapped) that names
// the messages that were not accepted. Any other error means that no
// message was accepted: all of the batch is retried with backoff, or, when
// [IsPermanent] is true of the error (see [Permanent]), dead-lettered at
// once.
//
// An error may say how long to wait before the next attempt by
// implementing [RetryDelayer] (outboxhttp's StatusError does, from
// Retry-After); the dispatcher then waits at least that long.
//
// Messages of one aggregate appear in the batch in Sequence order. A
// publisher that accepts messages one by one must not accept a message
// after a failed one of the same aggregate; it reports [ErrNotAttempted]
// for those instead (one it accepts all the same is delivered again, after
// the failed one).
//
// Publish is called outside any database transaction, with a context whose
// deadline is shorter than the dispatcher's lease. It must honour that
// context: a batch whose publish outlives the lease may be delivered again by
// another dispatcher.
type Publisher interface {
	Publish(ctx context.Context, b Batch) error
}

// PublisherFunc adapts an ordinary function to the [Publisher] interface.
type PublisherFunc func(ctx context.Context, b Batch) error

// Publish calls f(ctx, b).
func (f PublisherFunc) Publish(ctx context.Context, b Batch) error { return f(ctx, b) }
