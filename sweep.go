package outbox

import (
	"context"
	"fmt"
	"strings"
	"time"
)

// RequeueFilter selects the dead-lettered (failed) rows that
// [Dispatcher.Requeue] moves. Each field that is set narrows the
// selection; the zero value matches every failed row.
type RequeueFilter struct {
	// EventIDs, when not empty, limits the requeue to these events.
	EventIDs []string
	// EventTypes, when not empty, limits the sweep to these event types.
	EventTypes []string
	// FailedBefore, when not zero, limits the sweep to rows dead-lettered
	// before it.
	FailedBefore time.Time
	// Limit bounds how many rows one call moves, oldest failure first
	// (default, and when zero or negative: the dispatcher's sweep limit,
	// see [WithSweepLimit]).
	Limit int
}

// RetryFailed is the retry_failed sweep: it moves up to the sweep limit of
// dead-lettered (failed) rows, oldest failure first, back to pending with
// their attempt count reset, and returns how many it moved. Their
// last_error is kept until they are delivered. The events parked behind
// them are made due at once.
func (d *Dispatcher) RetryFailed(ctx context.Context) (int, error) {
	return d.Requeue(ctx, RequeueFilter{})
}

// Requeue is a person's requeue: it moves the failed rows that f selects
// back to pending, whatever made them fail and however often they were
// revived before, with their attempt count reset, and returns how many it
// moved. The events parked behind them are made due with them. It is what
// outboxctl and the dashboard call.
func (d *Dispatcher) Requeue(ctx context.Context, f RequeueFilter) (int, error) {
	limit := f.Limit
	if limit <= 0 {
		limit = d.sweepLimit
	}
	now := time.Now()
	where := []string{"delivery_state = 'failed'"}
	var args []any
	if len(f.EventIDs) > 0 {
		where = append(where, "event_id IN (?"+strings.Repeat(", ?", len(f.EventIDs)-1)+")")
		for _, id := range f.EventIDs {
			args = append(args, id)
		}
	}
	if len(f.EventTypes) > 0 {
		where = append(where, "event_type IN (?"+strings.Repeat(", ?", len(f.EventTypes)-1)+")")
		for _, t := range f.EventTypes {
			args = append(args, t)
		}
	}
	if !f.FailedBefore.IsZero() {
		where = append(where, "updated_at < ?")
		args = append(args, d.d.timeArg(f.FailedBefore))
	}
	ts := d.d.timeArg(now)
	args = append([]any{ts, ts}, append(args, limit)...)
	res, err := d.db.Statement.ConnPool.QueryContext(ctx, d.planTag()+d.d.bind(`UPDATE `+d.t.records+` SET
	delivery_state = 'pending', delivery_attempts = 0, next_attempt_at = ?, updated_at = ?,
	locked_until = NULL, batch_id = NULL
WHERE id IN (
	SELECT id FROM `+d.t.records+` WHERE `+strings.Join(where, " AND ")+`
	ORDER BY updated_at, id LIMIT ?`+d.d.skipLocked()+`
)
RETURNING aggregate_type, aggregate_id`), args...)
	if err != nil {
		return 0, fmt.Errorf("outbox: retry failed: %w", err)
	}
	n := 0
	revived := map[[2]string]bool{}
	for res.Next() {
		var agg [2]string
		if err := res.Scan(&agg[0], &agg[1]); err != nil {
			res.Close()
			return n, fmt.Errorf("outbox: retry failed: %w", err)
		}
		revived[agg] = true
		n++
	}
	res.Close()
	if err := res.Err(); err != nil {
		return n, fmt.Errorf("outbox: retry failed: %w", err)
	}
	if n > 0 {
		d.log.Info("outbox: dead-lettered messages back to pending", "count", n)
		d.unpark(ctx, revived, now)
	}
	return n, nil
}

// unpark makes the waiting events of the revived aggregates due now: they
// were parked behind the dead letter (see parkBlocked) and would otherwise
// wait up to a lease. Those in retry are among them: events that the
// dead letter's batch did not attempt, after an earlier attempt of their
// own. It is an optimisation, so an error is only logged.
func (d *Dispatcher) unpark(ctx context.Context, aggregates map[[2]string]bool, now time.Time) {
	ts := d.d.timeArg(now)
	args := []any{ts, ts, ts}
	rows := make([]string, 0, len(aggregates))
	for agg := range aggregates {
		rows = append(rows, "(?, ?)")
		args = append(args, agg[0], agg[1])
	}
	_, err := d.db.Statement.ConnPool.ExecContext(ctx, d.planTag()+d.d.bind(`UPDATE `+d.t.records+` SET next_attempt_at = ?, updated_at = ?
WHERE delivery_state IN ('pending', 'retry') AND next_attempt_at > ?
	AND (aggregate_type, aggregate_id) IN (VALUES `+strings.Join(rows, ", ")+`)`), args...)
	if err != nil {
		d.log.Warn("outbox: could not release the events parked behind revived dead letters; they follow within a lease", "error", err)
	}
}

// Cleanup deletes delivered rows whose delivered_at is older than the
// retention (see [WithRetention]), in statements of at most the sweep limit
// each, until none is left or ctx ends. It never touches a row that is not
// delivered, nor the per-aggregate sequence table, so sequences continue
// after cleanup. A deleted row's idempotency key is free again. It returns
// how many rows it deleted.
func (d *Dispatcher) Cleanup(ctx context.Context) (int, error) {
	cutoff := d.d.timeArg(time.Now().Add(-d.retention))
	total := 0
	for {
		res, err := d.db.Statement.ConnPool.ExecContext(ctx, d.planTag()+d.d.bind(`DELETE FROM `+d.t.records+` WHERE id IN (
	SELECT id FROM `+d.t.records+` WHERE delivery_state = 'delivered' AND delivered_at < ?
	ORDER BY delivered_at LIMIT ?`+d.d.skipLocked()+`
)`), cutoff, d.sweepLimit)
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
