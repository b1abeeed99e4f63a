package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/gorm-outbox/outbox/internal/dialect"
)

// settle records the outcome of a published batch. Rows with the same
// outcome (state, attempts, next attempt, error) are settled together, by
// primary key, in one statement; all the accepted rows make one outcome,
// whatever their attempts, so a batch accepted as a whole takes one
// statement. Every row is updated only if it is still
// delivering under this batch's id: a row whose lease was taken over by
// another claim is left alone. It returns how many rows it marked
// delivered.
func (d *Dispatcher) settle(ctx context.Context, batchID string, rows []claimed, pubErr error) (int, error) {
	now := time.Now()
	outcomes := d.outcomes(rows, pubErr)
	var (
		groups    = map[settleKey][]int64{}
		order     []settleKey
		delivered int
		failed    int
		// One backoff per attempt count and error, so that the rows of a
		// batch that failed together come back together.
		backoffs = map[backoffKey]time.Duration{}
	)
	for i, r := range rows {
		err := outcomes[i]
		// Every accepted row is settled by one statement, whatever its
		// attempts (settleGroup counts the attempt in SQL): split, a
		// failure between the statements could leave an event marked
		// delivered behind an accepted one of its aggregate that is not,
		// and the claim checks only the event just before (claim.go).
		k := settleKey{state: StateDelivered, next: now}
		switch {
		case err == nil:
			delivered++
		case errors.Is(err, errCancelled):
			// Back as it was, due at once: the round was stopped, nothing
			// was tried.
			k.state, k.attempts = StateRetry, r.attempts
			if r.attempts == 0 {
				k.state = StatePending
			}
		case errors.Is(err, ErrNotAttempted):
			// Back without counting an attempt, after a poll interval so that
			// a publisher that keeps declining cannot spin the dispatcher.
			k.state, k.attempts, k.next = StateRetry, r.attempts, now.Add(d.pollInterval)
			if r.attempts == 0 {
				k.state = StatePending
			}
		default:
			k.attempts = r.attempts + 1
			k.lastErr, k.hasErr = truncate(err.Error(), maxErrorLen), true
			if IsPermanent(err) || k.attempts >= d.maxAttempts {
				k.state, k.kind = StateFailed, failureExhausted
				if IsPermanent(err) {
					k.kind = failurePermanent
				}
				failed++
				d.log.Error("outbox: message dead-lettered", "batch_id", batchID, "event_id", r.msg.EventID,
					"event_type", r.msg.EventType, "aggregate_type", r.msg.AggregateType, "aggregate_id", r.msg.AggregateID,
					"sequence", r.msg.Sequence, "attempts", k.attempts, "failure_kind", k.kind, "error", err)
			} else {
				bk := backoffKey{k.attempts, k.lastErr}
				wait, ok := backoffs[bk]
				if !ok {
					wait = max(d.retry.Backoff(k.attempts, err), retryDelay(err))
					backoffs[bk] = wait
				}
				k.state, k.next = StateRetry, now.Add(wait)
			}
		}
		if _, seen := groups[k]; !seen {
			order = append(order, k)
		}
		groups[k] = append(groups[k], r.id)
	}
	settled := 0
	for _, k := range order {
		n, err := d.settleGroup(ctx, batchID, k, groups[k], now)
		if err != nil {
			if pubErr != nil {
				// The publish's outcome is logged nowhere else.
				return 0, fmt.Errorf("outbox: settle batch %s after its publish failed (%w): %w", batchID, pubErr, err)
			}
			return 0, fmt.Errorf("outbox: settle batch %s: %w", batchID, err)
		}
		settled += n
		if k.state == StateDelivered && n < len(groups[k]) {
			delivered -= len(groups[k]) - n
		}
	}
	if settled < len(rows) {
		d.log.Warn("outbox: lease lost before settle; another dispatcher owns those rows now",
			"batch_id", batchID, "rows", len(rows), "settled", settled)
	}
	if pubErr != nil {
		msg, level := "outbox: batch not accepted", slog.LevelWarn
		if delivered > 0 {
			msg = "outbox: batch partly accepted"
		}
		if errors.As(pubErr, new(*cancelledError)) {
			msg, level = "outbox: dispatch cancelled; the messages not accepted are due again, no attempt counted", slog.LevelInfo
		}
		d.log.Log(ctx, level, msg, "batch_id", batchID, "messages", len(rows),
			"delivered", delivered, "dead_lettered", failed, "error", pubErr)
	}
	return delivered, nil
}

// settleKey is one outcome; rows that share it are settled together.
type settleKey struct {
	state    string
	attempts int
	next     time.Time
	lastErr  string
	hasErr   bool
	kind     string // failure_kind of a failed row: failurePermanent or failureExhausted
}

