package inbox

import (
	"context"
	"errors"
	"fmt"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
)

// Outcome is what became of one message of a batch handled through the
// inbox.
type Outcome string

// The outcomes of [Inbox.HandleBatch].
const (
	// Handled: the message was applied and its id recorded, in one
	// committed transaction.
	Handled Outcome = "handled"
	// Duplicate: the message's id was recorded before; it was not applied
	// again.
	Duplicate Outcome = "duplicate"
	// Failed: applying the message failed and nothing of it was recorded;
	// Result.Err says why.
	Failed Outcome = "failed"
	// NotAttempted: the message was not tried, because an earlier message
	// of its aggregate failed in the same batch (applying it would break
	// the aggregate's order) or because the context ended.
	NotAttempted Outcome = "not_attempted"
)

// Result is the outcome of one message of a batch.
type Result struct {
	// EventID is the message's Message.EventID.
	EventID string `json:"event_id"`
	// Outcome is what became of it.
	Outcome Outcome `json:"outcome"`
	// Err is why the message failed or was not attempted; nil otherwise.
	Err error `json:"-"`
}

// ApplyFunc applies one message: the consumer's writes, through tx, the
// transaction that also records the message's id.
type ApplyFunc func(tx *gorm.DB, m outbox.Message) error

var errNilApply = errors.New("inbox: handle batch: apply is nil")

// HandleBatch handles the messages of b in order, each through
// [Inbox.HandleMessage] in a transaction of its own, and returns one
// result per message, in b's order. After a message fails, the later
// messages of the same aggregate (AggregateType and AggregateID) are not
// attempted, so that each aggregate is applied in sequence order; those
// of other aggregates are. Once ctx ends, the remaining messages are not
// attempted. A nil apply fails every message.
func (in *Inbox) HandleBatch(ctx context.Context, b outbox.Batch, apply ApplyFunc) []Result {
	results := make([]Result, len(b.Messages))
	if apply == nil {
		for i, m := range b.Messages {
			results[i] = Result{EventID: m.EventID, Outcome: Failed, Err: errNilApply}
		}
		return results
	}
	type aggregate struct{ typ, id string }
	failed := make(map[aggregate]string) // aggregate -> event id that failed
	for i, m := range b.Messages {
		results[i].EventID = m.EventID
		agg := aggregate{m.AggregateType, m.AggregateID}
		if first, ok := failed[agg]; ok {
			results[i].Outcome = NotAttempted
			results[i].Err = fmt.Errorf("%w: %s of the same aggregate failed earlier in the batch", outbox.ErrNotAttempted, first)
			continue
		}
		if err := ctx.Err(); err != nil {
			results[i].Outcome = NotAttempted
			results[i].Err = fmt.Errorf("%w: %w", outbox.ErrNotAttempted, err)
			continue
		}
		handled, err := in.HandleMessage(ctx, m, func(tx *gorm.DB) error { return apply(tx, m) })
		switch {
		case err != nil:
			results[i].Outcome = Failed
			results[i].Err = err
			failed[agg] = m.EventID
		case handled:
			results[i].Outcome = Handled
		default:
			results[i].Outcome = Duplicate
		}
	}
	return results
}
