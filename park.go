package outbox

import (
	"context"
	"fmt"
	"time"

	"github.com/gorm-outbox/outbox/internal/dialect"
)

// parkBlocked keeps the rows that a claim must hold back out of the
// windows of the claims after it. Rows of an aggregate wait for its head
// (its first undelivered event); when the head waits for a retry, was
// dead-lettered, or comes after them in due order (it was retried, its
// lease passed, or they were written while it waited), they would fill
// every window and no claim would reach the head or the rows behind it.
// parkBlocked moves them to when the head can move: the head's own due
// time, which puts them behind it, or one lease from now for a dead letter
// (it comes back through RetryFailed or Requeue, which make the rows
// behind it due again; the lease bounds the wait if it comes back some
// other way). Rows behind a head in flight are left alone: it settles
// within the publish timeout, or its lease passes. After a settle that
// came after its lease (see claim.go), an aggregate's first undelivered
// event may sit before delivered ones; parking takes it for the head all
// the same, so the events after the delivered ones may wait as long as it
// does (a lease at most behind a dead letter) when parking reaches them
// before a claim does.
//
// It looks at the scanWindow oldest due rows, runs at most once per poll
// interval per dispatcher, and only after a claim that was not full and
// held rows back behind an event that is not in flight (claimResult's
// blocked): rows behind another dispatcher's batch need no parking, and
// with several dispatchers on one backlog a look that finds nothing cost
// more than a second of the server's time in the benchmark. An error is
// logged, not returned: the next claim that is held back tries again. It
// reports whether it moved any row.
func (d *Dispatcher) parkBlocked(ctx context.Context) (parked bool) {
	now := time.Now()
	last := d.lastPark.Load()
	if last != 0 && now.Sub(time.Unix(0, last)) < d.pollInterval {
		return false
	}
	if !d.lastPark.CompareAndSwap(last, now.UnixNano()) {
		return false
	}
	blockers, err := d.blockers(ctx, now)
	moved := int64(0)
	if err == nil {
		moved, err = d.park(ctx, blockers, now)
	}
	if err != nil {
		d.log.Warn("outbox: could not park the rows behind events that wait; claims step over them meanwhile", "error", err)
	}
	return moved > 0
}

// scanWindow is how many of the oldest due rows parkBlocked looks at for
// a dispatcher of batch size n: several windows' worth, so that it reaches
// past the rows that other dispatchers' batches hold back.
func scanWindow(n int) int { return max(4*n, 1000) }

// blocker is the head of an aggregate that holds back due events of its
// aggregate, and until when those should wait.
type blocker struct {
	aggregateType, aggregateID string
	sequence                   int64
	state                      string
	until                      dialect.Time
}

// blockers finds the heads that hold back due rows of the aggregates
// seen among the oldest due rows: a dead letter (the rows wait for one
// lease), or a head that waits for a retry, or whose lease passed, while
// rows of its aggregate come before it in due order (they wait until its
// time, which puts them behind it).
func (d *Dispatcher) blockers(ctx context.Context, now time.Time) ([]blocker, error) {
	res, err := d.pool().QueryContext(ctx, d.st.Blockers, d.d.TimeArg(now), scanWindow(d.batchSize), d.d.TimeArg(now.Add(d.lease)))
	if err != nil {
		return nil, fmt.Errorf("find blockers: %w", err)
	}
	defer res.Close()
	var out []blocker
	for res.Next() {
		var b blocker
		if err := res.Scan(&b.aggregateType, &b.aggregateID, &b.sequence, &b.state, &b.until); err != nil {
			return nil, fmt.Errorf("find blockers: %w", err)
		}
		out = append(out, b)
	}
	return out, res.Err()
}

// park moves the due rows behind each blocker to its time, one statement
// per blocker through the aggregate index, provided the blocker is still
// in the state it was read in (a requeue may have brought a dead letter
// back meanwhile, or a claim taken the head). It returns how many rows it
// moved.
func (d *Dispatcher) park(ctx context.Context, blockers []blocker, now time.Time) (moved int64, err error) {
	ts := d.d.TimeArg(now)
	for _, b := range blockers {
		r, err := d.pool().ExecContext(ctx, d.st.Park, d.d.TimeArg(b.until.Time), ts,
			b.aggregateType, b.aggregateID, b.sequence, b.state)
		if err != nil {
			return moved, fmt.Errorf("park %s/%s: %w", b.aggregateType, b.aggregateID, err)
		}
		if n, err := r.RowsAffected(); err == nil {
			moved += n
		}
	}
	return moved, nil
}

// unpark makes the waiting events of the revived aggregates due now: they
// were parked behind the dead letter and would otherwise wait up to a
// lease. Those in retry are among them: events that the dead letter's
// batch did not attempt, after an earlier attempt of their own. It is an
// optimisation, so an error is only logged.
func (d *Dispatcher) unpark(ctx context.Context, aggregates map[dialect.Aggregate]bool, now time.Time) {
	list := make([]dialect.Position, 0, len(aggregates))
	for k := range aggregates {
		list = append(list, dialect.Position{Aggregate: k})
	}
	if _, err := d.pool().ExecContext(ctx, d.st.Unpark, append([]any{d.d.TimeArg(now)}, d.d.EventList(list)...)...); err != nil {
		d.log.Warn("outbox: could not release the events parked behind revived dead letters; they follow within a lease", "error", err)
	}
}
