package outbox

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"
)

// settle records the outcome of a published batch in one statement.
// Every row is updated only if it is still delivering under this batch's
// id: a row whose lease was taken over by another claim is left alone. It
// returns how many rows it marked delivered.
func (d *Dispatcher) settle(ctx context.Context, batchID string, rows []claimed, pubErr error) (int, error) {
	now := time.Now()
	outcomes := d.outcomes(rows, pubErr)
	var (
		values    []string
		args      []any
		delivered int
		failed    int
		// One backoff per attempt count and error, so that the rows of a
		// batch that failed together come back together.
		backoffs = map[backoffKey]time.Duration{}
	)
	for i, r := range rows {
		err := outcomes[i]
		state, attempts, next, lastErr := StateDelivered, r.attempts+1, now, (*string)(nil)
		switch {
		case err == nil:
			delivered++
		case errors.Is(err, ErrNotAttempted):
			// Back without counting an attempt, after a poll interval so that
			// a publisher that keeps declining cannot spin the dispatcher.
			state, attempts, next = StateRetry, r.attempts, now.Add(d.pollInterval)
			if r.attempts == 0 {
				state = StatePending
			}
		default:
			msg := truncate(err.Error(), maxErrorLen)
			lastErr = &msg
			if IsPermanent(err) || attempts >= d.maxAttempts {
				state = StateFailed
				failed++
			} else {
				k := backoffKey{attempts, err.Error()}
				wait, ok := backoffs[k]
				if !ok {
					wait = max(d.retry.Backoff(attempts, err), retryDelay(err))
					backoffs[k] = wait
				}
				state, next = StateRetry, now.Add(wait)
			}
		}
		values = append(values, d.d.row("bigint", "text", "integer", "timestamptz", "text"))
		args = append(args, r.id, state, attempts, d.d.timeArg(next), lastErr)
	}
	ts := d.d.timeArg(now)
	args = append(args, ts, ts, batchID)
	res, err := d.db.Statement.ConnPool.ExecContext(ctx, d.d.bind(`WITH v(vid, vstate, vattempts, vnext, verror) AS (VALUES `+
		strings.Join(values, ", ")+`)
UPDATE `+d.t.records+` SET
	delivery_state = vstate,
	delivery_attempts = vattempts,
	next_attempt_at = vnext,
	last_error = CASE WHEN vstate = 'delivered' THEN NULL ELSE coalesce(verror, last_error) END,
	locked_until = NULL,
	delivered_at = CASE WHEN vstate = 'delivered' THEN `+d.d.row("timestamptz")+` ELSE NULL END,
	updated_at = ?
FROM v
WHERE id = vid AND batch_id = ? AND delivery_state = 'delivering'`), args...)
	if err != nil {
		return 0, fmt.Errorf("outbox: settle batch %s: %w", batchID, err)
	}
	if n, err := res.RowsAffected(); err == nil && int(n) < len(rows) {
		d.log.Warn("outbox: lease lost before settle; another dispatcher owns those rows now",
			"batch_id", batchID, "rows", len(rows), "settled", n)
		if int(n) < delivered {
			delivered = int(n)
		}
	}
	if pubErr != nil {
		msg := "outbox: batch not accepted"
		if delivered > 0 {
			msg = "outbox: batch partly accepted"
		}
		d.log.Warn(msg, "batch_id", batchID, "messages", len(rows),
			"delivered", delivered, "dead_lettered", failed, "error", pubErr)
	}
	return delivered, nil
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

// outcomes returns, per row, nil when the publisher accepted it or why not.
func (d *Dispatcher) outcomes(rows []claimed, pubErr error) []error {
	out := make([]error, len(rows))
	var partial *PartialError
	switch {
	case pubErr == nil:
	case errors.As(pubErr, &partial):
		failedAggregates := map[[2]string]bool{}
		for i, r := range rows {
			out[i] = partial.Failed[r.msg.EventID]
			agg := [2]string{r.msg.AggregateType, r.msg.AggregateID}
			if out[i] != nil {
				failedAggregates[agg] = true
			} else if failedAggregates[agg] {
				d.log.Error("outbox: publisher accepted a message after a failed one of the same aggregate; per-aggregate order is broken downstream",
					"event_id", r.msg.EventID, "aggregate_type", agg[0], "aggregate_id", agg[1], "sequence", r.msg.Sequence)
			}
		}
	default:
		for i := range out {
			out[i] = pubErr
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
