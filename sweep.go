package outbox

import (
	"context"
	"database/sql"
	"fmt"
	"time"

	"github.com/gorm-outbox/outbox/internal/dialect"
)

// DefaultMaxRevivals is how many times the retry_failed sweep revives one
// dead letter unless [WithMaxRevivals] says otherwise.
const DefaultMaxRevivals = 3

// WithMaxRevivals sets how many times [Dispatcher.RetryFailed] brings one
// event that ran out of attempts back to pending (default
// [DefaultMaxRevivals]; 0 turns the sweep off). Each revival gives the
// event [WithMaxAttempts] more attempts; after the last, it stays failed
// for a person to look at and [Dispatcher.Requeue].
func WithMaxRevivals(n int) DispatcherOption {
	return func(d *Dispatcher) error {
		if n < 0 {
			return fmt.Errorf("%w: WithMaxRevivals: %d is negative", ErrInvalidOption, n)
		}
		d.maxRevivals = n
		return nil
	}
}

// RequeueFilter selects the dead-lettered (failed) rows that
// [Dispatcher.Requeue] moves, and [Dispatcher.Discard] takes. Each field
// that is set narrows the selection; the zero value matches every failed
// row.
type RequeueFilter struct {
	// EventIDs, when not empty, limits the requeue to these events.
	EventIDs []string
	// EventTypes, when not empty, limits the requeue to these event types.
	EventTypes []string
	// FailedBefore, when not zero, limits the requeue to rows
	// dead-lettered before it.
	FailedBefore time.Time
	// Limit bounds how many rows one call moves, oldest failure first
	// (default, and when zero or negative: the dispatcher's sweep limit,
	// see [WithSweepLimit]).
	Limit int
}

// RetryFailed is the retry_failed sweep, which [DefaultSchedule] runs every
// minute: it gives events that failed for a transient reason a few more
// rounds. It moves back to pending, with their attempt count reset, the
// failed rows that ran out of attempts ([WithMaxAttempts]) and were revived
// fewer than [WithMaxRevivals] times, up to the sweep limit, oldest failure
// first, and counts the revival on each (the revivals column). It leaves
// alone the rows that failed for good: a [Permanent] error, an event type
// without a handler, a row that cannot be read, and rows that failed
// before the schema recorded why. Their last_error is kept until they are
// delivered. The events parked behind the revived ones are made due at
// once. It returns how many rows it moved.
func (d *Dispatcher) RetryFailed(ctx context.Context) (int, error) {
	if d.maxRevivals == 0 {
		return 0, nil
	}
	now := time.Now()
	n, err := d.revive(ctx, now, d.st.Revive, d.d.TimeArg(now), d.maxRevivals, d.sweepLimit)
	if err != nil {
		return n, fmt.Errorf("outbox: retry failed: %w", err)
	}
	if n > 0 {
		d.log.Info("outbox: dead-lettered messages revived by the retry_failed sweep", "count", n)
	}
	return n, nil
}

// Requeue is a person's requeue: it moves the failed rows that f selects
// back to pending, whatever made them fail and however often the sweep
// revived them, with their attempt and revival counts reset, and returns
// how many it moved. The events parked behind them are made due with them.
// It is what outboxctl and the dashboard call.
func (d *Dispatcher) Requeue(ctx context.Context, f RequeueFilter) (int, error) {
	now := time.Now()
	n, err := d.revive(ctx, now, d.st.Requeue, append([]any{d.d.TimeArg(now)}, d.filterArgs(f)...)...)
	if err != nil {
		return n, fmt.Errorf("outbox: requeue: %w", err)
	}
	if n > 0 {
		d.log.Info("outbox: dead-lettered messages requeued", "count", n)
	}
	return n, nil
}

// filterArgs returns the arguments by which the Requeue and Discard
// statements select the rows of f: limit, failed before, ids, types (a
// NULL time or list selects all).
func (d *Dispatcher) filterArgs(f RequeueFilter) []any {
	limit := f.Limit
	if limit <= 0 {
		limit = d.sweepLimit
	}
	var before any
	if !f.FailedBefore.IsZero() {
		before = d.d.TimeArg(f.FailedBefore)
	}
	var ids, types []string
	if len(f.EventIDs) > 0 {
		ids = f.EventIDs
	}
	if len(f.EventTypes) > 0 {
		types = f.EventTypes
	}
	return []any{limit, before, d.d.TextList(ids), d.d.TextList(types)}
}

// revive runs a statement that moves failed rows back to pending and
// returns their aggregates, and makes the rows parked behind them due.
func (d *Dispatcher) revive(ctx context.Context, now time.Time, query string, args ...any) (int, error) {
	var (
		n       int
		revived map[dialect.Aggregate]bool
	)
	// In the claim's transaction: on MySQL the statement is a list.
	err := d.d.ClaimTx(ctx, d.db, func(q dialect.Querier) error {
		n, revived = 0, map[dialect.Aggregate]bool{}
		res, err := q.QueryContext(ctx, query, args...)
		if err != nil {
			return err
		}
		defer res.Close()
		for res.Next() {
			var k dialect.Aggregate
			if err := res.Scan(&k.Type, &k.ID); err != nil {
				return err
			}
			revived[k] = true
			n++
		}
		return res.Err()
	})
	if err != nil {
		return 0, err
	}
	if n > 0 {
		d.unpark(ctx, revived, now)
		d.Notify()
	}
	return n, nil
}

// Cleanup deletes delivered rows whose delivered_at is older than the
// retention (see [WithRetention]), in statements of at most the sweep limit
// each, until none is left or ctx ends. It never touches a row that is not
// delivered, nor the per-aggregate sequence table, so sequences continue
// after cleanup. A deleted row's idempotency key is free again. It returns
// how many rows it deleted.
func (d *Dispatcher) Cleanup(ctx context.Context) (int, error) {
	cutoff := d.d.TimeArg(time.Now().Add(-d.retention))
	total := 0
	for {
		var res sql.Result
		res, err := d.pool().ExecContext(ctx, d.st.Cleanup, cutoff, d.sweepLimit)
		if err != nil {
			return total, fmt.Errorf("outbox: cleanup: %w", err)
		}
		n, err := res.RowsAffected()
		if err != nil {
			return total, fmt.Errorf("outbox: cleanup: %w", err)
		}
		total += int(n)
		if int(n) < d.sweepLimit || ctx.Err() != nil {
			return total, nil
		}
	}
}