// The failure kinds of a dead-lettered row (failure_kind): the retry_failed
// sweep revives only rows that ran out of attempts.
const (
	failurePermanent = "permanent"
	failureExhausted = "exhausted"
)

// settleGroup applies one outcome to the rows ids, by primary key, and
// returns how many it updated: those the batch still leased. Delivered
// rows count their attempt in SQL, so that a batch accepted whole is one
// statement.
func (d *Dispatcher) settleGroup(ctx context.Context, batchID string, k settleKey, ids []int64, now time.Time) (int, error) {
	ts := d.d.TimeArg(now)
	var (
		res sql.Result
		err error
	)
	// A settle runs again after a deadlock or lock wait timeout (MySQL).
	err = dialect.RetryLocks(ctx, d.d, func() (err error) {
		if k.state == StateDelivered {
			res, err = d.pool().ExecContext(ctx, d.st.SettleDelivered, ts, batchID, d.d.IDList(ids))
			return err
		}
		var lastErr, kind any // NULL keeps the last failure's reason (not attempted)
		if k.hasErr {
			lastErr = k.lastErr
		}
		if k.kind != "" {
			kind = k.kind
		}
		res, err = d.pool().ExecContext(ctx, d.st.SettleOther, k.state, k.attempts, d.d.TimeArg(k.next),
			lastErr, kind, ts, batchID, d.d.IDList(ids))
		return err
	})
	if err != nil {
		return 0, err
	}
	n, err := res.RowsAffected()
	return int(n), err
}

type backoffKey struct {
	attempts int
	err      string
}

// RetryDelayer is implemented by publish errors that know how long to wait
// before the next attempt, such as an HTTP 429 or 503 with Retry-After.
// The dispatcher waits at least that long, and longer if its retry policy
// says so.
type RetryDelayer interface {
	RetryDelay() time.Duration
}

// retryDelay returns the delay err asks for, if any error it wraps is a
// RetryDelayer.
func retryDelay(err error) time.Duration {
	var rd RetryDelayer
	if errors.As(err, &rd) {
		return rd.RetryDelay()
	}
	return 0
}

// errAcceptedOutOfOrder is the outcome of a message that a publisher
// accepted after a failed one of the same aggregate in the batch, against
// the Publisher contract: it is put back as not attempted.
var errAcceptedOutOfOrder = fmt.Errorf("%w: accepted after a failed message of its aggregate in the batch", ErrNotAttempted)

// errBehindUnreadable is the outcome of a row withheld from the publisher
// because an earlier row of its aggregate in the batch cannot be read: it
// is put back, and waits behind that row's dead letter.
var errBehindUnreadable = fmt.Errorf("%w: an earlier event of its aggregate in the batch cannot be read", ErrNotAttempted)

// errCancelled is the outcome of a message that the publisher did not
// accept in a round whose context ended (see cancelledError): it is put
// back as not attempted, due again at once.
var errCancelled = fmt.Errorf("%w: its dispatch was cancelled", ErrNotAttempted)

// outcomes returns, per row, nil when the publisher accepted it or why not.
// Rows withheld from the publisher (unreadable) have their own outcome.
func (d *Dispatcher) outcomes(rows []claimed, pubErr error) []error {
	out := make([]error, len(rows))
	held := unreadable(rows)
	var partial *PartialError
	isPartial := errors.As(pubErr, &partial)
	cancelled := errors.As(pubErr, new(*cancelledError))
	failedAggregates := map[dialect.Aggregate]bool{}
	for i, r := range rows {
		agg := dialect.Aggregate{Type: r.msg.AggregateType, ID: r.msg.AggregateID}
		switch {
		case r.bad != nil:
			out[i] = r.bad
			d.log.Error("outbox: event cannot be read into a message; dead-lettering it",
				"event_id", r.msg.EventID, "aggregate_type", agg.Type, "aggregate_id", agg.ID, "sequence", r.msg.Sequence, "error", r.bad)
		case held.withholds(r):
			out[i] = errBehindUnreadable
		case pubErr == nil:
		case isPartial:
			out[i] = partial.Failed[r.msg.EventID]
			if out[i] != nil {
				failedAggregates[agg] = true
			} else if failedAggregates[agg] {
				// Marked delivered, it would let the events after it go
				// before the failed one is accepted (a claim checks only
				// the event just before, see claim.go): it comes back
				// after the failed one instead.
				out[i] = errAcceptedOutOfOrder
				d.log.Error("outbox: publisher accepted a message after a failed one of the same aggregate; per-aggregate order is broken downstream, and the message will be delivered again after the failed one",
					"event_id", r.msg.EventID, "aggregate_type", agg.Type, "aggregate_id", agg.ID, "sequence", r.msg.Sequence)
			}
		default:
			out[i] = pubErr
		}
		if cancelled && out[i] != nil && r.bad == nil && !held.withholds(r) {
			out[i] = errCancelled
		}
	}
	return out
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}
